// Fuzzes the client's argument validation (client/src/raw_args.*) with hostile counts and buffer
// sizes: the counts come whole from the input (any 64-bit num_rows, any 32-bit hidden_dim), the
// buffers are small and of the sizes the input says.
//
// Contract checked beyond "no crash": when ValidateRaw accepts, every buffer holds exactly the
// bytes the counts imply computed in 128-bit arithmetic (no wrapped product is ever accepted), and
// a refusal is INVALID_ARGUMENT.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "client/src/raw_args.h"

namespace {

template <typename T>
T Take(const uint8_t*& data, size_t& size) {
  T v{};
  const size_t n = size < sizeof(T) ? size : sizeof(T);
  std::memcpy(&v, data, n);
  data += n;
  size -= n;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using normgrad::ElementType;
  const uint8_t type = Take<uint8_t>(data, size) % 3;
  const uint64_t num_rows = Take<uint64_t>(data, size);
  const uint32_t hidden_dim = Take<uint32_t>(data, size);
  const bool with_rms = (Take<uint8_t>(data, size) & 1) != 0;
  // Buffer sizes up to 64 KiB each, from the input: x, dy, gamma, rms, dx, dgamma.
  size_t sizes[6];
  for (size_t& s : sizes) s = Take<uint16_t>(data, size);
  std::vector<uint8_t> buffers[6];
  for (int i = 0; i < 6; ++i) buffers[i].resize(sizes[i]);

  normgrad::RawBackwardArgs a;
  a.type = type == 0 ? ElementType::kF32 : type == 1 ? ElementType::kBF16 : ElementType::kF16;
  a.num_rows = num_rows;
  a.hidden_dim = hidden_dim;
  a.x = buffers[0];
  a.dy = buffers[1];
  a.gamma = buffers[2];
  if (with_rms) a.rms = buffers[3];
  a.dx = absl::MakeSpan(buffers[4]);
  a.dgamma = absl::MakeSpan(buffers[5]);
  const absl::Status s = normgrad::client_internal::ValidateRaw(a);
  if (!s.ok()) {
    if (s.code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const unsigned __int128 elem = type == 0 ? 4 : 2;
  const unsigned __int128 tensor = static_cast<unsigned __int128>(num_rows) * hidden_dim * elem;
  const unsigned __int128 row = static_cast<unsigned __int128>(hidden_dim) * elem;
  if (a.x.size() != tensor || a.dy.size() != tensor || a.dx.size() != tensor) std::abort();
  if (a.gamma.size() != row || a.dgamma.size() != row) std::abort();
  if (with_rms && !a.rms.empty() && a.rms.size() != static_cast<unsigned __int128>(num_rows) * 4) {
    std::abort();
  }
  return 0;
}
