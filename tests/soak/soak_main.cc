// normgrad-soak: mixed load against one running normgrad-server for a chosen duration (driven by
// scripts/soak.sh). Workers pick at random: large and small RmsNormBackward batches (every
// result checked against the CPU reference), EmitPtx, streams cancelled after a random number of
// messages, and malformed streams. Every --report-every it prints the server's resident memory
// (VmRSS of --server-pid) under load; with --metrics-port it also pauses the workers, waits for
// the server to go idle and reads its heap in use (normgrad_process_heap_in_use_bytes), which a
// leak grows and allocator caching does not. At the end: the requests by kind and outcome, the
// wrong gradients and the memory growth after warm-up. Exit status 1 when any gradient was
// wrong, any outcome was one the kind does not allow, or the idle heap grew by more than
// --max-heap-growth after warm-up.
//
//   normgrad-soak --port=50051 --metrics-port=9464 --server-pid=1234 --duration=10m --workers=4
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "tests/common/child_process.h"
#include "tests/server/service/service_test_util.h"

namespace normgrad::soak {
namespace {

namespace t = ::normgrad::server::testing;

struct Options {
  int port = 0;
  int server_pid = 0;
  absl::Duration duration = absl::Minutes(10);
  absl::Duration report_every = absl::Seconds(30);
  int workers = 4;
  int metrics_port = 0;                     // 0: no idle heap samples
  uint64_t max_heap_growth = 16ull << 20;  // idle heap in use, end vs first sample after warm-up
};

// Lets the main thread stop the workers between requests for an idle measurement.
class Gate {
 public:
  void Enter() {
    std::unique_lock<std::mutex> lock(mu_);
    changed_.wait(lock, [this] { return !paused_; });
    ++active_;
  }
  void Leave() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      --active_;
    }
    changed_.notify_all();
  }
  void Pause() {
    std::unique_lock<std::mutex> lock(mu_);
    paused_ = true;
    changed_.wait(lock, [this] { return active_ == 0; });
  }
  void Resume() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      paused_ = false;
    }
    changed_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  bool paused_ = false;
  int active_ = 0;
};

