// Writes seed inputs for backward_sequence_fuzzer (the format its header describes) into the
// folder given as argv[1]: valid streams of each dtype, with and without rms, plus a few
// classic mistakes, so fuzzing starts past the header checks.
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "normgrad/v1/normgrad.pb.h"

namespace {

using normgrad::v1::BackwardRequest;

std::string Encode(uint8_t limits, const std::vector<BackwardRequest>& messages) {
  std::string out(1, static_cast<char>(limits));
  for (const BackwardRequest& m : messages) {
    const std::string bytes = m.SerializeAsString();
    out.push_back(static_cast<char>(bytes.size() & 0xff));
    out.push_back(static_cast<char>((bytes.size() >> 8) & 0xff));
    out += bytes;
  }
  return out;
}

BackwardRequest Header(uint64_t rows, uint32_t hidden, normgrad::v1::DType dtype, bool rms,
                       const std::string& kernel) {
  const size_t element = dtype == normgrad::v1::DTYPE_BF16 || dtype == normgrad::v1::DTYPE_F16 ? 2 : 4;
  BackwardRequest m;
  m.mutable_header()->set_num_rows(rows);
  m.mutable_header()->set_hidden_dim(hidden);
  m.mutable_header()->set_eps(1e-5f);
  m.mutable_header()->set_dtype(dtype);
  m.mutable_header()->set_gamma(std::string(hidden * element, '\x01'));
  m.mutable_header()->set_rms_provided(rms);
  if (!kernel.empty()) m.mutable_header()->mutable_options()->set_kernel(kernel);
  return m;
}

BackwardRequest Chunk(uint64_t rows, uint32_t hidden, size_t element, bool rms) {
  BackwardRequest m;
  m.set_x(std::string(rows * hidden * element, '\x02'));
  m.set_dy(std::string(rows * hidden * element, '\x03'));
  if (rms) m.set_rms(std::string(rows * 4, '\x04'));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_seed_writer DIR\n");
    return 2;
  }
  std::vector<std::pair<std::string, std::string>> seeds;
  using normgrad::v1::DTYPE_BF16;
  using normgrad::v1::DTYPE_F16;
  using normgrad::v1::DTYPE_F32;
  seeds.push_back({"f32_two_chunks", Encode(0, {Header(3, 8, DTYPE_F32, false, ""),
                                                Chunk(2, 8, 4, false), Chunk(1, 8, 4, false)})});
  seeds.push_back({"f32_rms", Encode(0, {Header(2, 4, DTYPE_F32, true, ""), Chunk(1, 4, 4, true),
                                         Chunk(1, 4, 4, true)})});
  seeds.push_back({"bf16_kernel", Encode(0, {Header(2, 16, DTYPE_BF16, false,
                                                    "batched_rms_norm_backward"),
                                             Chunk(2, 16, 2, false)})});
  seeds.push_back({"f16_small_limits", Encode(3, {Header(4, 8, DTYPE_F16, false, ""),
                                                  Chunk(4, 8, 2, false)})});
  seeds.push_back({"chunk_first", Encode(0, {Chunk(1, 4, 4, false)})});
  seeds.push_back({"header_twice", Encode(0, {Header(1, 4, DTYPE_F32, false, ""),
                                              Header(1, 4, DTYPE_F32, false, "")})});
  seeds.push_back({"too_many_rows", Encode(0, {Header(1, 4, DTYPE_F32, false, ""),
                                               Chunk(2, 4, 4, false)})});
  seeds.push_back({"missing_rows", Encode(0, {Header(5, 4, DTYPE_F32, false, ""),
                                              Chunk(2, 4, 4, false)})});
  seeds.push_back({"over_limits", Encode(3, {Header(100, 128, DTYPE_F32, false, "")})});
  for (const auto& [name, bytes] : seeds) {
    std::ofstream out(absl::StrCat(argv[1], "/", name), std::ios::binary);
    out << bytes;
    if (!out) {
      std::fprintf(stderr, "fuzz_seed_writer: cannot write %s/%s\n", argv[1], name.c_str());
      return 1;
    }
  }
  return 0;
}
