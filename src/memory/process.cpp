#include "frugal/memory/process.h"

#include <sys/resource.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

namespace frugal {
namespace memory {
namespace {

// "VmHWM:\t 123456 kB" -> bytes
int64_t status_field(const std::string& text, const char* key) {
  const size_t at = text.find(key);
  if (at == std::string::npos) return 0;
  return std::strtoll(text.c_str() + at + std::strlen(key), nullptr, 10) * 1024;
}

}  // namespace

ProcessMemory process_memory() {
  std::ifstream in("/proc/self/status");
  std::stringstream text;
  text << in.rdbuf();
  const std::string s = text.str();
  ProcessMemory m;
  m.peak_rss = status_field(s, "VmHWM:");
  m.rss = status_field(s, "VmRSS:");
  m.anon = status_field(s, "RssAnon:");
  m.file = status_field(s, "RssFile:");
  return m;
}

int64_t major_page_faults() {
  struct rusage usage;
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_majflt);
}

int64_t minor_page_faults() {
  struct rusage usage;
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_minflt);
}

bool keep_freed_heap(int64_t keep_bytes, std::string* why) {
  auto say = [&](const std::string& text) {
    if (why) *why = text;
  };
#if defined(__GLIBC__)
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const bool user_tunables = tunables && (std::strstr(tunables, "malloc.trim_threshold") || std::strstr(tunables, "malloc.mmap_threshold"));
  if (std::getenv("MALLOC_TRIM_THRESHOLD_") || std::getenv("MALLOC_MMAP_THRESHOLD_") || user_tunables) {
    say("the environment sets glibc's heap thresholds; left as they are");
    return false;
  }
  constexpr int kMmapThreshold = 32 << 20;  // glibc's own ceiling for its moving threshold
  const int keep = static_cast<int>(std::min<int64_t>(std::max<int64_t>(keep_bytes, 0), int64_t{1} << 30));
  if (::mallopt(M_MMAP_THRESHOLD, kMmapThreshold) != 1 || ::mallopt(M_TRIM_THRESHOLD, keep) != 1) {
    say("glibc refused the heap thresholds");
    return false;
  }
  say("glibc keeps up to " + std::to_string(keep >> 20) + " MiB of freed heap; blocks from 32 MiB are mapped apart");
  return true;
#else
  (void)keep_bytes;
  say("the C library is not glibc; its heap is left as it is");
  return false;
#endif
}

bool release_freed_heap() {
#if defined(__GLIBC__)
  return ::malloc_trim(0) == 1;
#else
  return false;
#endif
}

}  // namespace memory
}  // namespace frugal
