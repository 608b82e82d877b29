// The remote path against its floor, client and server in separate processes as deployed.
//
// In one run, alternating round by round, for 4096 x 4096 (f32 and bf16: x + dy in, dx out) and
// for 1 x 896 f32 calls (p50 of --small_calls each):
//   plain     the same bytes over a plain socket (a 16-byte header per round trip, no framing,
//             nothing computed): the floor any protocol over that socket pays
//   echo      bare gRPC over the same socket: a unary echo (the request whole, an answer of dx's
//             size) and a bidi echo (1 MiB of x and of dy per message, an answer per message),
//             request bytes sent from the caller's memory as normgrad's client sends them
//   service   normgrad-server (CPU backend) through the C++ client, and through the Python
//             client (a python3 child), both with transport "bytes"
// over TCP loopback and over a unix socket. Every figure is printed with its ratio to the plain
// socket of its transport (and the small calls' p50 also to the bare unary echo's).
//
// --link=10gbit runs the whole benchmark in a network namespace of its own (unshare -n) whose
// loopback is limited by `tc qdisc add dev lo root tbf rate 10gbit burst 1mb latency 10ms`
// (root, iproute2); the unix socket is not limited.
//
//   bench_remote [--repeats=3] [--small_calls=2000] [--dtypes=f32,bf16] [--link=10gbit]
//                [--server=<dir of this program>/normgrad-server] [--python=DIR|off]
//
// The same program is its own plain-socket and echo servers (--serve=plain|echo, internal).
#include <arpa/inet.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/server_callback.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "normgrad/client.h"
#include "tests/common/child_process.h"

ABSL_FLAG(uint64_t, rows, 4096, "Rows of the large batch.");
ABSL_FLAG(uint32_t, hidden, 4096, "hidden_dim of the large batch.");
ABSL_FLAG(int, repeats, 3, "Rounds of the large batch per path; the best is reported.");
ABSL_FLAG(int, small_calls, 2000, "1 x 896 calls per path for the latency figures.");
ABSL_FLAG(std::string, dtypes, "f32,bf16", "Element types of the large batch.");
ABSL_FLAG(std::string, link, "", "A rate (e.g. 10gbit) that limits loopback in a network "
          "namespace of the benchmark's own; empty: the machine's loopback.");
ABSL_FLAG(std::string, server, "", "normgrad-server to start; empty: the one beside this program.");
ABSL_FLAG(std::string, python, "", "Directory of the normgrad Python package; empty: "
          "<this program's dir>/../python; off: no Python client.");
ABSL_FLAG(std::string, serve, "", "Internal: run as the plain or echo server.");
ABSL_FLAG(std::string, unix_path, "", "Internal: the unix socket of --serve.");
ABSL_FLAG(bool, in_namespace, false, "Internal: already in the benchmark's network namespace.");

namespace {

using normgrad::testing::ChildProcess;

constexpr uint64_t kMessageBytes = 1 << 20;  // the bidi echo's x (and dy) per message

std::string BesideThisProgram(const std::string& name) {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return name;
  self[n] = '\0';
  return (std::filesystem::path(self).parent_path() / name).string();
}

// ---------------------------------------------------------------------------------------------
// Sockets

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, 0);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

void NoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The address of 127.0.0.1:`port` (`unix_path` empty) or of the unix socket `unix_path`.
socklen_t AddressOf(const std::string& unix_path, int port, sockaddr_storage* addr) {
  *addr = sockaddr_storage{};
  if (unix_path.empty()) {
    auto* in = reinterpret_cast<sockaddr_in*>(addr);
    in->sin_family = AF_INET;
    in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    in->sin_port = htons(static_cast<uint16_t>(port));
    return sizeof(sockaddr_in);
  }
  auto* un = reinterpret_cast<sockaddr_un*>(addr);
  un->sun_family = AF_UNIX;
  std::snprintf(un->sun_path, sizeof(un->sun_path), "%s", unix_path.c_str());
  return sizeof(sockaddr_un);
}

