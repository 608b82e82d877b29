// A randomized schedule of calls against a real server on a unix socket: bytes, shared memory
// through the client's staging regions, and shared memory in a region of the caller's own
// (registered, written at a new random layout for every call, so that an earlier call's
// grad_input range overlaps a later call's x and dy), from four threads at once, with cancels
// at random times and at random progress, deadlines of a few milliseconds, slow readers, region
// releases in the middle of calls and server drains while calls are in flight. The server's
// CPU backend sleeps a random moment before, inside and after every chunk, so that every ending
// lands at every point of a chunk.
//
// Every OK result is checked against the double-precision reference: the count of wrong
// results must be zero. The closing line gives the counts of calls, of each ending and outcome.
//
//   NORMGRAD_SCHEDULE_CALLS (default 3000), NORMGRAD_SCHEDULE_SEED (default 1).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/rmsnorm/reference.h"
#include "normgrad/client.h"
#include "normgrad/shared_memory.h"
#include "server/backend_factory/backend_factory.h"
#include "server/process/normgrad_server.h"
#include "tests/client/test_server.h"
#include "tests/common/gated_backend.h"

namespace normgrad {
namespace {

using ::normgrad::testing::ChunkGates;

uint64_t EnvOr(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::strtoull(v, nullptr, 10) : fallback;
}

enum Via { kBytes, kStaging, kRegion, kVias };
enum Ending { kNone, kCancelAtTime, kCancelAtProgress, kDeadline, kSlowReader, kRegionRelease,
              kEndings };
const char* const kViaNames[] = {"bytes", "staging", "region"};
const char* const kEndingNames[] = {"none", "cancel-at-time", "cancel-at-progress", "deadline",
                                    "slow-reader", "region-release"};

constexpr uint64_t kRegionBytes = 4 << 20;

// One server generation: a server, a client per transport, and a region per worker registered
// with the shared-memory client. A drain replaces the whole generation.
struct Generation {
  int number = 0;
  std::unique_ptr<server::NormGradServer> server;
  std::unique_ptr<Client> bytes_client, shm_client;
};

class Schedule {
 public:
  Schedule(std::string dir, std::shared_ptr<ChunkGates> gates)
      : dir_(std::move(dir)), gates_(std::move(gates)) {}

  std::shared_ptr<Generation> Start(int number) {
    auto g = std::make_shared<Generation>();
    g->number = number;
    const std::string socket = absl::StrCat(dir_, "/gen", number, ".sock");
    g->server = testing::StartGatedServer(socket, gates_);
    if (g->server == nullptr) return nullptr;
    ClientOptions c;
    c.target = "unix:" + socket;
    c.max_attempts = 1;
    c.chunk_bytes = 4096;      // 1 to 16 chunks a call
    c.shm_chunk_bytes = 4096;
    c.transport = Transport::kBytes;
    g->bytes_client = *Client::Create(c);
    c.transport = Transport::kSharedMemory;
    g->shm_client = *Client::Create(c);
    return g;
  }

