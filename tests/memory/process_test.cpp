// The process's own memory settings: glibc keeps what a step frees for the next step.
#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "frugal/memory/process.h"
#include "../support/common.h"

using namespace frugal;
using frugal::testing::in_child;

namespace {

// What a standard-mode step does to the heap: takes 36 blocks of 4 MiB (gradients), writes them,
// frees them all at once. Returns the minor page faults it cost.
int64_t one_step_of_gradients() {
  const int64_t before = memory::minor_page_faults();
  std::vector<void*> blocks;
  for (int i = 0; i < 36; ++i) {
    void* p = std::malloc(size_t{4} << 20);
    if (!p) std::_Exit(3);
    std::memset(p, 1, size_t{4} << 20);
    blocks.push_back(p);
  }
  for (void* p : blocks) std::free(p);
  return memory::minor_page_faults() - before;
}

}  // namespace

#if defined(__GLIBC__)
TEST(Process, KeepFreedHeapStopsTheNextStepRefaultingWhatThisOneFreed) {
  // 144 MiB is 36864 pages: glibc's defaults hand them back and the next step faults them all in.
  const int status = in_child([] {
    // glibc's thresholds as a fresh process starts with them (128 KiB), set here because a fork
    // inherits what earlier tests' frees made of them (glibc raises them as mapped blocks are freed).
    ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    ::mallopt(M_TRIM_THRESHOLD, 128 * 1024);
    one_step_of_gradients();
    const int64_t plain = one_step_of_gradients();
    std::string why;
    if (!memory::keep_freed_heap(int64_t{256} << 20, &why)) return 4;
    one_step_of_gradients();  // the heap grows to the step's size once
    const int64_t kept = one_step_of_gradients();
    std::fprintf(stderr, "minor faults of a step: %lld with glibc's defaults, %lld after keep_freed_heap (%s)\n",
                 static_cast<long long>(plain), static_cast<long long>(kept), why.c_str());
    if (plain < 30000) return 5;        // the defaults did refault (most of 36864 pages)
    return kept * 100 < plain ? 0 : 6;  // kept: under 1% of that
  });
  EXPECT_EQ(status, 0) << "4: refused, 5: glibc's defaults kept the pages already, 6: the next step still faulted";
}

TEST(Process, KeepFreedHeapLeavesTheEnvironmentsOwnSettings) {
  const int status = in_child([] {
    ::setenv("MALLOC_TRIM_THRESHOLD_", "131072", 1);
    std::string why;
    if (memory::keep_freed_heap(int64_t{256} << 20, &why)) return 1;
    return why.find("environment") != std::string::npos ? 0 : 2;
  });
  EXPECT_EQ(status, 0);
}

// What loading a checkpoint leaves: 256 MiB of heap blocks freed below one block still in use, so
// the heap's top cannot be trimmed and keep_freed_heap's threshold would keep them resident; after
// release_freed_heap the process holds them no more.
TEST(Process, ReleaseFreedHeapHandsBackWhatALoaderFreedBelowLiveBlocks) {
  const int status = in_child([] {
    std::string why;
    if (!memory::keep_freed_heap(int64_t{1} << 30, &why)) return 4;
    std::vector<void*> blocks;
    for (int i = 0; i < 64; ++i) {
      void* p = std::malloc(size_t{4} << 20);
      if (!p) return 3;
      std::memset(p, 1, size_t{4} << 20);
      blocks.push_back(p);
    }
    void* live = std::malloc(4096);  // above them all: the top stays in use
    if (!live) return 3;
    for (void* p : blocks) std::free(p);
    const int64_t freed = memory::process_memory().rss;
    memory::release_freed_heap();
    const int64_t released = memory::process_memory().rss;
    std::free(live);
    std::fprintf(stderr, "resident %lld MiB after the frees, %lld MiB after release_freed_heap\n", static_cast<long long>(freed >> 20),
                 static_cast<long long>(released >> 20));
    if (freed <= 0) return 5;
    return freed - released >= (int64_t{240} << 20) ? 0 : 6;  // nearly all of the 256 MiB
  });
  EXPECT_EQ(status, 0) << "4: keep_freed_heap refused, 5: no resident figure, 6: the freed blocks stayed resident";
}
#endif
