// The shared-memory transport end to end: a server with --shared-memory on a unix socket, the
// client library registering memfd regions on its region socket, Backward calls that read x and
// dy and write grad_input in place (zero copy) or through a staging region (transport auto); and
// every way a region can be misused: another client's id and key, offsets out of range or
// overflowing, misaligned or overlapping, a region that could be truncated, a plain file, a
// client that goes away, the server's limits, garbage on the region socket; dx written over dy
// (in place) by the library and the CLI.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/tools/cli.h"
#include "client/tools/load_flags.h"
#include "client/tools/npy.h"
#include "normgrad/client.h"
#include "normgrad/shared_memory.h"
#include "normgrad/v1/normgrad.grpc.pb.h"
#include "server/metrics/metrics.h"
#include "server/shared_memory/region_registry.h"
#include "tests/client/test_server.h"

namespace normgrad {
namespace {

using ::normgrad::testing::Batch;
using ::normgrad::testing::ExpectGradientsClose;
using ::testing::HasSubstr;

class SharedMemoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(mkdtemp(dir_.data()), nullptr);
    socket_ = dir_ + "/grpc.sock";
    server_ = testing::StartTestServer([this](server::ServerOptions& o) {
      o.listen = {"127.0.0.1:0", "unix:" + socket_};
      o.shared_memory = true;
      o.regions.max_regions = 8;
      o.regions.max_bytes = 256ull << 20;
    });
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override {
    server_.reset();
    std::filesystem::remove_all(dir_);
  }

