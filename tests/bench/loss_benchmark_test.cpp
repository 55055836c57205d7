// The chunked loss's memory claim on a small case: its peak is a fraction of the plain one's, and
// the gradients agree. And the slow-BLAS warning's rule.
#include <gtest/gtest.h>

#include <unistd.h>

#include "frugal/bench/hardware.h"
#include "frugal/bench/loss_benchmark.h"

namespace bench = frugal::bench;

TEST(ChunkedLossBenchmark, PeakIsAFractionOfThePlainOne) {
  frugal::bench::ChunkedLossConfig cfg;
  cfg.tokens = 512;
  cfg.hidden = 32;
  cfg.vocab = 2000;
  cfg.chunk = 64;
  cfg.timing_runs = 0;
  const auto r = frugal::bench::run_chunked_loss_benchmark(cfg);
  // Plain keeps the (N, V) fp32 logits and makes their gradient beside them: >= 2 * N * V * 4.
  EXPECT_GE(r.peak_bytes_plain, 2 * 512 * 2000 * 4);
  // Chunked: a (chunk, V) buffer, the weight's gradient, the hidden states' gradient, a bit more.
  EXPECT_LT(r.peak_bytes_chunked, 0.25 * static_cast<double>(r.peak_bytes_plain));
  EXPECT_LE(r.max_rel_grad_diff, 1e-5);
  EXPECT_NEAR(r.loss_chunked, r.loss_plain, 1e-5 * r.loss_plain);
}

TEST(Hardware, SlowBlasWarningNamesTheReferenceLibraryOnly) {
  // Decided from the library loaded, not from a timing a busy machine skews.
  EXPECT_NE(bench::slow_blas_warning("/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0").find("reference BLAS"), std::string::npos);
  EXPECT_EQ(bench::slow_blas_warning("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"), "");
  EXPECT_EQ(bench::slow_blas_warning(""), "");
  // This process links LibTorch, which loads some BLAS from Debian's alternatives: a real file.
  const std::string loaded = bench::loaded_blas_library();
  if (!loaded.empty()) {
    EXPECT_EQ(::access(loaded.c_str(), R_OK), 0) << loaded;
  }
}
