#include "frugal/memory/process.h"

#include <sys/resource.h>

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

}  // namespace memory
}  // namespace frugal
