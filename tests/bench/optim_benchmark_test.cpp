// The memory claim of in-backward mode, measured with the allocation tracker on a small stack:
// gradients live at once never exceed what one backward node hands over, and the step's peak
// respects peak_standard - grad_bytes + activation_bytes + largest_grad_bytes (within 1%).
#include <gtest/gtest.h>

#include "frugal/bench/optim_benchmark.h"

TEST(OptimInBackward, GradientMemoryFallsToOneNodesWorth) {
  for (const char* policy : {"none", "full"}) {
    SCOPED_TRACE(policy);
    frugal::bench::OptimInBackwardConfig c;
    c.layers = 4;
    c.width = 64;
    c.heads = 4;
    c.batch = 1;
    c.seq = 16;
    c.policy = policy;
    c.timing_runs = 0;
    const auto r = frugal::bench::run_optim_in_backward_benchmark(c);
    EXPECT_EQ(r.max_live_grad_bytes_standard, r.grad_bytes);  // all gradients exist together
    EXPECT_GT(r.max_live_grad_bytes_in_backward, 0);
    EXPECT_LE(r.max_live_grad_bytes_in_backward, r.largest_grad_bytes);
    EXPECT_LE(static_cast<double>(r.peak_bytes_in_backward), 1.01 * static_cast<double>(r.bound_bytes()))
        << "peak " << r.peak_bytes_in_backward << " bound " << r.bound_bytes();
    EXPECT_LT(r.peak_bytes_in_backward, r.peak_bytes_standard);
    EXPECT_EQ(r.state_bytes, 2 * r.param_bytes);
    EXPECT_LE(r.max_param_diff, 1e-6);
  }
}
