// Scale-out on one machine: three real normgrad-server processes on 127.0.0.1 (port 0 each,
// addresses read from their ready lines) behind one client balancing round-robin over an
// "ipv4:" address list. Proves that the load spreads (each replica's /metrics), that a replica
// killed with SIGKILL while it has calls in flight (its normgrad_inflight_streams gauge, read
// just before the kill) costs no request: those calls are retried onto the others (some call
// needed a second attempt) and every answer is the right one for its own request; and that a
// replica sent SIGTERM with calls in flight drains without any client seeing an error. Every
// loop is bounded in count and time.
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/rmsnorm/reference.h"
#include "normgrad/client.h"
#include "tests/common/child_process.h"

namespace normgrad {
namespace {

constexpr uint64_t kRows = 16;
constexpr uint32_t kHidden = 64;
// The signal tests' calls: 64 rows of 512 in chunks of 2 rows (kSignalChunkBytes of x), so a
// call is 32 round trips long and a replica has calls in flight most of the time.
constexpr uint64_t kSignalRows = 64;
constexpr uint32_t kSignalHidden = 512;
constexpr uint64_t kSignalChunkBytes = 2 * kSignalHidden * sizeof(float);

// One normgrad-server process (stdout on a pipe for the ready line, stderr inherited, SIGKILL
// if still running at the end) and the ports its ready line named.
class Replica {
 public:
  explicit Replica(testing::ChildProcess process) : process_(std::move(process)) {}

  static std::vector<std::string> Args() {
    return {NORMGRAD_SERVER_BINARY, "--listen=127.0.0.1:0", "--metrics-listen=127.0.0.1:0",
            "--backend=cpu",        "--cpu-threads=1",      "--worker-threads=2",
            "--shutdown-grace=20s"};
  }

  // Reads the ready line ("... grpc=127.0.0.1:P metrics=127.0.0.1:M ..."); false after `limit`.
  bool AwaitReady(absl::Duration limit) {
    ready_ = process_.AwaitReady(limit);
    return ready_.grpc_port > 0 && ready_.metrics_port > 0;
  }

  testing::ChildProcess& process() { return process_; }

  // GET /metrics; empty when unreachable.
  std::string Metrics() const {
    httplib::Client http("127.0.0.1", ready_.metrics_port);
    http.set_connection_timeout(5, 0);
    http.set_read_timeout(10, 0);
    httplib::Result res = http.Get("/metrics");
    if (!res || res->status != 200) return "";
    return res->body;
  }

  // An unlabelled gauge such as normgrad_inflight_streams; -1 when unreachable or absent.
  double Gauge(absl::string_view name) const {
    const std::string text = Metrics();
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (!absl::StartsWith(line, absl::StrCat(name, " "))) continue;
      double value = 0;
      if (absl::SimpleAtod(line.substr(name.size() + 1), &value)) return value;
    }
    return -1;
  }

  // Finished calls of `method` with code OK, from GET /metrics; -1 when unreachable.
  // Calls of `method` answered OK; a backward is either method (a batch that fits one message
  // is an RmsNormBackwardUnary call).
  double Served(absl::string_view method = "backward") const {
    const std::string text = Metrics();
    if (text.empty()) return -1;
    double total = 0;
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (!absl::StartsWith(line, "normgrad_requests_total{") ||
          !(method == "backward"
                ? absl::StrContains(line, "method=\"RmsNormBackward\"") ||
                      absl::StrContains(line, "method=\"RmsNormBackwardUnary\"")
                : absl::StrContains(line, absl::StrCat("method=\"", method, "\""))) ||
          !absl::StrContains(line, "code=\"OK\"")) {
        continue;
      }
      double value = 0;
      if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) total += value;
    }
    return total;
  }

  std::string address() const { return absl::StrCat("127.0.0.1:", ready_.grpc_port); }

 private:
  testing::ChildProcess process_;
  testing::ReadyLine ready_;
};

// The inputs of request `id` (seeded by id, so that an answer meant for another request
// cannot pass its check) and the reference gradients.
struct Request {
  std::vector<float> x, dy, gamma, dx, dgamma;
};
Request MakeRequest(int id, uint64_t rows = kRows, uint32_t hidden = kHidden) {
  Request r;
  std::mt19937 rng(1000 + id);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const auto fill = [&](std::vector<float>& v, size_t n) {
    v.resize(n);
    for (float& e : v) e = u(rng);
  };
  fill(r.x, rows * hidden);
  fill(r.dy, rows * hidden);
  fill(r.gamma, hidden);
  r.dx.resize(r.x.size());
  r.dgamma.resize(hidden);
  kernels::ReferenceBackward({r.x, r.dy, r.gamma, {}, rows, hidden, 1e-5f}, absl::MakeSpan(r.dx),
                             absl::MakeSpan(r.dgamma));
  return r;
}