// A listening socket: TCP on 127.0.0.1 (port 0) when `unix_path` is empty, else a unix socket.
int Listen(const std::string& unix_path, int* port) {
  const bool tcp = unix_path.empty();
  const int fd = socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage addr;
  socklen_t len = AddressOf(unix_path, 0, &addr);
  if (!tcp) unlink(unix_path.c_str());
  if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || listen(fd, 16) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    std::perror("listen");
    std::exit(1);
  }
  if (tcp) *port = ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

int Connect(const std::string& target) {  // "127.0.0.1:PORT" or "unix:PATH"
  const bool tcp = target.rfind("unix:", 0) != 0;
  const int fd = socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_storage addr;
  const socklen_t len =
      tcp ? AddressOf("", std::stoi(target.substr(target.rfind(':') + 1)), &addr)
          : AddressOf(target.substr(5), 0, &addr);
  if (fd < 0 || connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
    std::perror(("connect " + target).c_str());
    return -1;
  }
  if (tcp) NoDelay(fd);
  return fd;
}

// A server child lives until the benchmark kills it, or dies with it.
[[noreturn]] void WaitForTheBenchmarkToEnd() {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) std::_Exit(0);
  while (true) pause();
}

// The plain server: per round a 16-byte header (bytes in, bytes out), the bytes in read whole,
// the bytes out written from a buffer of its own. A thread per connection.
void ServePlain(const std::string& unix_path) {
  int tcp_port = 0, unused = 0;
  const int tcp = Listen("", &tcp_port);
  const int un = Listen(unix_path, &unused);
  std::printf("ready tcp=%d\n", tcp_port);
  std::fflush(stdout);
  auto serve = [](int fd) {
    std::vector<char> in, out;
    uint64_t header[2];
    while (ReadAll(fd, header, sizeof(header))) {
      in.resize(header[0]);
      out.resize(header[1]);
      if (!ReadAll(fd, in.data(), in.size()) || !WriteAll(fd, out.data(), out.size())) break;
    }
    close(fd);
  };
  for (int listener : {tcp, un}) {
    std::thread([listener, serve] {
      while (true) {
        const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
        if (fd < 0) return;
        NoDelay(fd);  // fails harmlessly on the unix socket
        std::thread(serve, fd).detach();
      }
    }).detach();
  }
  WaitForTheBenchmarkToEnd();
}

// ---------------------------------------------------------------------------------------------
// The bare gRPC echo: any method; each request message is answered by one message of half its
// size (x + dy in, dx out) from a buffer of the server's, until the client half-closes.

class EchoReactor final : public grpc::ServerGenericBidiReactor {
 public:
  explicit EchoReactor(const std::vector<uint8_t>* zeros) : zeros_(zeros) { StartRead(&in_); }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    const size_t n = std::min(in_.Length() / 2, zeros_->size());
    grpc::Slice s(const_cast<uint8_t*>(zeros_->data()), n, grpc::Slice::STATIC_SLICE);
    out_ = grpc::ByteBuffer(&s, 1);
    in_.Clear();
    StartWrite(&out_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status::OK);
      return;
    }
    StartRead(&in_);
  }
  void OnDone() override { delete this; }

 private:
  const std::vector<uint8_t>* zeros_;
  grpc::ByteBuffer in_, out_;
};

class EchoService final : public grpc::CallbackGenericService {
 public:
  explicit EchoService(size_t max_bytes) : zeros_(max_bytes) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    return new EchoReactor(&zeros_);
  }

 private:
  std::vector<uint8_t> zeros_;
};

void ServeEcho(const std::string& unix_path, size_t max_bytes) {
  EchoService service(max_bytes);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.AddListeningPort("unix:" + unix_path, grpc::InsecureServerCredentials());
  builder.SetMaxReceiveMessageSize(-1);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) std::exit(1);
  std::printf("ready tcp=%d\n", port);
  std::fflush(stdout);
  WaitForTheBenchmarkToEnd();
}

// ---------------------------------------------------------------------------------------------
// The client side of each path: one round trip of x and dy, dx back; seconds, or -1.

struct Tensors {
  uint64_t rows = 0;
  uint32_t hidden = 0;
  normgrad::ElementType type = normgrad::ElementType::kF32;
  std::vector<uint8_t> x, dy, gamma, dx, dgamma;
  uint64_t Bytes() const { return x.size() + dy.size() + dx.size(); }
};

