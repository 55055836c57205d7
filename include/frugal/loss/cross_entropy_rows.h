// frugal/loss/cross_entropy_rows.h — the cross-entropy's arithmetic on rows of fp32 logits (CPU).
//
// The loss (chunked_cross_entropy.h) makes a block of logits with a matrix product and hands it to
// these. Forward reads each row twice, for its maximum and then for the sum of exponentials, and
// gives the row's log-sum-exp and loss; backward turns a row into the loss's gradient, in place or
// into another buffer, in one pass. Rows are shared among threads with at::parallel_for; within a row the work is
// vectorised: AVX-512 or AVX2 chosen at run time, else portable code.
//
//   std::vector<float> lse(n);
//   double sum = frugal::loss::cross_entropy_rows_forward(logits, n, V, V, targets, -100, lse.data());
//   frugal::loss::cross_entropy_rows_backward(logits, logits, n, V, V, targets, -100, lse.data(), 1.0f / n);
#pragma once

#include <cstdint>

namespace frugal {
namespace loss {

// automatic: the widest of avx512 and avx2 that this processor runs, else portable; the
// environment variable FRUGAL_CPU_KERNELS=portable makes it portable. The three agree to a few
// units in the last place (their exponentials and the order of their sums differ).
enum class RowKernel { automatic, portable, avx2, avx512 };
bool row_kernel_available(RowKernel kernel);     // automatic and portable always are
RowKernel resolve_row_kernel(RowKernel kernel);  // the one automatic stands for; others as given

// logits: n rows of V values, row r at logits + r * stride; targets: n class indices in [0, V), or
// ignore_index for a row that adds nothing. Writes each row's log-sum-exp to lse[r] (0 for an
// ignored row) and returns the sum over the other rows of lse[r] - logits[r][targets[r]], in double.
double cross_entropy_rows_forward(const float* logits, int64_t n, int64_t V, int64_t stride, const int64_t* targets, int64_t ignore_index,
                                  float* lse, RowKernel kernel = RowKernel::automatic);

// From the forward's lse: row r of grad becomes (softmax(row r of logits) - onehot(targets[r])) *
// scale, or zeros where targets[r] is ignore_index. grad has the logits' layout; it may be logits
// itself (in place).
void cross_entropy_rows_backward(const float* logits, float* grad, int64_t n, int64_t V, int64_t stride, const int64_t* targets,
                                 int64_t ignore_index, const float* lse, float scale, RowKernel kernel = RowKernel::automatic);

}  // namespace loss
}  // namespace frugal
