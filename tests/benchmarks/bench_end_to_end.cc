// End-to-end service benchmark over loopback, against a baseline measured in the same run: a
// plain gRPC bidi stream (same proto, same chunk size) whose server only echoes x back as
// grad_input. The ratio says how much of the transport's throughput the service keeps once it
// validates, computes on the backend and streams gradients back.
//
// Then the transports, against the same backend called in-process (no RPC at all) in the same
// run: the client library over TCP loopback, over the unix socket (bytes), and over shared
// memory (tensors in a registered region: no payload byte crosses a socket). TCP and the unix
// socket also against their floor, measured alternately in the same run: a plain socket round
// trip of the same bytes (x and dy written, dx read back), for the large batch (service/plain,
// target >= 0.5) and for 1 x 896 (p50 service/plain, target <= 4). The plain socket's server is
// a thread of this process, as the service is here.
//
//   bench_end_to_end [--rows=4096] [--hidden=4096] [--chunk_rows=64] [--repeats=3]
//                    [--small_calls=2000] [--backend=cpu] [--transport=all|echo|tcp|unix|shm]
//
// Prints, for the large batch, bytes moved (x + dy in, dx out) per second and the ratio
// service/echo (target >= 0.70); for 1 x 896 requests, p50 and p99 latency of a whole
// RmsNormBackward call and the ratio of p50s (target <= 2). Per transport, a line starting with
// its name and ending "<name>/in-process = R" (shm: target >= 0.8), and the 1 x 896 p50 of each
// (unix no worse than tcp).
#include <grpcpp/grpcpp.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "normgrad/client.h"
#include "normgrad/shared_memory.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "server/process/normgrad_server.h"

ABSL_FLAG(uint64_t, rows, 4096, "Rows of the large batch.");
ABSL_FLAG(uint32_t, hidden, 4096, "hidden_dim of the large batch.");
ABSL_FLAG(uint64_t, chunk_rows, 64, "Rows per request chunk.");
ABSL_FLAG(int, repeats, 3, "Large-batch runs per side; the best is reported.");
ABSL_FLAG(int, small_calls, 2000, "1 x 896 calls per side for the latency figures.");
ABSL_FLAG(std::string, backend, "cpu", "Backend of the service: cpu, cuda or auto.");
ABSL_FLAG(std::string, transport, "all",
          "What to measure: echo (the service vs a gRPC echo), tcp, unix, shm (each vs the "
          "backend in-process), or all.");

namespace {

using normgrad::v1::BackwardRequest;
using normgrad::v1::BackwardResponse;

// The baseline: gRPC's callback API like the service, one read and one write in flight with
// reads running ahead of writes (at most two responses queued), and no work but copying x back
// as grad_input; a final message of gamma's size. The best a bidi echo of these bytes does.
class EchoReactor final : public grpc::ServerBidiReactor<BackwardRequest, BackwardResponse> {
 public:
  EchoReactor() { StartRead(&request_); }

  void OnReadDone(bool ok) override {
    bool read = false;
    BackwardResponse* write = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!ok) {
        reads_done_ = true;
        auto final = std::make_unique<BackwardResponse>();
        final->set_grad_gamma(std::string(gamma_bytes_, '\0'));
        final->mutable_summary()->set_rows(first_row_);
        queue_.push_back(std::move(final));
      } else if (request_.has_header()) {
        row_bytes_ = uint64_t{request_.header().hidden_dim()} * 4;
        gamma_bytes_ = request_.header().gamma().size();
        read = true;
      } else {
        auto response = std::make_unique<BackwardResponse>();
        response->set_first_row(first_row_);
        response->set_num_rows(request_.x().size() / row_bytes_);
        first_row_ += response->num_rows();
        response->set_grad_input(request_.x());
        queue_.push_back(std::move(response));
        read = queue_.size() < 2;
        read_paused_ = !read;
      }
      if (!writing_ && !queue_.empty()) {
        writing_ = true;
        write = queue_.front().get();
      }
    }
    if (write != nullptr) StartWrite(write);
    if (read) StartRead(&request_);
  }

  void OnWriteDone(bool ok) override {
    bool read = false, finish = false;
    BackwardResponse* write = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const bool was_final = reads_done_ && queue_.size() == 1;
      queue_.pop_front();
      writing_ = false;
      if (!ok || was_final) {
        finish = true;
      } else {
        if (!queue_.empty()) {
          writing_ = true;
          write = queue_.front().get();
        }
        if (read_paused_ && queue_.size() < 2) {
          read_paused_ = false;
          read = true;
        }
      }
    }
    if (finish) {
      Finish(ok ? grpc::Status::OK : grpc::Status::CANCELLED);
      return;
    }
    if (write != nullptr) StartWrite(write);
    if (read) StartRead(&request_);
  }

  void OnDone() override { delete this; }

 private:
  std::mutex mu_;
  BackwardRequest request_;
  std::deque<std::unique_ptr<BackwardResponse>> queue_;
  bool writing_ = false, reads_done_ = false, read_paused_ = false;
  uint64_t row_bytes_ = 4, gamma_bytes_ = 0, first_row_ = 0;
};

