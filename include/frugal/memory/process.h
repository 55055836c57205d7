// frugal/memory/process.h — this process's memory as the kernel counts it.
//
// The tracker sees tensor allocations; the kernel sees everything: code, libraries, the C++ heap,
// oneDNN and OpenMP scratch, mapped files. Comparing the two says what the tracker cannot see.
//
//   auto m = frugal::memory::process_memory();   // from /proc/self/status
//   int64_t untracked = m.anon - tracker->live_bytes();
#pragma once

#include <cstdint>
#include <string>

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
// Page faults so far served without reading from disk (ru_minflt): among them each first touch of
// a page the heap newly took from the kernel, which the kernel zeroes.
int64_t minor_page_faults();

// Makes glibc's heap keep what a training step frees for the next step, instead of handing it back
// to the kernel and faulting it in (zeroed) again. A step frees and takes back the same gradient
// and activation bytes every time; by default glibc returns the top of its heap once more than
// twice its mmap threshold (at most 64 MiB) lies free there, and serves blocks above that threshold
// from fresh mappings, so a standard-mode step that frees 144 MiB of gradients at once refaults
// all of them in the next backward. After this call blocks under 32 MiB come from the heap (larger
// ones, a 7B model's weight matrices, are still mapped and unmapped on their own) and up to
// `keep_bytes` of free heap top stays mapped. The resident high-water mark does not grow in a loop
// that reaches the same peak every step: the kept pages are the ones that peak takes back.
// Process-wide, so a program calls it once at the start (frugal's CLI does). Leaves glibc as it is
// and says so in `why` when the environment already sets its thresholds (MALLOC_TRIM_THRESHOLD_,
// MALLOC_MMAP_THRESHOLD_, or glibc.malloc tunables in GLIBC_TUNABLES), or when the C library is not
// glibc. Returns whether it changed the settings.
bool keep_freed_heap(int64_t keep_bytes = int64_t{256} << 20, std::string* why = nullptr);

// Hands the C library's free heap pages back to the kernel, wherever they lie in the heap (glibc's
// malloc_trim; elsewhere nothing): for after a one-off phase that freed much more than a step takes
// back, such as loading a checkpoint, whose freed buffers would otherwise stay resident for the
// whole run. Returns whether anything was released.
bool release_freed_heap();

}  // namespace memory
}  // namespace frugal
