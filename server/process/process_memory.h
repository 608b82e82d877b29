// The server process's own memory, for the metrics endpoint and the soak test:
//
//   ProcessMemory m = ReadProcessMemory();
//   m.resident_bytes    // pages in RAM (/proc/self/statm), what the kernel and the OOM killer see
//   m.heap_in_use_bytes // bytes malloc has handed out and not had back (glibc mallinfo2)
//   m.heap_free_bytes   // bytes malloc holds but has not handed out (its free lists, arena tops)
//
// A leak grows heap_in_use; the allocator keeping freed memory for reuse grows resident but not
// heap_in_use. Fields the platform cannot tell are 0 (heap fields under sanitizers, which
// replace malloc, or outside glibc).
#pragma once

#include <cstdint>

namespace normgrad::server {

struct ProcessMemory {
  uint64_t resident_bytes = 0;
  uint64_t heap_in_use_bytes = 0;
  uint64_t heap_free_bytes = 0;
};

ProcessMemory ReadProcessMemory();

}  // namespace normgrad::server