// Largest |got - want| over the largest |want| (1 for empty or mismatched sizes).
double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return 1;
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::fabs(double{got[i]} - want[i]));
    scale = std::max(scale, std::fabs(double{want[i]}));
  }
  return err / scale;
}

struct Outcome {
  int answers = 0;  // results delivered for this id (must be exactly 1)
  absl::Status status;
  int attempts = 0;
  double dx_error = 1, dgamma_error = 1;
};

class ScaleOutTest : public ::testing::Test {
 protected:
  void StartReplicas(int n) {
    for (int i = 0; i < n; ++i) {
      absl::StatusOr<testing::ChildProcess> process = testing::ChildProcess::Start(Replica::Args());
      ASSERT_TRUE(process.ok()) << process.status();
      replicas_.push_back(std::make_unique<Replica>(*std::move(process)));
    }
    for (auto& r : replicas_) ASSERT_TRUE(r->AwaitReady(absl::Seconds(60)));
  }

  std::unique_ptr<Client> RoundRobinClient(uint64_t chunk_bytes = uint64_t{1} << 20) {
    std::vector<std::string> addresses;
    for (auto& r : replicas_) addresses.push_back(r->address());
    ClientOptions o;
    o.chunk_bytes = chunk_bytes;
    o.target = absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
    o.max_attempts = 5;  // enough to pass a dying replica more than once in a round-robin
    o.default_deadline = absl::Seconds(60);
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    // Round-robin only uses connected replicas: until all three are connected the first calls
    // would pile onto the first. Warm up with GetServerInfo until each has answered one.
    for (int i = 0; i < 100; ++i) {
      (void)(*c)->ServerInfo();
      bool all = true;
      for (auto& r : replicas_) all = all && r->Served("GetServerInfo") > 0;
      if (all) break;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return *std::move(c);
  }

  // Sends `count` Backward calls (request ids 0..count-1) from `threads` threads, each call
  // blocking. `trigger`, when set, runs on the calling thread once `trigger_at` calls have
  // finished (or after 120 s), while the rest are in flight.
  std::vector<Outcome> RunLoad(Client& client, int count, int threads, int trigger_at,
                               const std::function<void()>& trigger, uint64_t rows = kRows,
                               uint32_t hidden = kHidden) {
    std::vector<Request> requests;
    for (int id = 0; id < count; ++id) requests.push_back(MakeRequest(id, rows, hidden));
    std::vector<Outcome> outcomes(count);
    std::atomic<int> next{0};
    std::mutex mu;
    std::condition_variable finished;
    int done = 0;
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) {
      workers.emplace_back([&] {
        for (int i = 0; i < count; ++i) {  // bounded: at most `count` calls per thread
          const int id = next.fetch_add(1);
          if (id >= count) return;
          const Request& r = requests[id];
          absl::StatusOr<Gradients> g = client.Backward(r.x, r.dy, r.gamma, 1e-5f);
          std::lock_guard<std::mutex> lock(mu);
          Outcome& o = outcomes[id];
          ++o.answers;
          o.status = g.status();
          if (g.ok()) {
            o.attempts = g->attempts;
            o.dx_error = RelativeError(g->dx, r.dx);
            o.dgamma_error = RelativeError(g->dgamma, r.dgamma);
          }
          ++done;
          finished.notify_all();
        }
      });
    }
    if (trigger) {
      std::unique_lock<std::mutex> lock(mu);
      finished.wait_for(lock, std::chrono::seconds(120), [&] { return done >= trigger_at; });
    }
    if (trigger) trigger();
    for (std::thread& w : workers) w.join();
    return outcomes;
  }

