// Fuzzes the server's --preload list (comma-separated KERNEL:TARGET[:HIDDEN_DIM] entries, the
// one configuration text normgrad-server parses itself; absl parses the other flags).
// Contract: each entry is a kernel whose CanImplement accepts its configuration, or
// INVALID_ARGUMENT naming the entry.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/str_split.h"
#include "server/process/normgrad_server.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  for (absl::string_view entry : absl::StrSplit(text, ',')) {
    absl::StatusOr<normgrad::server::PreloadEntry> parsed =
        normgrad::server::ParsePreloadEntry(entry);
    if (parsed.ok()) {
      if (parsed->kernel == nullptr || !parsed->kernel->CanImplement(parsed->config).ok()) {
        std::abort();
      }
    } else if (parsed.status().message().find("--preload entry") == absl::string_view::npos) {
      std::abort();
    }
  }
  return 0;
}
