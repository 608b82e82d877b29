// Bounded LRU cache of compiled artefacts (CUDA modules, emitted PTX, cubins) keyed by a
// kernel's ConfigKey, with single-flight compilation: N concurrent first requests for one key
// run the compile function once and all get its result (or its error; errors are not cached).
//
//   ModuleCache<CompiledModule> cache({.max_entries = 256, .max_bytes = 256 << 20});
//   absl::StatusOr<std::shared_ptr<const CompiledModule>> m = cache.GetOrCompile(key, [&] {
//     return CompileIt();   // -> absl::StatusOr<ModuleCache<CompiledModule>::Compiled>
//   });
//
// Thread-safe. Evicted values stay alive while a caller holds their shared_ptr.
#ifndef NORMGRAD_SERVER_CACHE_MODULE_CACHE_H_
#define NORMGRAD_SERVER_CACHE_MODULE_CACHE_H_

#include <cstdint>

namespace normgrad::server {

struct ModuleCacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;
  uint64_t evictions = 0;
  uint64_t compiles = 0;        // compile functions actually run (successful or not)
  uint64_t compile_failures = 0;
  uint64_t entries = 0;
  uint64_t bytes = 0;
  double compile_seconds = 0;   // total time inside compile functions
  uint64_t max_entries = 0;
  uint64_t max_bytes = 0;
};

struct ModuleCacheOptions {
  uint64_t max_entries = 256;
  uint64_t max_bytes = 256ull << 20;
};

// template <typename T> class ModuleCache { ... } is defined below by its implementer.

}  // namespace normgrad::server

#endif  // NORMGRAD_SERVER_CACHE_MODULE_CACHE_H_