  // Three replicas and 120 calls from 6 threads; once a third have finished, replica 1 gets
  // `signal` the moment its normgrad_inflight_streams gauge shows a call in flight (polled,
  // bounded). Every call must be answered once and right, and replicas 0 and 2 must have served
  // at least the calls after the signal (a killed replica's count dies with it). Returns
  // replica 1's waitpid status, nullopt if it still runs after `exit_limit` (or no client);
  // `retried` is the number of calls that needed more than one attempt.
  std::optional<int> SignalReplicaMidLoad(int signal, absl::Duration exit_limit, int& retried) {
    retried = 0;
    StartReplicas(3);
    if (HasFatalFailure()) return std::nullopt;
    std::unique_ptr<Client> client = RoundRobinClient(kSignalChunkBytes);
    if (client == nullptr) return std::nullopt;  // RoundRobinClient failed the test
    constexpr int kCalls = 120;
    double in_flight_at_signal = 0;
    int polls = 0;
    const auto signal_when_busy = [&] {
      for (; polls < 2000 && in_flight_at_signal < 1; ++polls) {
        in_flight_at_signal = replicas_[1]->Gauge("normgrad_inflight_streams");
      }
      replicas_[1]->process().Signal(signal);
    };
    retried = ExpectAllAnsweredOnceAndRight(RunLoad(*client, kCalls, 6, kCalls / 3,
                                                    signal_when_busy, kSignalRows, kSignalHidden));
    std::printf("replica 1 had %.0f calls in flight when it got signal %d (after %d polls)\n",
                in_flight_at_signal, signal, polls);
    EXPECT_GE(in_flight_at_signal, 1) << "the signal did not land on calls in flight";
    const std::optional<int> status = replicas_[1]->process().WaitExit(exit_limit);
    const double survivors = replicas_[0]->Served() + replicas_[2]->Served();
    EXPECT_GE(survivors, kCalls - kCalls / 3 - 6);
    EXPECT_LE(survivors, kCalls);
    return status;
  }

  // Returns how many calls needed more than one attempt.
  static int ExpectAllAnsweredOnceAndRight(const std::vector<Outcome>& outcomes) {
    int retried = 0;
    for (size_t id = 0; id < outcomes.size(); ++id) {
      const Outcome& o = outcomes[id];
      EXPECT_EQ(o.answers, 1) << "request " << id;
      EXPECT_TRUE(o.status.ok()) << "request " << id << ": " << o.status;
      if (!o.status.ok()) continue;
      EXPECT_LT(o.dx_error, 1e-4) << "request " << id;
      EXPECT_LT(o.dgamma_error, 1e-4) << "request " << id;
      if (o.attempts > 1) ++retried;
    }
    std::printf("%zu requests answered once each, %d after a retry\n", outcomes.size(), retried);
    return retried;
  }

  std::vector<std::unique_ptr<Replica>> replicas_;
};

TEST_F(ScaleOutTest, RoundRobinSpreadsLoadSoEachOfThreeReplicasServesAtLeastTwentyPercent) {
  StartReplicas(3);
  std::unique_ptr<Client> client = RoundRobinClient();
  ASSERT_NE(client, nullptr);
  constexpr int kCalls = 90;
  ExpectAllAnsweredOnceAndRight(RunLoad(*client, kCalls, 6, 0, nullptr));
  // A server counts a call after its final status is sent, so the last few may reach the
  // metrics a moment after the client has its answer: poll (bounded) until all are counted.
  std::vector<double> served(replicas_.size());
  double total = 0;
  for (int poll = 0; poll < 200 && total < kCalls; ++poll) {
    if (poll > 0) absl::SleepFor(absl::Milliseconds(25));
    total = 0;
    for (size_t i = 0; i < replicas_.size(); ++i) {
      served[i] = replicas_[i]->Served();
      total += served[i];
    }
  }
  for (size_t i = 0; i < replicas_.size(); ++i) {
    std::printf("replica %zu served %.0f of %d\n", i, served[i], kCalls);
    EXPECT_GE(served[i], 0.2 * kCalls) << "replica " << i;
  }
  EXPECT_EQ(total, kCalls) << "every call is served exactly once across the replicas";
}

// A call whose replica dies before its status (even after its grad_input arrived) is redone
// whole on another replica by the client.
TEST_F(ScaleOutTest, ReplicaKilledMidLoadLosesNoRequest) {
  int retried = 0;
  const std::optional<int> status = SignalReplicaMidLoad(SIGKILL, absl::Seconds(10), retried);
  EXPECT_TRUE(status && WIFSIGNALED(*status) && WTERMSIG(*status) == SIGKILL);
  // The calls in flight on the killed replica cannot have finished there: the client redid them.
  EXPECT_GE(retried, 1) << "no call was retried, so none was in flight on the killed replica";
}

// In-flight streams finish on the draining replica; calls that reach it while it drains get
// UNAVAILABLE (or, in the instant gRPC's shutdown begins, CANCELLED) before any response and
// are redone on another replica by the client.
TEST_F(ScaleOutTest, ReplicaSentSigtermMidLoadDrainsWithoutAnyClientError) {
  int retried = 0;
  const std::optional<int> status = SignalReplicaMidLoad(SIGTERM, absl::Seconds(30), retried);
  EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
      << "a drained replica exits 0, status " << status.value_or(-1);
}

}  // namespace
}  // namespace normgrad