// The server's idle heap in use: workers paused, no stream left on the server. 0 if unknown.
uint64_t IdleHeapInUse(int metrics_port, Gate& gate) {
  gate.Pause();
  uint64_t heap = 0;
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (absl::Now() < give_up) {
    int code = 0;
    std::string error;
    std::map<std::string, double> m =
        t::ParsePrometheusText(t::HttpGet(metrics_port, "/metrics", &code), &error);
    if (code == 200 && m["normgrad_inflight_streams"] == 0 && m["normgrad_inflight_bytes"] == 0) {
      absl::SleepFor(absl::Milliseconds(200));  // let finished calls' last frees land
      m = t::ParsePrometheusText(t::HttpGet(metrics_port, "/metrics", &code), &error);
      heap = static_cast<uint64_t>(m["normgrad_process_heap_in_use_bytes"]);
      break;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  gate.Resume();
  return heap;
}

class Tally {
 public:
  // `allowed`: whether this outcome is one the kind may produce.
  void Add(const std::string& kind, grpc::StatusCode code, bool allowed) {
    std::lock_guard<std::mutex> lock(mu_);
    ++counts_[{kind, code}];
    if (!allowed) ++unexpected_;
  }
  void WrongGradient(const std::string& detail) {
    std::lock_guard<std::mutex> lock(mu_);
    ++wrong_;
    if (wrong_ <= 5) std::fprintf(stderr, "soak: WRONG GRADIENT %s\n", detail.c_str());
  }
  uint64_t Total() {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t n = 0;
    for (const auto& [key, count] : counts_) n += count;
    return n;
  }
  void Print(uint64_t* wrong, uint64_t* unexpected) {
    std::lock_guard<std::mutex> lock(mu_);
    std::printf("%-16s %-20s %10s\n", "kind", "outcome", "requests");
    for (const auto& [key, count] : counts_) {
      std::printf("%-16s %-20s %10llu\n", key.first.c_str(), CodeName(key.second),
                  static_cast<unsigned long long>(count));
    }
    *wrong = wrong_;
    *unexpected = unexpected_;
  }

 private:
  static const char* CodeName(grpc::StatusCode code) {
    switch (code) {
      case grpc::OK: return "OK";
      case grpc::CANCELLED: return "CANCELLED";
      case grpc::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
      case grpc::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
      case grpc::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
      case grpc::UNAVAILABLE: return "UNAVAILABLE";
      case grpc::INTERNAL: return "INTERNAL";
      default: return "OTHER";
    }
  }

  std::mutex mu_;
  std::map<std::pair<std::string, grpc::StatusCode>, uint64_t> counts_;
  uint64_t wrong_ = 0;
  uint64_t unexpected_ = 0;
};

void CheckedBackward(v1::NormGrad::Stub& stub, const std::string& kind, uint64_t rows,
                     uint32_t hidden, uint64_t rows_per_chunk, bool with_rms, uint32_t seed,
                     Tally& tally) {
  const t::Batch batch = t::RandomBatch(rows, hidden, seed, with_rms);
  const t::BackwardResult r = t::RunBackward(stub, batch, rows_per_chunk, absl::Seconds(300));
  // Admission may refuse a stream under load; anything else is a failure.
  tally.Add(kind, r.status.error_code(),
            r.status.ok() || r.status.error_code() == grpc::RESOURCE_EXHAUSTED);
  if (!r.status.ok()) {
    if (r.status.error_code() != grpc::RESOURCE_EXHAUSTED) {
      std::fprintf(stderr, "soak: %s: %d %s\n", kind.c_str(), r.status.error_code(),
                   r.status.error_message().c_str());
    }
    return;
  }
  std::vector<float> dx, dgamma;
  t::ReferenceFor(batch, dx, dgamma);
  const double dx_error = t::MaxDxError(batch, r.dx, dx);
  const double dgamma_error = t::MaxScaledError(r.dgamma, dgamma);
  if (!(dx_error <= 1e-5 && dgamma_error <= 1e-5)) {
    tally.WrongGradient(absl::StrCat(kind, " rows=", rows, " hidden=", hidden, " dx error ",
                                     dx_error, " dgamma error ", dgamma_error));
  }
}

void EmitPtx(v1::NormGrad::Stub& stub, std::mt19937& rng, Tally& tally) {
  static const char* kTargets[] = {"sm_75", "sm_80", "sm_90"};
  static const uint32_t kHidden[] = {64, 896, 1024, 4096};
  v1::EmitPtxRequest request;
  request.set_kernel("batched_rms_norm_backward");
  request.set_hidden_dim(kHidden[rng() % 4]);
  request.set_target(kTargets[rng() % 3]);
  v1::EmitPtxResponse response;
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  const grpc::Status s = stub.EmitPtx(&context, request, &response);
  const bool good = s.ok() && response.ptx().find(".entry") != std::string::npos;
  tally.Add("emit_ptx", s.error_code(), good);
}

void Cancelled(v1::NormGrad::Stub& stub, std::mt19937& rng, Tally& tally) {
  const t::Batch batch = t::RandomBatch(32, 256, rng());
  const int send = static_cast<int>(rng() % 6);  // header + up to 4 chunks of 8 rows + half-close
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto stream = stub.RmsNormBackward(&context);
  for (int m = 0; m < send && m < 5; ++m) {
    if (!stream->Write(m == 0 ? t::HeaderFor(batch) : t::ChunkFor(batch, (m - 1) * 8, 8))) break;
  }
  if (send == 5) stream->WritesDone();
  v1::BackwardResponse response;
  if (rng() % 2 && send >= 2) stream->Read(&response);
  context.TryCancel();
  while (stream->Read(&response)) {
  }
  const grpc::Status s = stream->Finish();
  tally.Add("cancelled", s.error_code(),
            s.error_code() == grpc::CANCELLED || s.ok() ||
                s.error_code() == grpc::RESOURCE_EXHAUSTED);
}

void BadRequest(v1::NormGrad::Stub& stub, std::mt19937& rng, Tally& tally) {
  const t::Batch batch = t::RandomBatch(4, 16, rng());
  std::vector<v1::BackwardRequest> messages;
  switch (rng() % 4) {
    case 0:  // a chunk before the header
      messages = {t::ChunkFor(batch, 0, 4)};
      break;
    case 1: {  // x and dy of different lengths
      v1::BackwardRequest chunk = t::ChunkFor(batch, 0, 4);
      chunk.mutable_dy()->resize(chunk.dy().size() - 4);
      messages = {t::HeaderFor(batch), chunk};
      break;
    }
    case 2: {  // hidden_dim 0
      v1::BackwardRequest header = t::HeaderFor(batch);
      header.mutable_header()->set_hidden_dim(0);
      messages = {header};
      break;
    }
    default:  // more rows than declared
      messages = {t::HeaderFor(batch), t::ChunkFor(batch, 0, 4), t::ChunkFor(batch, 0, 2)};
      break;
  }
  const grpc::Status s = t::SendMessages(stub, messages);
  // Admission (--max-streams) runs before validation: a full server refuses a bad stream too.
  tally.Add("bad_request", s.error_code(),
            s.error_code() == grpc::INVALID_ARGUMENT ||
                (s.error_code() == grpc::RESOURCE_EXHAUSTED &&
                 s.error_message().find("--max-streams") != std::string::npos));
}

void Worker(int id, const Options& options, absl::Time end, Tally& tally, Gate& gate) {
  auto stub = t::StubFor(options.port);
  std::mt19937 rng(1000 + id);
  static const uint32_t kSmallHidden[] = {1, 8, 64, 100, 896, 1024};
  while (absl::Now() < end) {
    gate.Enter();
    struct Leave {
      Gate& gate;
      ~Leave() { gate.Leave(); }
    } leave{gate};
    const uint32_t pick = rng() % 100;
    if (pick < 10) {
      CheckedBackward(*stub, "large_backward", 512, 4096, 64, false, rng(), tally);
    } else if (pick < 55) {
      CheckedBackward(*stub, "small_backward", 1 + rng() % 64, kSmallHidden[rng() % 6],
                      1 + rng() % 16, rng() % 4 == 0, rng(), tally);
    } else if (pick < 70) {
      EmitPtx(*stub, rng, tally);
    } else if (pick < 85) {
      Cancelled(*stub, rng, tally);
    } else {
      BadRequest(*stub, rng, tally);
    }
  }
}

bool ParseOptions(int argc, char** argv, Options* o) {
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    bool ok = true;
    if (absl::ConsumePrefix(&arg, "--port=")) {
      ok = absl::SimpleAtoi(arg, &o->port);
    } else if (absl::ConsumePrefix(&arg, "--server-pid=")) {
      ok = absl::SimpleAtoi(arg, &o->server_pid);
    } else if (absl::ConsumePrefix(&arg, "--duration=")) {
      ok = absl::ParseDuration(arg, &o->duration);
    } else if (absl::ConsumePrefix(&arg, "--report-every=")) {
      ok = absl::ParseDuration(arg, &o->report_every) && o->report_every > absl::ZeroDuration();
    } else if (absl::ConsumePrefix(&arg, "--metrics-port=")) {
      ok = absl::SimpleAtoi(arg, &o->metrics_port);
    } else if (absl::ConsumePrefix(&arg, "--max-heap-growth-mib=")) {
      ok = absl::SimpleAtoi(arg, &o->max_heap_growth);
      o->max_heap_growth <<= 20;
    } else if (absl::ConsumePrefix(&arg, "--workers=")) {
      ok = absl::SimpleAtoi(arg, &o->workers) && o->workers > 0;
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "normgrad-soak: bad argument %s\n", argv[i]);
      return false;
    }
  }
  if (o->port <= 0 || o->server_pid <= 0) {
    std::fprintf(stderr,
                 "usage: normgrad-soak --port=N --server-pid=PID [--metrics-port=N] "
                 "[--duration=10m] [--report-every=30s] [--workers=4] "
                 "[--max-heap-growth-mib=16]\n");
    return false;
  }
  return true;
}