Tensors MakeTensors(uint64_t rows, uint32_t hidden, normgrad::ElementType type, uint32_t seed) {
  Tensors t;
  t.rows = rows;
  t.hidden = hidden;
  t.type = type;
  const size_t element = type == normgrad::ElementType::kF32 ? 4 : 2;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  auto fill = [&](std::vector<uint8_t>& v, size_t n) {
    v.resize(n * element);
    for (size_t i = 0; i < n; ++i) {
      const float f = u(rng);
      if (element == 4) {
        std::memcpy(v.data() + 4 * i, &f, 4);
      } else {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        const uint16_t top = static_cast<uint16_t>(bits >> 16);  // bf16
        std::memcpy(v.data() + 2 * i, &top, 2);
      }
    }
  };
  fill(t.x, rows * hidden);
  fill(t.dy, rows * hidden);
  fill(t.gamma, hidden);
  t.dx.resize(t.x.size());
  t.dgamma.resize(t.gamma.size());
  return t;
}

double PlainRoundTrip(int fd, const Tensors& t, std::vector<uint8_t>& dx) {
  const uint64_t header[2] = {t.x.size() + t.dy.size(), t.dx.size()};
  const absl::Time start = absl::Now();
  if (!WriteAll(fd, header, sizeof(header)) || !WriteAll(fd, t.x.data(), t.x.size()) ||
      !WriteAll(fd, t.dy.data(), t.dy.size()) || !ReadAll(fd, dx.data(), t.dx.size())) {
    return -1;
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// Slices that point into `a` and `b` (no copy), as normgrad's client sends rows.
grpc::ByteBuffer Lent(const uint8_t* a, size_t a_n, const uint8_t* b, size_t b_n) {
  grpc::Slice s[2] = {grpc::Slice(const_cast<uint8_t*>(a), a_n, grpc::Slice::STATIC_SLICE),
                      grpc::Slice(const_cast<uint8_t*>(b), b_n, grpc::Slice::STATIC_SLICE)};
  return grpc::ByteBuffer(s, 2);
}

// The answer's bytes into `dx`: the copy any client makes of what gRPC received.
void CopyOut(const grpc::ByteBuffer& b, uint8_t* dx) {
  std::vector<grpc::Slice> slices;
  (void)b.Dump(&slices);
  for (const grpc::Slice& s : slices) {
    std::memcpy(dx, s.begin(), s.size());
    dx += s.size();
  }
}

double EchoUnary(grpc::GenericStub& stub, const Tensors& t, std::vector<uint8_t>& dx) {
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  grpc::ByteBuffer request = Lent(t.x.data(), t.x.size(), t.dy.data(), t.dy.size());
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  bool ok = false;
  stub.UnaryCall(&context, "/echo/Unary", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   ok = s.ok();
                   done = true;
                   cv.notify_one();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  if (!ok || response.Length() != t.dx.size()) return -1;
  CopyOut(response, dx.data());
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// The same unary echo through gRPC's blocking API: the caller's thread drives the call.
double EchoUnarySync(grpc::Channel& channel, const Tensors& t, std::vector<uint8_t>& dx) {
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  const grpc::ByteBuffer request = Lent(t.x.data(), t.x.size(), t.dy.data(), t.dy.size());
  grpc::ByteBuffer response;
  const grpc::internal::RpcMethod method("/echo/Unary", grpc::internal::RpcMethod::NORMAL_RPC);
  const grpc::Status s = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
      &channel, method, &context, request, &response);
  if (!s.ok() || response.Length() != t.dx.size()) return -1;
  CopyOut(response, dx.data());
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// The bidi echo: a message of 1 MiB of x and 1 MiB of dy at a time (one write in flight, gRPC's
// rule), answers read as they come.
class EchoBidi final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  EchoBidi(grpc::GenericStub& stub, const Tensors& t, std::vector<uint8_t>& dx)
      : t_(t), dx_(dx) {
    stub.PrepareBidiStreamingCall(&context_, "/echo/Bidi", grpc::StubOptions(), this);
    NextWrite();
    StartRead(&in_);
    StartCall();
  }
  double Wait() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_; });
    return ok_ && received_ == t_.dx.size() ? absl::ToDoubleSeconds(absl::Now() - start_) : -1;
  }
  void OnWriteDone(bool ok) override {
    if (ok) NextWrite();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    CopyOut(in_, dx_.data() + received_);
    received_ += in_.Length();
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override {
    std::lock_guard<std::mutex> lock(mu_);
    ok_ = s.ok();
    done_ = true;
    cv_.notify_one();
  }

 private:
  void NextWrite() {
    if (sent_ >= t_.x.size()) {
      StartWritesDone();
      return;
    }
    const size_t n = std::min<size_t>(kMessageBytes, t_.x.size() - sent_);
    out_ = Lent(t_.x.data() + sent_, n, t_.dy.data() + sent_, n);
    sent_ += n;
    StartWrite(&out_);
  }

  const Tensors& t_;
  std::vector<uint8_t>& dx_;
  const absl::Time start_ = absl::Now();
  grpc::ClientContext context_;
  grpc::ByteBuffer out_, in_;
  size_t sent_ = 0;
  size_t received_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool ok_ = false;
};

double ServiceCall(normgrad::Client& client, Tensors& t) {
  normgrad::RawBackwardArgs args;
  args.type = t.type;
  args.num_rows = t.rows;
  args.hidden_dim = t.hidden;
  args.eps = 1e-5f;
  args.x = t.x;
  args.dy = t.dy;
  args.gamma = t.gamma;
  args.dx = absl::MakeSpan(t.dx);
  args.dgamma = absl::MakeSpan(t.dgamma);
  const absl::Time start = absl::Now();
  absl::StatusOr<normgrad::RawBackwardResult> r = client.BackwardRaw(args, {});
  if (!r.ok()) {
    std::fprintf(stderr, "service call failed: %s\n", r.status().ToString().c_str());
    return -1;
  }
  return absl::ToDoubleSeconds(absl::Now() - start);
}

// The Python client in a python3 child: best seconds of `repeats` large calls and the p50 of
// `small_calls` 1 x 896 calls, printed as "python large=S small_p50=S".
const char kPythonScript[] = R"(
import sys, time, numpy as np, normgrad
target, rows, hidden, dtype, repeats, small = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
c = normgrad.Client(target, transport="bytes")
def arrays(r, h, dt):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((r, h), dtype=np.float32)
    dy = rng.standard_normal((r, h), dtype=np.float32)
    g = rng.standard_normal(h, dtype=np.float32)
    if dt != "f32":  # bf16 bits: numpy has no bfloat16
        x, dy, g = [(a.view(np.uint32) >> 16).astype(np.uint16) for a in (x, dy, g)]
    return x, dy, g
def timed(f):
    t = time.perf_counter()
    f()
    return time.perf_counter() - t
def raw(r, h, dt):
    # Into caller-owned outputs: Client.backward(out=...) for f32; for bf16 (no numpy
    # bfloat16) the binding that backward calls, with the bits as uint16.
    x, dy, g = arrays(r, h, dt)
    dx, dg = np.empty_like(x), np.empty_like(g)
    if dt == "f32":
        return lambda: c.backward(x, dy, g, out=(dx, dg))
    return lambda: c._native.backward_raw(dt, r, h, 1e-5, x, dy, g, None, dx, dg, "", 0.0, 0)
def api(r, h):
    # normgrad.Client.backward: new output arrays each call, as its users get them.
    x, dy, g = arrays(r, h, "f32")
    return lambda: c.backward(x, dy, g)
def best(f, n):
    f()  # warm-up
    return min(timed(f) for _ in range(n))
large = best(raw(rows, hidden, dtype), repeats)
large_api = best(api(rows, hidden), repeats) if dtype == "f32" else -1.0
p50 = -1.0
if small > 0:
    s = raw(1, 896, "f32")
    for _ in range(50): s()
    times = sorted(timed(s) for _ in range(small))
    p50 = times[len(times) // 2]
print(f"python large={large} large_api={large_api} small_p50={p50}", flush=True)
)";

struct PythonFigures {
  double large = -1, large_api = -1, small_p50 = -1;
};

PythonFigures RunPython(const std::string& package_dir, const std::string& target,
                        const Tensors& t, int repeats, int small_calls) {
  PythonFigures f;
  const std::string script_path =
      (std::filesystem::temp_directory_path() / "normgrad-bench-remote.py").string();
  std::ofstream(script_path) << kPythonScript;
  setenv("PYTHONPATH", package_dir.c_str(), 1);
  absl::StatusOr<ChildProcess> child = ChildProcess::Start(
      {"/usr/bin/python3", script_path, target, std::to_string(t.rows), std::to_string(t.hidden),
       t.type == normgrad::ElementType::kF32 ? "f32" : "bf16", std::to_string(repeats),
       std::to_string(small_calls)});
  if (!child.ok()) return f;
  const std::string line = child->ReadLine(absl::Minutes(10));
  for (absl::string_view field : absl::StrSplit(line, ' ')) {
    if (absl::ConsumePrefix(&field, "large=")) f.large = std::stod(std::string(field));
    if (absl::ConsumePrefix(&field, "large_api=")) f.large_api = std::stod(std::string(field));
    if (absl::ConsumePrefix(&field, "small_p50=")) f.small_p50 = std::stod(std::string(field));
  }
  child->WaitExit(absl::Seconds(30));
  return f;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

struct Transport {
  std::string name;  // "tcp" or "unix"
  std::string plain, echo, service;  // targets
};

int Run() {
  const std::string dir = std::filesystem::temp_directory_path() /
                          absl::StrCat("normgrad-bench-remote-", getpid());
  std::filesystem::create_directories(dir);
  const std::string self = BesideThisProgram("bench_remote");
  const uint64_t rows = absl::GetFlag(FLAGS_rows);
  const uint32_t hidden = absl::GetFlag(FLAGS_hidden);

  // The servers, each a process of its own.
  absl::StatusOr<ChildProcess> plain = ChildProcess::Start(
      {self, "--serve=plain", "--unix_path=" + dir + "/plain.sock"});
  absl::StatusOr<ChildProcess> echo = ChildProcess::Start(
      {self, "--serve=echo", "--unix_path=" + dir + "/echo.sock",
       absl::StrCat("--rows=", rows), absl::StrCat("--hidden=", hidden)});
  std::string server_path = absl::GetFlag(FLAGS_server);
  if (server_path.empty()) server_path = BesideThisProgram("normgrad-server");
  absl::StatusOr<ChildProcess> service = ChildProcess::Start(
      {server_path, "--listen=127.0.0.1:0", "--listen=unix:" + dir + "/normgrad.sock",
       "--metrics-listen=", "--backend=cpu", "--max-message-bytes=67108864"});
  if (!plain.ok() || !echo.ok() || !service.ok()) {
    std::fprintf(stderr, "could not start the servers\n");
    return 1;
  }
  auto port_of = [](ChildProcess& p) {
    const std::string line = p.ReadLine(absl::Seconds(60));
    const size_t at = line.find("tcp=");
    return at == std::string::npos ? std::string() : line.substr(at + 4);
  };
  const std::string plain_port = port_of(*plain), echo_port = port_of(*echo);
  const normgrad::testing::ReadyLine ready = service->AwaitReady(absl::Seconds(120));
  if (plain_port.empty() || echo_port.empty() || ready.grpc_port == 0) {
    std::fprintf(stderr, "a server did not come up: %s\n", ready.text.c_str());
    return 1;
  }
  const std::vector<Transport> transports = {
      {"tcp", "127.0.0.1:" + plain_port, "127.0.0.1:" + echo_port,
       absl::StrCat("127.0.0.1:", ready.grpc_port)},
      {"unix", "unix:" + dir + "/plain.sock", "unix:" + dir + "/echo.sock",
       "unix:" + dir + "/normgrad.sock"}};

  std::map<std::string, int> plain_fd;
  std::map<std::string, std::unique_ptr<grpc::GenericStub>> echo_stub;
  std::map<std::string, std::shared_ptr<grpc::Channel>> echo_channel;
  std::map<std::string, std::unique_ptr<normgrad::Client>> client;
  for (const Transport& t : transports) {
    plain_fd[t.name] = Connect(t.plain);
    if (plain_fd[t.name] < 0) return 1;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    echo_channel[t.name] =
        grpc::CreateCustomChannel(t.echo, grpc::InsecureChannelCredentials(), args);
    echo_stub[t.name] = std::make_unique<grpc::GenericStub>(echo_channel[t.name]);
    normgrad::ClientOptions options;
    options.target = t.service;
    options.transport = normgrad::Transport::kBytes;
    absl::StatusOr<std::unique_ptr<normgrad::Client>> c = normgrad::Client::Create(options);
    if (!c.ok()) {
      std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
      return 1;
    }
    client[t.name] = std::move(*c);
  }

  std::string python_dir = absl::GetFlag(FLAGS_python);
  if (python_dir.empty()) {
    python_dir = (std::filesystem::path(self).parent_path().parent_path() / "python").string();
  }
  const bool python = python_dir != "off" &&
                      std::filesystem::exists(std::filesystem::path(python_dir) / "normgrad");

  std::printf("machine: %u hardware threads; link: %s; service: normgrad-server --backend=cpu, "
              "its own process; python client: %s\n",
              std::thread::hardware_concurrency(),
              absl::GetFlag(FLAGS_link).empty() ? "loopback" : absl::GetFlag(FLAGS_link).c_str(),
              python ? python_dir.c_str() : "off");
  const int repeats = absl::GetFlag(FLAGS_repeats);
  int small_calls = absl::GetFlag(FLAGS_small_calls);

  // Large batches: the paths alternate within each round; the best round of each is reported.
  for (absl::string_view dtype : absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',')) {
    const normgrad::ElementType type =
        dtype == "bf16" ? normgrad::ElementType::kBF16 : normgrad::ElementType::kF32;
    Tensors t = MakeTensors(rows, hidden, type, 7);
    std::vector<uint8_t> sink(t.dx.size());
    std::map<std::string, double> best;
    auto keep = [&](const std::string& key, double s) {
      if (s < 0) {
        std::fprintf(stderr, "%s failed\n", key.c_str());
        return;
      }
      if (best.count(key) == 0 || s < best[key]) best[key] = s;
    };
    for (int r = 0; r < repeats + 1; ++r) {  // round 0 warms every path up
      for (const Transport& tr : transports) {
        const double p = PlainRoundTrip(plain_fd[tr.name], t, sink);
        const double u = EchoUnary(*echo_stub[tr.name], t, sink);
        const double b = EchoBidi(*echo_stub[tr.name], t, sink).Wait();
        const double s = ServiceCall(*client[tr.name], t);
        if (r == 0) continue;
        keep(tr.name + " plain", p);
        keep(tr.name + " echo unary", u);
        keep(tr.name + " echo bidi", b);
        keep(tr.name + " service c++", s);
      }
    }
    std::map<std::string, PythonFigures> py;
    if (python) {
      for (const Transport& tr : transports) {
        py[tr.name] = RunPython(python_dir, tr.service, t, repeats, 0);
      }
    }
    for (const Transport& tr : transports) {
      const double floor = best[tr.name + " plain"];
      std::printf("\n%s %llux%u %s (x + dy + dx = %.0f MiB):\n", tr.name.c_str(),
                  static_cast<unsigned long long>(rows), hidden, std::string(dtype).c_str(),
                  static_cast<double>(t.Bytes()) / (1 << 20));
      auto line = [&](const std::string& what, double s, const char* target) {
        if (s <= 0) {
          std::printf("  %-14s failed\n", what.c_str());
          return;
        }
        std::printf("  %-14s %7.3f GB/s  %8.1f ms  /plain = %.2f%s\n", what.c_str(),
                    static_cast<double>(t.Bytes()) / s / 1e9, s * 1e3, floor / s, target);
      };
      line("plain socket", floor, "");
      line("echo unary", best[tr.name + " echo unary"], "");
      line("echo bidi", best[tr.name + " echo bidi"], "");
      const char* target = tr.name == "tcp"
                               ? (absl::GetFlag(FLAGS_link).empty() ? "  (target >= 0.5)"
                                                                    : "  (target >= 0.8)")
                               : "";
      line("service c++", best[tr.name + " service c++"], target);
      if (python) {
        line("service python", py[tr.name].large, target);
        if (py[tr.name].large_api > 0) {
          line("  .backward()", py[tr.name].large_api, "  (new output arrays each call)");
        }
      }
    }
  }

  // 1 x 896 f32: blocks of 50 calls per path in turn, until each path made small_calls.
  if (small_calls > 0) {
    Tensors t = MakeTensors(1, 896, normgrad::ElementType::kF32, 9);
    std::vector<uint8_t> sink(t.dx.size());
    std::map<std::string, std::vector<double>> times;
    for (int done = -50; done < small_calls; done += 50) {  // the first block warms up
      for (const Transport& tr : transports) {
        for (int i = 0; i < 50; ++i) {
          const double p = PlainRoundTrip(plain_fd[tr.name], t, sink);
          const double u = EchoUnary(*echo_stub[tr.name], t, sink);
          const double us = EchoUnarySync(*echo_channel[tr.name], t, sink);
          const double s = ServiceCall(*client[tr.name], t);
          if (done < 0) continue;
          times[tr.name + " echo sync"].push_back(us);
          times[tr.name + " plain"].push_back(p);
          times[tr.name + " echo unary"].push_back(u);
          times[tr.name + " service c++"].push_back(s);
        }
      }
    }
    std::map<std::string, PythonFigures> py;
    if (python) {
      for (const Transport& tr : transports) {
        py[tr.name] = RunPython(python_dir, tr.service, MakeTensors(1, 896, t.type, 1), 1,
                                small_calls);
      }
    }
    for (const Transport& tr : transports) {
      const double floor = Percentile(times[tr.name + " plain"], 0.5);
      const double echo_p50 = Percentile(times[tr.name + " echo unary"], 0.5);
      std::printf("\n%s 1x896 f32, p50 of %d calls each:\n", tr.name.c_str(), small_calls);
      auto line = [&](const std::string& what, double p50, const char* target) {
        std::printf("  %-14s %8.1f us  /plain = %.1f  /echo unary = %.2f%s\n", what.c_str(),
                    p50 * 1e6, p50 / floor, p50 / echo_p50, target);
      };
      line("plain socket", floor, "");
      line("echo unary", echo_p50, "");
      line("echo sync", Percentile(times[tr.name + " echo sync"], 0.5), "");
      line("service c++", Percentile(times[tr.name + " service c++"], 0.5),
           "  (target: /plain <= 4, /echo unary <= 1.3)");
      if (python) line("service python", py[tr.name].small_p50, "");
    }
  }
  for (auto& [name, fd] : plain_fd) close(fd);
  client.clear();
  echo_stub.clear();
  echo_channel.clear();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  const std::string serve = absl::GetFlag(FLAGS_serve);
  if (serve == "plain") ServePlain(absl::GetFlag(FLAGS_unix_path));
  if (serve == "echo") {
    ServeEcho(absl::GetFlag(FLAGS_unix_path),
              absl::GetFlag(FLAGS_rows) * absl::GetFlag(FLAGS_hidden) * 4);
  }
  const std::string link = absl::GetFlag(FLAGS_link);
  if (!link.empty() && !absl::GetFlag(FLAGS_in_namespace)) {
    // Again, in a network namespace of its own whose loopback is limited to `link`.
    std::vector<std::string> again = {"unshare", "-n", "--", BesideThisProgram("bench_remote"),
                                      "--in_namespace"};
    for (int i = 1; i < argc; ++i) again.push_back(argv[i]);
    std::vector<char*> cargv;
    for (std::string& a : again) cargv.push_back(a.data());
    cargv.push_back(nullptr);
    execvp("unshare", cargv.data());
    std::perror("unshare (needs root and util-linux)");
    return 1;
  }
  if (!link.empty()) {
    const std::string setup = absl::StrCat(
        "ip link set lo up && tc qdisc add dev lo root tbf rate ", link,
        " burst 1mb latency 10ms");
    if (std::system(setup.c_str()) != 0) {
      std::fprintf(stderr, "could not limit loopback (%s): needs root, ip and tc\n", setup.c_str());
      return 1;
    }
  }
  return Run();
}
