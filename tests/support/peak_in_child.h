// tests/support/peak_in_child.h — how much a piece of work raises a process's peak resident memory,
// measured in a forked child so that nothing the test process already holds counts.
//
//   auto r = frugal::testing::peak_in_child<int64_t>([&] { return tokenize(...).tokens; });
//   EXPECT_TRUE(r.ok);  EXPECT_LT(r.rss_growth, 2 << 20);  use(r.value);
#pragma once

#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <type_traits>

namespace frugal {
namespace testing {

template <class R>
struct ChildPeak {
  R value{};               // what the work returned in the child
  int64_t rss_growth = 0;  // the child's peak RSS (VmHWM) after the work, less its RSS just before
  bool ok = false;         // the child ran the work without throwing and exited 0
};

// A /proc/self/status field in KiB ("VmRSS:", "VmHWM:"), -1 when absent.
inline long long status_kib(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key)));
  }
  return -1;
}

// Runs work() in a child process and returns its result (trivially copyable: it crosses a pipe)
// with the peak RSS growth. Before the work the child gives the parent's free heap pages back and
// maps large blocks afresh, so what it allocates shows in its RSS, and resets VmHWM to its RSS.
template <class R, class F>
ChildPeak<R> peak_in_child(F work) {
  static_assert(std::is_trivially_copyable<R>::value, "the result crosses a pipe");
  ChildPeak<R> out;
  int fds[2];
  EXPECT_EQ(::pipe(fds), 0);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::malloc_trim(0);
    ::mallopt(M_MMAP_THRESHOLD, 1 << 16);
    std::ofstream("/proc/self/clear_refs") << "5";  // resets VmHWM to the current RSS
    const long long before = status_kib("VmRSS:");
    ChildPeak<R> r;
    try {
      r.value = work();
    } catch (...) {
      ::_exit(4);
    }
    r.rss_growth = (status_kib("VmHWM:") - before) * 1024;
    r.ok = true;
    if (::write(fds[1], &r, sizeof(r)) != static_cast<ssize_t>(sizeof(r))) ::_exit(3);
    ::_exit(0);
  }
  ::close(fds[1]);
  const bool got = ::read(fds[0], &out, sizeof(out)) == static_cast<ssize_t>(sizeof(out));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  out.ok = got && out.ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  EXPECT_TRUE(out.ok) << "the child failed";
  return out;
}

}  // namespace testing
}  // namespace frugal