int Main(int argc, char** argv) {
  Options options;
  if (!ParseOptions(argc, argv, &options)) return 2;
  Tally tally;
  Gate gate;
  const absl::Time start = absl::Now();
  const absl::Time end = start + options.duration;
  std::vector<std::thread> workers;
  for (int i = 0; i < options.workers; ++i) {
    workers.emplace_back([&, i] { Worker(i, options, end, tally, gate); });
  }
  // Warm-up: the first 10% of the run (caches fill, allocator pools grow).
  const absl::Duration warm_up = options.duration / 10;
  uint64_t rss_after_warm_up = 0, peak_after_warm_up = 0;
  uint64_t heap_after_warm_up = 0, heap_peak_after_warm_up = 0;
  while (true) {
    const absl::Time now = absl::Now();
    const uint64_t rss = ::normgrad::testing::ProcStatusBytes(options.server_pid, "VmRSS:");
    const bool warm = now - start >= warm_up;
    if (warm) {
      if (rss_after_warm_up == 0) rss_after_warm_up = rss;
      peak_after_warm_up = std::max(peak_after_warm_up, rss);
    }
    std::string heap_text;
    if (options.metrics_port > 0 && now < end) {
      const uint64_t heap = IdleHeapInUse(options.metrics_port, gate);
      heap_text = absl::StrFormat(" idle_heap_in_use=%7.1f MiB", heap / 1048576.0);
      if (warm) {
        if (heap_after_warm_up == 0) heap_after_warm_up = heap;
        heap_peak_after_warm_up = std::max(heap_peak_after_warm_up, heap);
      }
    }
    std::printf("t=%6.0fs server_rss=%7.1f MiB%s requests=%llu\n",
                absl::ToDoubleSeconds(now - start), rss / 1048576.0, heap_text.c_str(),
                static_cast<unsigned long long>(tally.Total()));
    std::fflush(stdout);
    if (now >= end) break;
    absl::SleepFor(std::min(options.report_every, end - now));
  }
  for (std::thread& w : workers) w.join();
  const uint64_t final_rss = ::normgrad::testing::ProcStatusBytes(options.server_pid, "VmRSS:");
  const uint64_t final_heap =
      options.metrics_port > 0 ? IdleHeapInUse(options.metrics_port, gate) : 0;
  uint64_t wrong = 0, unexpected = 0;
  std::printf("\nrequests by kind and outcome (%s, %d workers):\n",
              absl::FormatDuration(options.duration).c_str(), options.workers);
  tally.Print(&wrong, &unexpected);
  std::printf("wrong gradients: %llu\nunexpected outcomes: %llu\n",
              static_cast<unsigned long long>(wrong), static_cast<unsigned long long>(unexpected));
  std::printf(
      "server RSS: %.1f MiB after warm-up (%s), %.1f MiB peak after warm-up, %.1f MiB at the "
      "end\n",
      rss_after_warm_up / 1048576.0, absl::FormatDuration(warm_up).c_str(),
      peak_after_warm_up / 1048576.0, final_rss / 1048576.0);
  bool heap_ok = true;
  if (options.metrics_port > 0) {
    const double growth = (static_cast<double>(final_heap) - heap_after_warm_up) / 1048576.0;
    heap_ok = heap_after_warm_up > 0 && final_heap > 0 &&
              final_heap <= heap_after_warm_up + options.max_heap_growth;
    std::printf(
        "server idle heap in use: %.1f MiB after warm-up, %.1f MiB peak, %.1f MiB at the end "
        "(%+.1f MiB; limit +%llu MiB): %s\n",
        heap_after_warm_up / 1048576.0, heap_peak_after_warm_up / 1048576.0,
        final_heap / 1048576.0, growth,
        static_cast<unsigned long long>(options.max_heap_growth >> 20),
        heap_ok ? "flat" : "GREW (or unknown)");
  }
  return wrong == 0 && unexpected == 0 && heap_ok ? 0 : 1;
}

}  // namespace
}  // namespace normgrad::soak

int main(int argc, char** argv) { return normgrad::soak::Main(argc, argv); }
