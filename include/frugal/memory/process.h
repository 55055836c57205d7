// frugal/memory/process.h — this process's memory as the kernel counts it.
//
// The tracker sees tensor allocations; the kernel sees everything: code, libraries, the C++ heap,
// oneDNN and OpenMP scratch, mapped files. Comparing the two says what the tracker cannot see.
//
//   auto m = frugal::memory::process_memory();   // from /proc/self/status
//   int64_t untracked = m.anon - tracker->live_bytes();
#pragma once

#include <cstdint>

namespace frugal {
namespace memory {

// In bytes; 0 where the kernel does not say (not Linux).
struct ProcessMemory {
  int64_t peak_rss = 0;  // VmHWM: the resident high-water mark
  int64_t rss = 0;       // VmRSS now
  int64_t anon = 0;      // RssAnon: heap and anonymous mappings (LibTorch's CPU allocations among them)
  int64_t file = 0;      // RssFile: resident pages of mapped files (code, libraries, mapped state, token files)
};
ProcessMemory process_memory();
// Page faults so far that had to read from disk (getrusage's ru_majflt): mapped optimizer state
// paged back in, among others.
int64_t major_page_faults();

}  // namespace memory
}  // namespace frugal