class EchoService final : public normgrad::v1::NormGrad::CallbackService {
 public:
  grpc::ServerBidiReactor<BackwardRequest, BackwardResponse>* RmsNormBackward(
      grpc::CallbackServerContext*) override {
    return new EchoReactor();
  }
};

struct Workload {
  std::vector<BackwardRequest> messages;  // header, then chunks
  uint64_t payload_bytes = 0;             // x + dy + dx
};

Workload MakeWorkload(uint64_t rows, uint32_t hidden, uint64_t chunk_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Workload w;
  BackwardRequest header;
  header.mutable_header()->set_num_rows(rows);
  header.mutable_header()->set_hidden_dim(hidden);
  header.mutable_header()->set_eps(1e-5f);
  std::vector<float> gamma(hidden);
  for (float& g : gamma) g = u(rng);
  header.mutable_header()->set_gamma(gamma.data(), gamma.size() * 4);
  w.messages.push_back(header);
  std::vector<float> buffer;
  for (uint64_t first = 0; first < rows; first += chunk_rows) {
    const uint64_t n = std::min(chunk_rows, rows - first);
    buffer.resize(n * hidden);
    BackwardRequest chunk;
    for (float& v : buffer) v = u(rng);
    chunk.set_x(buffer.data(), buffer.size() * 4);
    for (float& v : buffer) v = u(rng);
    chunk.set_dy(buffer.data(), buffer.size() * 4);
    w.messages.push_back(std::move(chunk));
    w.payload_bytes += 3 * n * hidden * 4;
  }
  return w;
}

// One whole RmsNormBackward call; returns seconds, or -1 on error.
double RunOnce(normgrad::v1::NormGrad::Stub& stub, const Workload& w) {
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  auto stream = stub.RmsNormBackward(&context);
  std::thread writer([&] {
    for (const BackwardRequest& m : w.messages) {
      if (!stream->Write(m)) return;
    }
    stream->WritesDone();
  });
  BackwardResponse response;
  while (stream->Read(&response)) {
  }
  writer.join();
  grpc::Status s = stream->Finish();
  if (!s.ok()) {
    std::fprintf(stderr, "call failed: %s\n", s.error_message().c_str());
    return -1;
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// One small call without a writer thread (the whole request fits in flow-control windows).
double RunSmall(normgrad::v1::NormGrad::Stub& stub, const Workload& w) {
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  auto stream = stub.RmsNormBackward(&context);
  for (const BackwardRequest& m : w.messages) stream->Write(m);
  stream->WritesDone();
  BackwardResponse response;
  while (stream->Read(&response)) {
  }
  if (!stream->Finish().ok()) return -1;
  return absl::ToDoubleSeconds(absl::Now() - start);
}

std::shared_ptr<grpc::Channel> Channel(int port) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port),
                                   grpc::InsecureChannelCredentials(), args);
}

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

// The backend alone, in this process: what no transport can beat. Best of `repeats`.
double InProcessSeconds(normgrad::server::Backend& backend, absl::Span<const float> x,
                        absl::Span<const float> dy, absl::Span<const float> gamma,
                        uint64_t rows, uint32_t hidden, absl::Span<float> dx, int repeats) {
  normgrad::kernels::BackwardRequest spec;
  spec.num_rows = rows;
  spec.hidden_dim = hidden;
  auto bytes = [](absl::Span<const float> v) {
    return absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4);
  };
  std::vector<float> dgamma(hidden);
  double best = 1e30;
  for (int i = 0; i < repeats + 1; ++i) {  // the first warms
    const absl::Time start = absl::Now();
    auto session = backend.StartBackward(spec, bytes(gamma));
    if (!session.ok()) return -1;
    if (!(*session)->ProcessChunk(bytes(x), bytes(dy), {}, rows,
                                  absl::MakeSpan(reinterpret_cast<uint8_t*>(dx.data()), dx.size() * 4))
             .ok() ||
        !(*session)->Finish(absl::MakeSpan(reinterpret_cast<uint8_t*>(dgamma.data()), hidden * 4))
             .ok()) {
      return -1;
    }
    if (i > 0) best = std::min(best, absl::ToDoubleSeconds(absl::Now() - start));
  }
  return best;
}