  std::unique_ptr<Client> Connect(Transport transport = Transport::kAuto,
                                  std::string target = "") {
    ClientOptions o;
    o.target = target.empty() ? "unix:" + socket_ : target;
    o.transport = transport;
    o.max_attempts = 1;
    absl::StatusOr<std::unique_ptr<Client>> c = Client::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Request payload bytes the server received over gRPC for RmsNormBackward in the calls it has
  // finished so far. A client sees its call's status before the server's OnDone records it, so
  // this first waits until the server counted `calls` finished calls (requests_total is
  // recorded after the bytes).
  double ReceivedBytes(int calls) {
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while (true) {
      const std::string text = server_->metrics().RenderText();
      std::smatch m;
      // Both backward methods (a batch that fits one message is an RmsNormBackwardUnary call).
      static const std::regex done_re(
          "normgrad_requests_total\\{code=\"OK\",method=\"RmsNormBackward(Unary)?\"\\} "
          "([0-9.e+]+)");
      static const std::regex bytes_re(
          "normgrad_received_bytes_total\\{method=\"RmsNormBackward(Unary)?\"\\} ([0-9.e+]+)");
      auto sum = [&text](const std::regex& re) {
        double total = 0;
        for (auto it = std::sregex_iterator(text.begin(), text.end(), re);
             it != std::sregex_iterator(); ++it) {
          total += std::stod((*it)[2]);
        }
        return total;
      };
      if (static_cast<int>(sum(done_re)) >= calls || absl::Now() > deadline) return sum(bytes_re);
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // A counter by its name and labels as the exposition text writes them, 0 when absent.
  double Counter(const std::string& series) {
    const std::string text = server_->metrics().RenderText();
    const size_t at = text.find("\n" + series + " ");
    return at == std::string::npos ? 0.0 : std::stod(text.substr(at + series.size() + 2));
  }

  std::unique_ptr<v1::NormGrad::Stub> UnixStub() {
    return v1::NormGrad::NewStub(
        grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
  }

  std::string dir_ = "/tmp/normgrad-shm-XXXXXX";
  std::string socket_;
  std::unique_ptr<server::NormGradServer> server_;
};

// x, dy, dx of `b` laid out one after the other in a new region (plus rms when the batch has it).
struct Placed {
  std::unique_ptr<SharedMemoryRegion> region;
  absl::Span<float> x, dy, dx, rms;
};
Placed Place(const Batch& b) {
  const uint64_t n = b.rows * b.hidden;
  Placed p;
  p.region = *SharedMemoryRegion::Create((3 * n + b.rows) * 4);
  float* base = p.region->As<float>(0);
  p.x = absl::MakeSpan(base, n);
  p.dy = absl::MakeSpan(base + n, n);
  p.dx = absl::MakeSpan(base + 2 * n, n);
  p.rms = absl::MakeSpan(base + 3 * n, b.rows);
  std::copy(b.x.begin(), b.x.end(), p.x.begin());
  std::copy(b.dy.begin(), b.dy.end(), p.dy.begin());
  std::copy(b.rms.begin(), b.rms.end(), p.rms.begin());
  return p;
}

TEST_F(SharedMemoryTest, ARegisteredRegionIsComputedInPlaceWithNoPayloadOverGrpc) {
  auto client = Connect();
  absl::StatusOr<v1::GetServerInfoResponse> info = client->ServerInfo();
  ASSERT_TRUE(info.ok());
  EXPECT_TRUE(info->shared_memory().enabled());
  EXPECT_THAT(server_->ReadyLine(), HasSubstr(" shm=" + socket_ + ".shm"));

  const Batch b(1000, 512, /*seed=*/3);
  Placed p = Place(b);
  ASSERT_TRUE(client->RegisterSharedMemory(*p.region).ok());
  const double before = ReceivedBytes(0);
  std::vector<float> dgamma(b.hidden);
  BackwardOptions options;
  options.dx = p.dx;
  options.dgamma = absl::MakeSpan(dgamma);
  absl::StatusOr<Gradients> g = client->Backward(p.x, p.dy, b.gamma, 1e-5f, options);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(std::vector<float>(p.dx.begin(), p.dx.end()), dgamma, b);
  // Only gamma (2 KiB) crossed the socket, not the 4 MiB of x and dy.
  EXPECT_LT(ReceivedBytes(1) - before, 4096.0);
  EXPECT_EQ(server_->regions()->Stats().regions, 1u);
}

TEST_F(SharedMemoryTest, AutoTransportStagesOrdinaryBuffersThroughSharedMemory) {
  auto client = Connect();
  int calls = 0;
  for (const bool with_rms : {false, true}) {
    const Batch b(777, 96, /*seed=*/4, 1e-5f, with_rms);
    const double before = ReceivedBytes(calls);
    BackwardOptions options;
    options.rms = b.rms;
    absl::StatusOr<Gradients> g = client->Backward(b.x, b.dy, b.gamma, 1e-5f, options);
    ASSERT_TRUE(g.ok()) << g.status();
    ExpectGradientsClose(g->dx, g->dgamma, b);
    EXPECT_LT(ReceivedBytes(++calls) - before, 1024.0) << "rows went over gRPC";
  }
  // Bytes, asked for, still work, and do cross the socket.
  const Batch b(50, 64, /*seed=*/5);
  const double before = ReceivedBytes(calls);
  absl::StatusOr<Gradients> g = Connect(Transport::kBytes)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
  EXPECT_GE(ReceivedBytes(++calls) - before, 2.0 * 50 * 64 * 4);
  // The transport metrics tell the two apart: two streams through the region, one over the
  // socket, each with its x, dy (rms) and gamma in and its grad_input out.
  EXPECT_EQ(Counter("normgrad_transport_streams_total{transport=\"shm\"}"), 2);
  EXPECT_EQ(Counter("normgrad_transport_streams_total{transport=\"unix\"}"), 1);
  EXPECT_EQ(Counter("normgrad_transport_streams_total{transport=\"tcp\"}"), 0);
  EXPECT_EQ(Counter("normgrad_transport_tensor_bytes_total{transport=\"shm\"}"),
            2 * (3.0 * 777 * 96 * 4 + 96 * 4) + 777 * 4);
  EXPECT_EQ(Counter("normgrad_transport_tensor_bytes_total{transport=\"unix\"}"),
            3.0 * 50 * 64 * 4 + 64 * 4);
  // And a call over TCP is counted as TCP. (The server accepts TCP connections itself and hands
  // them to gRPC, which names them "fd:N" as it names the unix ones: the service looks the
  // connection up to tell them apart.)
  const Batch t(30, 64, /*seed=*/6);
  g = Connect(Transport::kBytes, absl::StrCat("127.0.0.1:", server_->port()))
          ->Backward(t.x, t.dy, t.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, t);
  EXPECT_EQ(Counter("normgrad_transport_streams_total{transport=\"tcp\"}"), 1);
  EXPECT_EQ(Counter("normgrad_transport_streams_total{transport=\"unix\"}"), 1);
  EXPECT_EQ(Counter("normgrad_transport_tensor_bytes_total{transport=\"tcp\"}"),
            3.0 * 30 * 64 * 4 + 64 * 4);
}

TEST_F(SharedMemoryTest, SharedMemoryOverTcpOrWithoutTheServerFlagIsFailedPrecondition) {
  const Batch b(4, 8, /*seed=*/6);
  auto tcp = Connect(Transport::kSharedMemory, absl::StrCat("127.0.0.1:", server_->port()));
  absl::StatusOr<Gradients> g = tcp->Backward(b.x, b.dy, b.gamma, 1e-5f);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("unix"));

  const std::string plain = dir_ + "/plain.sock";
  auto off =
      testing::StartTestServer([&](server::ServerOptions& o) { o.listen = {"unix:" + plain}; });
  ASSERT_NE(off, nullptr);
  ClientOptions o;
  o.target = "unix:" + plain;
  o.transport = Transport::kSharedMemory;
  auto c = *Client::Create(o);
  g = c->Backward(b.x, b.dy, b.gamma, 1e-5f);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("--shared-memory"));
  // Auto falls back to bytes there.
  o.transport = Transport::kAuto;
  g = (*Client::Create(o))->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
}

// Registers a region directly with the server's registry (what a region socket does) and returns
// its grant, for requests written by hand.
server::RegionGrant RegisterDirect(server::NormGradServer& s, const SharedMemoryRegion& region) {
  absl::StatusOr<server::RegionGrant> g =
      s.regions()->Register(server::OwnedFd(dup(region.fd())), {.connection = 999});
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? *g : server::RegionGrant{};
}

v1::BackwardRequest Header(uint64_t rows, uint32_t hidden, bool with_rms = false) {
  v1::BackwardRequest m;
  m.mutable_header()->set_num_rows(rows);
  m.mutable_header()->set_hidden_dim(hidden);
  m.mutable_header()->set_eps(1e-5f);
  m.mutable_header()->set_gamma(std::string(hidden * 4, '\0'));
  m.mutable_header()->set_rms_provided(with_rms);
  return m;
}

grpc::Status Send(v1::NormGrad::Stub& stub, const std::vector<v1::BackwardRequest>& messages) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub.RmsNormBackward(&context);
  for (const auto& m : messages) {
    if (!stream->Write(m)) break;
  }
  stream->WritesDone();
  v1::BackwardResponse r;
  while (stream->Read(&r)) {}
  return stream->Finish();
}

TEST_F(SharedMemoryTest, BadRegionReferencesAreRefusedNamingTheFieldAndNumbers) {
  auto region = *SharedMemoryRegion::Create(4096);
  const server::RegionGrant grant = RegisterDirect(*server_, *region);
  const std::string key(reinterpret_cast<const char*>(grant.key.data()), grant.key.size());
  auto chunk = [&](uint64_t x, uint64_t dy, uint64_t dx, uint64_t rows = 2) {
    v1::BackwardRequest m;
    v1::SharedMemoryChunk* s = m.mutable_shm();
    s->set_region_id(grant.id);
    s->set_region_key(key);
    s->set_num_rows(rows);
    s->set_x_offset(x);
    s->set_dy_offset(dy);
    s->set_grad_input_offset(dx);
    return m;
  };
  auto stub = UnixStub();
  const struct {
    v1::BackwardRequest message;
    grpc::StatusCode code;
    const char* says;
  } cases[] = {
      // 2 rows x 64 x 4 B = 512 B each.
      {chunk(0, 512, 4000), grpc::INVALID_ARGUMENT,
       "shm.grad_input_offset is 4000 with 512 bytes to access, past the end of the 4096-byte"},
      {chunk(0, UINT64_MAX - 100, 1024), grpc::INVALID_ARGUMENT,
       "shm.dy_offset is 18446744073709551515"},
      {chunk(2, 512, 1024), grpc::INVALID_ARGUMENT, "shm.x_offset is 2, not a multiple of 4"},
      {chunk(0, 512, 256), grpc::INVALID_ARGUMENT,
       "shm.grad_input_offset = 256 (512 bytes) overlaps shm.x_offset"},
      {chunk(0, 512, 768), grpc::INVALID_ARGUMENT,
       "shm.grad_input_offset = 768 (512 bytes) overlaps shm.dy_offset = 512 (512 bytes); "
       "grad_input may overlap an input only as exactly dy's range (in place)"},
      {chunk(512, 512, 512), grpc::INVALID_ARGUMENT,
       "shm.grad_input_offset = 512 (512 bytes) overlaps shm.x_offset = 512"},
      {chunk(0, 512, 1024, 3), grpc::INVALID_ARGUMENT, "would exceed header.num_rows = 2"},
  };
  for (const auto& c : cases) {
    const grpc::Status st = Send(*stub, {Header(2, 64), c.message});
    EXPECT_EQ(st.error_code(), c.code) << c.says << ": " << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr(c.says));
  }
  // Another client's region: a wrong key, or an id nobody registered, gets the same answer.
  v1::BackwardRequest wrong_key = chunk(0, 512, 1024);
  wrong_key.mutable_shm()->set_region_key(std::string(16, 'k'));
  v1::BackwardRequest unknown = chunk(0, 512, 1024);
  unknown.mutable_shm()->set_region_id(grant.id + 100);
  for (const auto& m : {wrong_key, unknown}) {
    const grpc::Status st = Send(*stub, {Header(2, 64), m});
    EXPECT_EQ(st.error_code(), grpc::NOT_FOUND) << st.error_message();
    EXPECT_THAT(st.error_message(), HasSubstr("no registered region with this id and shm.region_key"));
  }
  // The right one works, and so does grad_input exactly over dy (in place).
  EXPECT_TRUE(Send(*stub, {Header(2, 64), chunk(0, 512, 1024)}).ok());
  EXPECT_TRUE(Send(*stub, {Header(2, 64), chunk(0, 512, 512)}).ok());
}

// dx written over dy in a registered region (the server computes in place) gives the bits of dx
// written apart, for f32 and bf16 and the variants' paths; the client refuses a dx that overlaps
// dy without in_place.
TEST_F(SharedMemoryTest, InPlaceOverSharedMemoryGivesTheBitsOfOutOfPlace) {
  auto client = Connect(Transport::kSharedMemory);
  const Batch b(301, 200, /*seed=*/8);
  const uint64_t n = b.rows * b.hidden;
  const struct {
    ElementType type;
    float offset;
    v1::CastingMode casting;
  } cases[] = {{ElementType::kF32, 0.0f, v1::CASTING_MODE_UNSPECIFIED},
               {ElementType::kF32, 0.5f, v1::CASTING_MODE_LLAMA},
               {ElementType::kBF16, 0.0f, v1::CASTING_MODE_UNSPECIFIED},
               {ElementType::kBF16, 1.0f, v1::CASTING_MODE_LLAMA}};
  for (const auto& c : cases) {
    SCOPED_TRACE(absl::StrCat(static_cast<int>(c.type), " offset ", c.offset));
    const uint64_t elem = c.type == ElementType::kF32 ? 4 : 2;
    const uint64_t bytes = n * elem;
    // x, dy, dx, then dy again (for the in-place call), as the element type (bf16: the top half
    // of the f32 bits).
    auto region = *SharedMemoryRegion::Create(4 * bytes);
    auto put = [&](const std::vector<float>& v, uint8_t* at) {
      for (uint64_t i = 0; i < v.size(); ++i)
        std::memcpy(at + i * elem, reinterpret_cast<const uint8_t*>(&v[i]) + 4 - elem, elem);
    };
    uint8_t* base = region->data();
    put(b.x, base);
    put(b.dy, base + bytes);
    put(b.dy, base + 3 * bytes);
    std::vector<uint8_t> gamma(b.hidden * elem), dgamma_apart(gamma.size()),
        dgamma_over(gamma.size());
    put(b.gamma, gamma.data());
    ASSERT_TRUE(client->RegisterSharedMemory(*region).ok());
    RawBackwardArgs a;
    a.type = c.type;
    a.num_rows = b.rows;
    a.hidden_dim = b.hidden;
    a.x = {base, bytes};
    a.dy = {base + bytes, bytes};
    a.dx = {base + 2 * bytes, bytes};
    a.gamma = gamma;
    a.dgamma = absl::MakeSpan(dgamma_apart);
    a.gamma_offset = c.offset;
    a.casting_mode = c.casting;
    absl::StatusOr<RawBackwardResult> apart = client->BackwardRaw(a, {});
    ASSERT_TRUE(apart.ok()) << apart.status();
    a.dy = {base + 3 * bytes, bytes};
    a.dx = {base + 3 * bytes, bytes};
    a.dgamma = absl::MakeSpan(dgamma_over);
    absl::StatusOr<RawBackwardResult> refused = client->BackwardRaw(a, {});
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(refused.status().message(), HasSubstr("set in_place"));
    a.in_place = true;
    absl::StatusOr<RawBackwardResult> over = client->BackwardRaw(a, {});
    ASSERT_TRUE(over.ok()) << over.status();
    EXPECT_EQ(0, std::memcmp(base + 2 * bytes, base + 3 * bytes, bytes));
    EXPECT_EQ(dgamma_apart, dgamma_over);
    ASSERT_TRUE(client->UnregisterSharedMemory(*region).ok());
  }
}

// --in-place: x and dy in a region of the CLI's own, dx written over dy there; the same dx as
// without it, for a variant.
TEST_F(SharedMemoryTest, TheCliComputesInPlaceWithVariantFlags) {
  const Batch b(40, 64, /*seed=*/9);
  const std::string x = dir_ + "/x.npy", dy = dir_ + "/dy.npy", gamma = dir_ + "/g.npy";
  ASSERT_TRUE(npy::WriteF32(x, std::vector<uint64_t>{40, 64}, b.x).ok());
  ASSERT_TRUE(npy::WriteF32(dy, std::vector<uint64_t>{40, 64}, b.dy).ok());
  ASSERT_TRUE(npy::WriteF32(gamma, std::vector<uint64_t>{64}, b.gamma).ok());
  tools::CliEnvironment env;
  auto run = [&](std::vector<std::string> extra, const std::string& dx) {
    std::vector<std::string> args = {
        "backward",           "--target=unix:" + socket_, "--x", x, "--dy", dy, "--dx", dx,
        "--gamma-offset=0.5", "--casting-mode=none"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::ostringstream out, err;
    EXPECT_EQ(tools::RunCli(args, env, out, err), tools::kExitOk) << err.str();
    absl::StatusOr<npy::Array> got = npy::ReadF32(dx);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? got->data : std::vector<float>();
  };
  const std::vector<float> apart = run({"--gamma", gamma}, dir_ + "/dx_apart.npy");
  const std::vector<float> over = run({"--gamma", gamma, "--in-place"}, dir_ + "/dx_over.npy");
  ASSERT_EQ(apart.size(), b.x.size());
  EXPECT_EQ(apart, over);
  // Without gamma the scale is 1: different from gamma + 0.5, and it needs no gamma file.
  std::vector<std::string> args = {
      "backward", "--target=unix:" + socket_, "--x",        x,           "--dy", dy,
      "--dx",     dir_ + "/dx_nogamma.npy",   "--no-gamma", "--in-place"};
  std::ostringstream out, err;
  ASSERT_EQ(tools::RunCli(args, env, out, err), tools::kExitOk) << err.str();
  absl::StatusOr<npy::Array> no_gamma = npy::ReadF32(dir_ + "/dx_nogamma.npy");
  ASSERT_TRUE(no_gamma.ok());
  EXPECT_NE(no_gamma->data, apart);
  // --in-place over TCP: the region cannot be registered.
  std::vector<std::string> tcp = {"backward",  absl::StrCat("--target=127.0.0.1:", server_->port()),
                                  "--x",       x,
                                  "--dy",      dy,
                                  "--gamma",   gamma,
                                  "--in-place"};
  std::ostringstream out2, err2;
  EXPECT_EQ(tools::RunCli(tcp, env, out2, err2), tools::kExitServerError);
  EXPECT_THAT(err2.str(), HasSubstr("--in-place: "));
}

TEST_F(SharedMemoryTest, OnlySealedMemfdsAreTakenSoNobodyCanTruncateAMappedRegion) {
  // A memfd without F_SEAL_SHRINK: refused (it could be truncated under the server: SIGBUS).
  const int unsealed = memfd_create("unsealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(unsealed, 4096), 0);
  absl::StatusOr<server::RegionGrant> g =
      server_->regions()->Register(server::OwnedFd(unsealed), {});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(g.status().message(), HasSubstr("F_SEAL_SHRINK"));
  // A plain file: not a memfd.
  const std::string path = dir_ + "/file";
  const int file = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  ASSERT_EQ(ftruncate(file, 4096), 0);
  g = server_->regions()->Register(server::OwnedFd(file), {});
  EXPECT_THAT(g.status().message(), HasSubstr("not a memfd"));
  // A sealed region cannot be shrunk, even by its owner, while the server computes in it.
  auto region = *SharedMemoryRegion::Create(1 << 20);
  RegisterDirect(*server_, *region);
  EXPECT_NE(ftruncate(region->fd(), 0), 0);
  EXPECT_EQ(errno, EPERM);
  EXPECT_EQ(server_->regions()->Stats().refused, 2u);
}

// Pages are charged to the memory cgroup of the process that allocates them. The library
// allocates every page of its regions; the server takes no region with a page unallocated and
// computes no chunk after a page was given back (a hole punched), so a client's untouched pages
// never become the server's memory: st_blocks, the memfd's allocated pages, is the proof.
TEST_F(SharedMemoryTest, TheServerNeverAllocatesAClientsPages) {
  auto blocks = [](int fd) {
    struct stat st;
    EXPECT_EQ(fstat(fd, &st), 0);
    return static_cast<uint64_t>(st.st_blocks) * 512;
  };
  // The library's regions are allocated whole before anyone maps them.
  auto region = *SharedMemoryRegion::Create(1 << 20);
  EXPECT_GE(blocks(region->fd()), uint64_t{1} << 20);

  // A sparse memfd (ftruncate only) is refused at registration.
  const int sparse = memfd_create("sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(sparse, 1 << 20), 0);
  ASSERT_EQ(fcntl(sparse, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  absl::StatusOr<server::RegionGrant> g =
      server_->regions()->Register(server::OwnedFd(sparse), {.connection = 999});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
  EXPECT_THAT(g.status().message(), HasSubstr("0 of the region's 1048576 bytes are allocated"));

  // Half its pages missing inside, and as many allocated past the end (FALLOC_FL_KEEP_SIZE,
  // which F_SEAL_GROW does not stop): st_blocks covers the size, and the region is still
  // refused (the pages past the end are given back: no part of the region).
  const int padded = memfd_create("padded", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_EQ(ftruncate(padded, 1 << 20), 0);
  ASSERT_EQ(fallocate(padded, 0, 0, 512 << 10), 0);
  ASSERT_EQ(fallocate(padded, FALLOC_FL_KEEP_SIZE, 1 << 20, 512 << 10), 0);
  ASSERT_EQ(fcntl(padded, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW), 0);
  ASSERT_GE(blocks(padded), uint64_t{1} << 20);
  g = server_->regions()->Register(server::OwnedFd(dup(padded)), {.connection = 999});
  EXPECT_EQ(g.status().code(), absl::StatusCode::kFailedPrecondition) << g.status();
  EXPECT_THAT(g.status().message(), HasSubstr("524288 of the region's 1048576 bytes are allocated"));
  EXPECT_EQ(blocks(padded), uint64_t{512} << 10);
  close(padded);

  // A registered region whose grad_input pages were given back after registration: the chunk is
  // refused and the pages stay unallocated (the server wrote nothing there).
  const server::RegionGrant grant = RegisterDirect(*server_, *region);
  const uint64_t dx_at = 512 << 10;
  ASSERT_EQ(fallocate(region->fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                      static_cast<off_t>(dx_at), 256 << 10),
            0);
  const uint64_t allocated = blocks(region->fd());
  ASSERT_LT(allocated, uint64_t{1} << 20);
  v1::BackwardRequest m;
  v1::SharedMemoryChunk* c = m.mutable_shm();
  c->set_region_id(grant.id);
  c->set_region_key(reinterpret_cast<const char*>(grant.key.data()), grant.key.size());
  c->set_num_rows(2);
  c->set_x_offset(0);
  c->set_dy_offset(4096);
  c->set_grad_input_offset(dx_at);
  auto stub = UnixStub();
  const grpc::Status st = Send(*stub, {Header(2, 64), m});
  EXPECT_EQ(st.error_code(), grpc::FAILED_PRECONDITION) << st.error_message();
  EXPECT_THAT(st.error_message(), HasSubstr("bytes are allocated"));
  EXPECT_EQ(blocks(region->fd()), allocated);
}

TEST_F(SharedMemoryTest, RegionsGoWhenTheirClientGoesAndLimitsHold) {
  {
    auto client = Connect();
    auto huge = *SharedMemoryRegion::Create(300ull << 20);  // allocated, never touched
    EXPECT_THAT(client->RegisterSharedMemory(*huge).message(),
                HasSubstr("exceeds --shared-memory-max-bytes=268435456"));
    std::vector<std::unique_ptr<SharedMemoryRegion>> regions;
    for (int i = 0; i < 8; ++i) {
      regions.push_back(*SharedMemoryRegion::Create(4096));
      ASSERT_TRUE(client->RegisterSharedMemory(*regions.back()).ok()) << i;
    }
    auto ninth = *SharedMemoryRegion::Create(4096);
    const absl::Status s = client->RegisterSharedMemory(*ninth);
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
    EXPECT_THAT(s.message(), HasSubstr("--shared-memory-max-regions=8"));
    EXPECT_EQ(server_->regions()->Stats().regions, 8u);
  }
  // The client is gone: its region connection closed, the server released its regions.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (server_->regions()->Stats().regions != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_->regions()->Stats().regions, 0u);
  EXPECT_EQ(server_->regions()->Stats().bytes, 0u);
}

TEST_F(SharedMemoryTest, GarbageOnTheRegionSocketGetsAnErrorAndHarmsNobody) {
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const std::string path = socket_ + ".shm";
  std::memcpy(addr.sun_path, path.data(), path.size());
  ASSERT_EQ(connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)), 0);
  auto reply_to = [&](const std::string& bytes) {
    EXPECT_EQ(send(fd, bytes.data(), bytes.size(), 0), static_cast<ssize_t>(bytes.size()));
    char buffer[4096];
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    v1::RegionReply reply;
    EXPECT_TRUE(n > 0 && reply.ParseFromArray(buffer, static_cast<int>(n)));
    return reply;
  };
  v1::RegionReply r = reply_to("\xff\xff\xff garbage");
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kInvalidArgument));
  v1::RegionRequest no_fd;
  no_fd.set_register_region(true);
  r = reply_to(no_fd.SerializeAsString());
  EXPECT_THAT(r.message(), HasSubstr("exactly one file descriptor"));
  v1::RegionRequest release;
  release.set_release_region_id(12345);
  r = reply_to(release.SerializeAsString());
  EXPECT_EQ(r.code(), static_cast<int>(absl::StatusCode::kNotFound));
  close(fd);
  // The server still serves a shared-memory call.
  const Batch b(10, 32, /*seed=*/7);
  absl::StatusOr<Gradients> g = Connect(Transport::kSharedMemory)->Backward(b.x, b.dy, b.gamma, 1e-5f);
  ASSERT_TRUE(g.ok()) << g.status();
  ExpectGradientsClose(g->dx, g->dgamma, b);
}

TEST_F(SharedMemoryTest, TheLoadGeneratorAndCliTakeTransportShm) {
  const double before = ReceivedBytes(0);
  std::ostringstream out, err;
  ASSERT_EQ(tools::RunLoad({"--target=unix:" + socket_, "--transport=shm", "--total=20",
                            "--concurrency=4", "--shapes=16x256", "--format=json"},
                           "", false, out, err),
            0)
      << err.str();
  EXPECT_THAT(out.str(), HasSubstr("\"transport\":\"shm\""));
  EXPECT_THAT(out.str(), HasSubstr("\"successes\":20"));
  // 20 calls of 16 x 256 f32 x and dy would be 640 KiB as bytes; only gammas crossed.
  EXPECT_LT(ReceivedBytes(20) - before, 20 * 2048.0);
  std::ostringstream cout, cerr;
  tools::CliEnvironment env;
  EXPECT_EQ(tools::RunCli({"info", "--target=unix:" + socket_, "--transport=sideways"}, env, cout,
                          cerr),
            tools::kExitUsage);
  EXPECT_THAT(cerr.str(), HasSubstr("--transport: \"sideways\" is not auto, bytes or shm"));
}

TEST(SharedMemoryOptionsTest, SharedMemoryNeedsAUnixListener) {
  server::ServerOptions o;
  o.metrics_listen = "";
  o.listen = {"127.0.0.1:0"};
  o.shared_memory = true;
  EXPECT_THAT(server::CheckServerOptions(o).message(), HasSubstr("needs a --listen=unix:/PATH"));
}

}  // namespace
}  // namespace normgrad