  std::string dir_;
  std::shared_ptr<ChunkGates> gates_;
};

struct Counts {
  std::mutex mu;
  std::map<std::string, uint64_t> by;  // "via/ending/outcome"
  std::atomic<uint64_t> calls{0}, ok{0}, wrong{0}, drains{0}, in_doubt{0};
  std::atomic<uint64_t> ended[kEndings] = {};
  void Add(Via via, Ending ending, const absl::Status& s) {
    std::lock_guard<std::mutex> lock(mu);
    ++by[absl::StrCat(kViaNames[via], " ", kEndingNames[ending], " ",
                      absl::StatusCodeToString(s.code()))];
  }
};

// Largest error of `got` against `want`, relative to max(1, |want|).
double MaxError(const float* got, const std::vector<float>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double e = std::abs(double{got[i]} - want[i]) / std::max(1.0, std::abs(double{want[i]}));
    if (!(e <= worst)) worst = std::isnan(e) ? 1e30 : e;
  }
  return worst;
}

TEST(ScheduleTest, RandomEndingsAtRandomPointsNeverGiveAWrongOk) {
  const uint64_t total = EnvOr("NORMGRAD_SCHEDULE_CALLS", 3000);
  const uint64_t seed = EnvOr("NORMGRAD_SCHEDULE_SEED", 1);
  std::string dir = "/tmp/normgrad-schedule-XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  auto gates = std::make_shared<ChunkGates>();
  gates->SetJitter(400);
  Schedule schedule(dir, gates);

  std::mutex gen_mu;
  int gen_number = 0;
  std::shared_ptr<Generation> current = schedule.Start(gen_number++);
  ASSERT_NE(current, nullptr);
  auto generation = [&] {
    std::lock_guard<std::mutex> lock(gen_mu);
    return current;
  };

  Counts counts;
  std::atomic<uint64_t> next_call{0};
  std::atomic<bool> stop{false};
  constexpr int kWorkers = 4;

  auto worker = [&](int w) {
    std::mt19937_64 rng(seed * 1000003 + w);
    auto uniform = [&](uint64_t lo, uint64_t hi) {
      return std::uniform_int_distribution<uint64_t>(lo, hi)(rng);
    };
    std::unique_ptr<SharedMemoryRegion> region = *SharedMemoryRegion::Create(kRegionBytes);
    int registered_with = -1;  // the generation the region is registered with
    while (!stop.load()) {
      const uint64_t call = next_call.fetch_add(1);
      if (call >= total) break;
      std::shared_ptr<Generation> g = generation();
      const Via via = static_cast<Via>(uniform(0, kVias - 1));
      Ending ending = uniform(0, 1) == 0 ? kNone : static_cast<Ending>(uniform(1, kEndings - 1));
      if (ending == kRegionRelease && via != kRegion) ending = kNone;
      const uint32_t hiddens[] = {8, 64, 256};
      const uint32_t hidden = hiddens[uniform(0, 2)];
      const uint64_t rows = uniform(1, 16384 / hidden);
      const uint64_t n = rows * hidden;
      std::vector<float> x(n), dy(n), gamma(hidden), want_dx(n), want_dgamma(hidden);
      std::uniform_real_distribution<float> u(-2.0f, 2.0f);
      for (float& v : x) v = u(rng);
      for (float& v : dy) v = u(rng);
      for (float& v : gamma) v = 1.0f + 0.25f * u(rng);
      kernels::ReferenceBackward({x, dy, gamma, {}, rows, hidden, 1e-5f},
                                 absl::MakeSpan(want_dx), absl::MakeSpan(want_dgamma));

      // Where the tensors are: the caller's vectors, or a new random layout in the region.
      std::vector<float> dx(via == kRegion ? 0 : n), dgamma(hidden);
      const float *xp = x.data(), *dyp = dy.data();
      float* dxp = dx.data();
      if (via == kRegion) {
        if (registered_with != g->number) {
          if (!g->shm_client->RegisterSharedMemory(*region).ok()) continue;  // a drain began
          registered_with = g->number;
        }
        const uint64_t slots = kRegionBytes / (n * 4);  // >= 3 (n * 4 <= 64 KiB)
        uint64_t at[3];
        do {
          for (uint64_t& a : at) a = uniform(0, slots - 1);
        } while (at[0] == at[1] || at[1] == at[2] || at[0] == at[2]);
        float* base = region->As<float>(0);
        std::memcpy(base + at[0] * n, x.data(), n * 4);
        std::memcpy(base + at[1] * n, dy.data(), n * 4);
        xp = base + at[0] * n;
        dyp = base + at[1] * n;
        dxp = base + at[2] * n;
      }
      RawBackwardArgs a;
      a.num_rows = rows;
      a.hidden_dim = hidden;
      a.eps = 1e-5f;
      a.x = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(xp), n * 4);
      a.dy = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(dyp), n * 4);
      a.gamma = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(gamma.data()), hidden * 4);
      a.dx = absl::MakeSpan(reinterpret_cast<uint8_t*>(dxp), n * 4);
      a.dgamma = absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma.data()), hidden * 4);

      BackwardOptions options;
      options.cancellation = std::make_shared<CallCancellation>();
      const uint64_t progress_cut = uniform(1, rows);
      const int slow_ms = static_cast<int>(uniform(1, 3));
      if (ending == kDeadline) options.deadline = absl::Microseconds(uniform(200, 5000));
      if (ending == kCancelAtProgress) {
        options.on_progress = [c = options.cancellation, progress_cut](uint64_t done, uint64_t) {
          if (done >= progress_cut) c->Cancel();
        };
      }
      if (ending == kSlowReader) {
        options.on_progress = [slow_ms](uint64_t, uint64_t) {
          absl::SleepFor(absl::Milliseconds(slow_ms));
        };
      }
      Client& client = via == kBytes ? *g->bytes_client : *g->shm_client;
      std::promise<absl::Status> promise;
      std::future<absl::Status> future = promise.get_future();
      client.BackwardRawAsync(a, options, [&promise](absl::StatusOr<RawBackwardResult> r) {
        promise.set_value(r.status());
      });
      if (ending == kCancelAtTime) {
        absl::SleepFor(absl::Microseconds(uniform(0, 3000)));
        options.cancellation->Cancel();
      }
      if (ending == kRegionRelease) {
        absl::SleepFor(absl::Microseconds(uniform(0, 3000)));
        (void)g->shm_client->UnregisterSharedMemory(*region);
        registered_with = -1;
      }
      const absl::Status s = future.get();
      counts.calls.fetch_add(1);
      counts.ended[ending].fetch_add(1);
      counts.Add(via, ending, s);
      if (absl::StrContains(s.message(), "did not confirm that it stopped")) {
        // The library says the server may still write this region: as its caller must, the
        // worker does not reuse it (a new one; the server's mapping keeps the old pages).
        counts.in_doubt.fetch_add(1);
        region = *SharedMemoryRegion::Create(kRegionBytes);
        registered_with = -1;
      }
      if (s.ok()) {
        counts.ok.fetch_add(1);
        const double e = std::max(MaxError(dxp, want_dx), MaxError(dgamma.data(), want_dgamma));
        if (e > 1e-3) {
          counts.wrong.fetch_add(1);
          ADD_FAILURE() << "call " << call << " (" << kViaNames[via] << ", "
                        << kEndingNames[ending] << ", " << rows << "x" << hidden
                        << ") returned OK with an error of " << e << " against the reference";
        }
      }
    }
  };

  std::vector<std::thread> workers;
  for (int w = 0; w < kWorkers; ++w) workers.emplace_back(worker, w);
  // Drains: every so often the server drains with calls in flight and a new one takes over.
  std::thread drainer([&] {
    std::mt19937_64 rng(seed);
    uint64_t last = 0;
    while (next_call.load() < total) {
      absl::SleepFor(absl::Milliseconds(5));
      const uint64_t at = next_call.load();
      if (at - last < 150 + rng() % 150) continue;
      last = at;
      std::shared_ptr<Generation> fresh = schedule.Start(gen_number);
      if (fresh == nullptr) break;
      std::shared_ptr<Generation> old;
      {
        std::lock_guard<std::mutex> lock(gen_mu);
        ++gen_number;
        old = current;
        current = fresh;
      }
      old->server->Shutdown(absl::Milliseconds(rng() % 20));
      counts.drains.fetch_add(1);
    }
  });
  for (std::thread& t : workers) t.join();
  stop.store(true);
  drainer.join();
  current.reset();
  std::filesystem::remove_all(dir);

  std::printf("schedule: %llu calls (seed %llu), %llu OK, %llu wrong, %llu drains, %llu "
              "regions in doubt\n",
              static_cast<unsigned long long>(counts.calls.load()),
              static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(counts.ok.load()),
              static_cast<unsigned long long>(counts.wrong.load()),
              static_cast<unsigned long long>(counts.drains.load()),
              static_cast<unsigned long long>(counts.in_doubt.load()));
  for (const auto& [key, n] : counts.by) {
    std::printf("schedule:   %-48s %llu\n", key.c_str(), static_cast<unsigned long long>(n));
  }
  EXPECT_EQ(counts.wrong.load(), 0u);
  // The schedule did what it says: every ending happened, most calls were answered, drains ran.
  for (int e = 0; e < kEndings; ++e) {
    EXPECT_GT(counts.ended[e].load(), 0u) << kEndingNames[e] << " never happened";
  }
  EXPECT_GE(counts.calls.load(), total * 9 / 10);
  EXPECT_GT(counts.ok.load(), counts.calls.load() / 4);
  EXPECT_GT(counts.drains.load(), 0u);
}

}  // namespace
}  // namespace normgrad
