#include "server/process/process_memory.h"

#include <unistd.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <fstream>

// Sanitizers replace malloc, so glibc's counters would describe only what bypasses them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define NORMGRAD_MALLOC_REPLACED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define NORMGRAD_MALLOC_REPLACED 1
#endif
#endif

namespace normgrad::server {

ProcessMemory ReadProcessMemory() {
  ProcessMemory m;
  std::ifstream statm("/proc/self/statm");
  uint64_t size_pages = 0, resident_pages = 0;
  if (statm >> size_pages >> resident_pages) {
    m.resident_bytes = resident_pages * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33)) && \
    !defined(NORMGRAD_MALLOC_REPLACED)
  // Sums every arena: chunks in use plus blocks malloc mmapped for large requests.
  const struct mallinfo2 info = mallinfo2();
  m.heap_in_use_bytes = info.uordblks + info.hblkhd;
  m.heap_free_bytes = info.fordblks;
#endif
  return m;
}

}  // namespace normgrad::server