// The floor any protocol over a socket pays: the same bytes as a call (x and dy written, dx read
// back) over a plain socket, no framing beyond one 16-byte header per round (bytes in, bytes
// out), served by a thread that reads a round whole and writes the answer's bytes from a buffer
// of its own (no copy, no computation: the socket's cost alone). TCP
// loopback with TCP_NODELAY, or a unix socket; one connection, kept.
class PlainSocketFloor {
 public:
  // AF_INET on 127.0.0.1:0 when unix_path is empty, else AF_UNIX at unix_path.
  static std::unique_ptr<PlainSocketFloor> Start(const std::string& unix_path) {
    auto floor = std::unique_ptr<PlainSocketFloor>(new PlainSocketFloor());
    const bool tcp = unix_path.empty();
    floor->listen_fd_ = socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (floor->listen_fd_ < 0) return nullptr;
    sockaddr_storage addr{};
    socklen_t len = 0;
    if (tcp) {
      auto* in = reinterpret_cast<sockaddr_in*>(&addr);
      in->sin_family = AF_INET;
      in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      len = sizeof(sockaddr_in);
    } else {
      auto* un = reinterpret_cast<sockaddr_un*>(&addr);
      un->sun_family = AF_UNIX;
      if (unix_path.size() >= sizeof(un->sun_path)) return nullptr;
      std::memcpy(un->sun_path, unix_path.c_str(), unix_path.size() + 1);
      unlink(unix_path.c_str());
      len = sizeof(sockaddr_un);
    }
    if (bind(floor->listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(floor->listen_fd_, 1) != 0 ||
        getsockname(floor->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return nullptr;
    }
    floor->unix_path_ = unix_path;
    floor->server_ = std::thread([f = floor.get()] { f->Serve(); });
    floor->client_fd_ = socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (floor->client_fd_ < 0 ||
        connect(floor->client_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      return nullptr;
    }
    if (tcp) NoDelay(floor->client_fd_);
    return floor;
  }

  ~PlainSocketFloor() {
    if (client_fd_ >= 0) close(client_fd_);  // the server thread sees EOF and ends
    if (listen_fd_ >= 0) shutdown(listen_fd_, SHUT_RDWR);
    if (server_.joinable()) server_.join();
    if (listen_fd_ >= 0) close(listen_fd_);
    if (!unix_path_.empty()) unlink(unix_path_.c_str());
  }

  // One round trip: x and dy out, dx back into `dx`. Seconds, or -1 on a socket error.
  double RoundTrip(absl::Span<const float> x, absl::Span<const float> dy, absl::Span<float> dx) {
    const uint64_t header[2] = {(x.size() + dy.size()) * 4, dx.size() * 4};
    const absl::Time start = absl::Now();
    // The writes and the read overlap as a client's do: the server answers only after the whole
    // round, so writing everything first cannot deadlock.
    if (!WriteAll(client_fd_, header, sizeof(header)) ||
        !WriteAll(client_fd_, x.data(), x.size() * 4) ||
        !WriteAll(client_fd_, dy.data(), dy.size() * 4) ||
        !ReadAll(client_fd_, dx.data(), dx.size() * 4)) {
      return -1;
    }
    return absl::ToDoubleSeconds(absl::Now() - start);
  }

 private:
  PlainSocketFloor() = default;

  static void NoDelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  static bool WriteAll(int fd, const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }
  static bool ReadAll(int fd, void* data, size_t n) {
    char* p = static_cast<char*>(data);
    while (n > 0) {
      const ssize_t r = recv(fd, p, n, 0);
      if (r <= 0) return false;
      p += r;
      n -= static_cast<size_t>(r);
    }
    return true;
  }

  void Serve() {
    const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return;
    if (unix_path_.empty()) NoDelay(fd);
    std::vector<char> in, out;
    uint64_t header[2];
    while (ReadAll(fd, header, sizeof(header))) {
      in.resize(header[0]);
      out.resize(header[1]);
      if (!ReadAll(fd, in.data(), in.size())) break;
      if (!WriteAll(fd, out.data(), out.size())) break;
    }
    close(fd);
  }

  int listen_fd_ = -1;
  int client_fd_ = -1;
  std::string unix_path_;
  std::thread server_;
};

struct TransportRun {
  std::string name;
  std::unique_ptr<normgrad::Client> client;
  std::unique_ptr<normgrad::SharedMemoryRegion> region;  // shm: x, dy, dx live here
  std::unique_ptr<PlainSocketFloor> floor;               // tcp, unix: the plain socket's floor
};

// Each transport against the backend in-process, alternating runs so drift hits all alike.
int CompareTransports(normgrad::server::NormGradServer& server, const std::string& socket_path,
                      const std::string& which, uint64_t rows, uint32_t hidden) {
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const uint64_t n = rows * hidden;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n), dy(n), gamma(hidden), dx(n);
  for (float& v : x) v = u(rng);
  for (float& v : dy) v = u(rng);
  for (float& v : gamma) v = 1.0f + 0.1f * u(rng);

  std::vector<TransportRun> runs;
  for (const char* name : {"tcp", "unix", "shm"}) {
    if (which != "all" && which != name) continue;
    normgrad::ClientOptions o;
    o.target = std::string(name) == "tcp" ? absl::StrCat("127.0.0.1:", server.port())
                                          : "unix:" + socket_path;
    o.transport = std::string(name) == "shm" ? normgrad::Transport::kSharedMemory
                                             : normgrad::Transport::kBytes;
    o.default_deadline = absl::Seconds(600);
    TransportRun run;
    run.name = name;
    run.client = *normgrad::Client::Create(o);
    if (run.name == "shm") {
      absl::StatusOr<std::unique_ptr<normgrad::SharedMemoryRegion>> region =
          normgrad::SharedMemoryRegion::Create(3 * n * 4);
      if (!region.ok()) {
        std::fprintf(stderr, "shm region: %s\n", region.status().ToString().c_str());
        return 1;
      }
      std::memcpy((*region)->As<float>(0), x.data(), n * 4);
      std::memcpy((*region)->As<float>(n * 4), dy.data(), n * 4);
      if (absl::Status s = run.client->RegisterSharedMemory(**region); !s.ok()) {
        std::fprintf(stderr, "shm register: %s\n", s.ToString().c_str());
        return 1;
      }
      run.region = *std::move(region);
    } else {
      run.floor = PlainSocketFloor::Start(run.name == "tcp" ? "" : socket_path + ".floor");
      if (run.floor == nullptr) {
        std::fprintf(stderr, "plain %s socket: %s\n", name, std::strerror(errno));
        return 1;
      }
    }
    runs.push_back(std::move(run));
  }
  std::vector<float> dgamma(hidden);
  auto call = [&](TransportRun& r, uint64_t call_rows, uint32_t call_hidden) -> double {
    const uint64_t m = call_rows * call_hidden;
    normgrad::BackwardOptions options;
    options.dgamma = absl::MakeSpan(dgamma.data(), call_hidden);
    absl::Span<const float> xs(x.data(), m), dys(dy.data(), m);
    options.dx = absl::MakeSpan(dx.data(), m);
    if (r.region != nullptr) {
      xs = absl::MakeConstSpan(r.region->As<float>(0), m);
      dys = absl::MakeConstSpan(r.region->As<float>(n * 4), m);
      options.dx = absl::MakeSpan(r.region->As<float>(2 * n * 4), m);
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<normgrad::Gradients> g =
        r.client->Backward(xs, dys, absl::MakeConstSpan(gamma.data(), call_hidden), 1e-5f, options);
    if (!g.ok()) {
      std::fprintf(stderr, "%s call failed: %s\n", r.name.c_str(), g.status().ToString().c_str());
      return -1;
    }
    return absl::ToDoubleSeconds(absl::Now() - start);
  };

  auto plain = [&](TransportRun& r, uint64_t m) -> double {
    return r.floor->RoundTrip(absl::MakeConstSpan(x.data(), m), absl::MakeConstSpan(dy.data(), m),
                              absl::MakeSpan(dx.data(), m));
  };
  std::vector<double> best(runs.size(), 1e30), best_plain(runs.size(), 1e30);
  for (TransportRun& r : runs) {
    if (call(r, rows, hidden) < 0) return 1;  // warm
    if (r.floor != nullptr && plain(r, n) < 0) return 1;
  }
  // The region's memory (shared memory pages) read in-process too: how much of the shm figure is
  // the memory rather than the transport.
  const TransportRun* shm_run = nullptr;
  for (const TransportRun& r : runs) {
    if (r.region != nullptr) shm_run = &r;
  }
  double in_process = 1e30, in_process_region = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const double t = InProcessSeconds(server.backend(), x, dy, gamma, rows, hidden,
                                      absl::MakeSpan(dx), 1);
    if (t < 0) return 1;
    in_process = std::min(in_process, t);
    if (shm_run != nullptr) {
      const normgrad::SharedMemoryRegion& region = *shm_run->region;
      const double tr = InProcessSeconds(
          server.backend(), absl::MakeConstSpan(region.As<float>(0), n),
          absl::MakeConstSpan(region.As<float>(n * 4), n), gamma, rows, hidden,
          absl::MakeSpan(region.As<float>(2 * n * 4), n), 1);
      if (tr < 0) return 1;
      in_process_region = std::min(in_process_region, tr);
    }
    for (size_t j = 0; j < runs.size(); ++j) {
      const double s = call(runs[j], rows, hidden);
      if (s < 0) return 1;
      best[j] = std::min(best[j], s);
      if (runs[j].floor != nullptr) {
        const double f = plain(runs[j], n);
        if (f < 0) return 1;
        best_plain[j] = std::min(best_plain[j], f);
      }
    }
  }
  const double gb = 3.0 * static_cast<double>(n) * 4 / 1e9;  // x and dy in, dx out
  std::printf("in-process %llux%u f32: %.3f GB/s (%.4f s), the backend called directly\n",
              static_cast<unsigned long long>(rows), hidden, gb / in_process, in_process);
  if (shm_run != nullptr) {
    std::printf("in-process on shared-memory pages: %.3f GB/s (%.4f s), %.2f of in-process\n",
                gb / in_process_region, in_process_region, in_process / in_process_region);
  }
  for (size_t j = 0; j < runs.size(); ++j) {
    std::printf("%-4s %llux%u f32: %.3f GB/s (%.4f s), %s/in-process = %.2f\n",
                runs[j].name.c_str(), static_cast<unsigned long long>(rows), hidden,
                gb / best[j], best[j], runs[j].name.c_str(), in_process / best[j]);
    if (runs[j].floor != nullptr) {
      std::printf("plain %-4s socket, the same bytes: %.3f GB/s (%.4f s), %s/plain = %.2f "
                  "(target >= 0.5)\n",
                  runs[j].name.c_str(), gb / best_plain[j], best_plain[j], runs[j].name.c_str(),
                  best_plain[j] / best[j]);
    }
  }

  const int calls = absl::GetFlag(FLAGS_small_calls);
  std::vector<std::vector<double>> small(runs.size()), small_plain(runs.size());
  for (int i = 0; i < std::min(calls, 100); ++i) {
    for (TransportRun& r : runs) {
      call(r, 1, 896);
      if (r.floor != nullptr) plain(r, 896);
    }
  }
  for (int i = 0; i < calls; ++i) {
    for (size_t j = 0; j < runs.size(); ++j) {
      small[j].push_back(call(runs[j], 1, 896));
      if (runs[j].floor != nullptr) small_plain[j].push_back(plain(runs[j], 896));
    }
  }
  std::string line = absl::StrCat("small 1x896, ", calls, " calls each, p50:");
  double tcp_p50 = 0, unix_p50 = 0;
  for (size_t j = 0; j < runs.size(); ++j) {
    const double p50 = Percentile(small[j], 0.5);
    absl::StrAppend(&line, " ", runs[j].name, " ", absl::StrFormat("%.1f", p50 * 1e6), " us");
    if (runs[j].name == "tcp") tcp_p50 = p50;
    if (runs[j].name == "unix") unix_p50 = p50;
  }
  if (tcp_p50 > 0 && unix_p50 > 0) {
    absl::StrAppend(&line, absl::StrFormat(", unix/tcp = %.2f (target <= 1)", unix_p50 / tcp_p50));
  }
  std::printf("%s\n", line.c_str());
  for (size_t j = 0; j < runs.size(); ++j) {
    if (small_plain[j].empty()) continue;
    const double p50 = Percentile(small[j], 0.5), plain_p50 = Percentile(small_plain[j], 0.5);
    std::printf("small 1x896 %-4s: service p50 %.1f us, plain socket p50 %.1f us, "
                "service/plain = %.1f (target <= 4)\n",
                runs[j].name.c_str(), p50 * 1e6, plain_p50 * 1e6, p50 / plain_p50);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  normgrad::server::ServerOptions options;
  const std::string socket_path = absl::StrCat("/tmp/normgrad-bench-", getpid(), ".sock");
  options.listen = {"127.0.0.1:0", "unix:" + socket_path};
  options.shared_memory = true;
  options.metrics_listen = "";
  absl::StatusOr<normgrad::server::BackendKind> kind =
      normgrad::server::ParseBackendKind(absl::GetFlag(FLAGS_backend));
  if (!kind.ok()) {
    std::fprintf(stderr, "bench_end_to_end: %s\n", kind.status().ToString().c_str());
    return 2;
  }
  options.backend.kind = *kind;
  auto service = normgrad::server::NormGradServer::Start(options);
  if (!service.ok()) {
    std::fprintf(stderr, "bench_end_to_end: %s\n", service.status().ToString().c_str());
    return 1;
  }
  EchoService echo_service;
  grpc::ServerBuilder builder;
  int echo_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(options.max_message_bytes));
  builder.RegisterService(&echo_service);
  std::unique_ptr<grpc::Server> echo = builder.BuildAndStart();
  if (echo == nullptr) {
    std::fprintf(stderr, "bench_end_to_end: cannot start the echo server\n");
    return 1;
  }
  auto service_stub = normgrad::v1::NormGrad::NewStub(Channel((*service)->port()));
  auto echo_stub = normgrad::v1::NormGrad::NewStub(Channel(echo_port));

  const uint64_t rows = absl::GetFlag(FLAGS_rows);
  const uint32_t hidden = absl::GetFlag(FLAGS_hidden);
  const uint64_t chunk_rows = absl::GetFlag(FLAGS_chunk_rows);
  std::printf("machine: %u hardware threads; service backend %s (%s)\n",
              std::thread::hardware_concurrency(),
              std::string((*service)->backend().Name()).c_str(),
              (*service)->backend().Device().name.c_str());
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (transport != "echo") {
    const int rc = CompareTransports(**service, socket_path, transport, rows, hidden);
    if (rc != 0 || transport != "all") {
      echo->Shutdown();
      (*service)->Shutdown(absl::Seconds(5));
      return rc;
    }
  }
  const Workload large = MakeWorkload(rows, hidden, chunk_rows, 1);

  // Warm both paths, then alternate runs so that drift affects both sides alike.
  RunOnce(*service_stub, large);
  RunOnce(*echo_stub, large);
  double best_service = 1e30, best_echo = 1e30;
  for (int i = 0; i < absl::GetFlag(FLAGS_repeats); ++i) {
    const double s = RunOnce(*service_stub, large);
    const double e = RunOnce(*echo_stub, large);
    if (s < 0 || e < 0) return 1;
    best_service = std::min(best_service, s);
    best_echo = std::min(best_echo, e);
  }
  const double gb = static_cast<double>(large.payload_bytes) / 1e9;
  std::printf(
      "large %llux%u f32, %llu rows/chunk (%.2f MiB x+dy per message): service %.3f GB/s "
      "(%.3f s), echo %.3f GB/s (%.3f s), service/echo = %.2f (target >= 0.70)\n",
      static_cast<unsigned long long>(rows), hidden,
      static_cast<unsigned long long>(chunk_rows),
      static_cast<double>(chunk_rows) * hidden * 8 / (1 << 20), gb / best_service, best_service,
      gb / best_echo, best_echo, best_echo / best_service);

  const Workload small = MakeWorkload(1, 896, 1, 2);
  const int calls = absl::GetFlag(FLAGS_small_calls);
  for (int i = 0; i < 100; ++i) {
    RunSmall(*service_stub, small);
    RunSmall(*echo_stub, small);
  }
  std::vector<double> service_lat, echo_lat;
  for (int i = 0; i < calls; ++i) {
    service_lat.push_back(RunSmall(*service_stub, small));
    echo_lat.push_back(RunSmall(*echo_stub, small));
  }
  const double sp50 = Percentile(service_lat, 0.5), sp99 = Percentile(service_lat, 0.99);
  const double ep50 = Percentile(echo_lat, 0.5), ep99 = Percentile(echo_lat, 0.99);
  std::printf(
      "small 1x896, %d calls each: service p50 %.1f us p99 %.1f us, echo p50 %.1f us p99 %.1f "
      "us, p50 service/echo = %.2f (target <= 2), p99 service/echo = %.2f\n",
      calls, sp50 * 1e6, sp99 * 1e6, ep50 * 1e6, ep99 * 1e6, sp50 / ep50, sp99 / ep99);

  echo->Shutdown();
  (*service)->Shutdown(absl::Seconds(5));
  return 0;
}
