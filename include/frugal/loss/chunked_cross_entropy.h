// frugal/loss/chunked_cross_entropy.h — cross-entropy over a final Linear without the full logits.
//
// A language model's last Linear (hidden -> vocabulary) makes a (tokens x vocabulary) logits
// tensor that can outweigh the rest of the activations; plain Linear + cross_entropy keeps it and
// its log-softmax for backward. Here tokens go through in chunks: forward keeps only one float per
// token (the log-sum-exp), backward recomputes each chunk's logits to form its gradient.
// linear_cross_entropy is the same loss in one piece: it keeps the fp32 logits (not a log-softmax
// beside them) and spares backward the product. On the CPU, both hand each block of logits to one
// fused kernel per pass (cross_entropy_rows.h); the matrix products are ATen's.
//
//   auto loss = frugal::loss::chunked_cross_entropy(hidden, head->weight, head->bias, targets,
//       frugal::loss::ChunkedCrossEntropyOptions().chunk_size(1024).ignore_index(-100));
//   auto plain = frugal::loss::linear_cross_entropy(hidden, head->weight, head->bias, targets);
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <optional>

namespace frugal {
namespace loss {

enum class Reduction { mean, sum };

// How chunked_cross_entropy splits the tokens, which targets it ignores, and how it reduces.
struct ChunkedCrossEntropyOptions {
  TORCH_ARG(int64_t, chunk_size) = 1024;              // tokens per chunk
  TORCH_ARG(int64_t, ignore_index) = -100;            // targets equal to it add nothing and are not counted
  TORCH_ARG(Reduction, reduction) = Reduction::mean;  // mean over the counted tokens, or their sum
};

// hidden: (N, H) or (B, T, H); weight: (V, H); bias: (V) or undefined; targets: (N) or (B, T) int64
// -> scalar loss (fp32). Equals cross_entropy(linear(hidden, weight, bias), targets) and its gradients.
// Under autocast (checkpoint/autocast.h) with an fp32 weight, the products run in autocast's dtype
// and the softmax, log-sum-exp and loss in fp32; forward fixes that dtype, and backward uses it
// whatever autocast state backward() is called under.
at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                                 const ChunkedCrossEntropyOptions& options = {});

// The same loss and gradients without chunks (options' chunk_size is not used): forward makes the
// (N, V) logits in fp32 and keeps them, and backward forms their gradient from them in a buffer of
// the same size, without the product again. Backward leaves what it keeps unchanged, so a graph
// can be run backward again (retain_graph).
at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                                const ChunkedCrossEntropyOptions& options = {});

// What chunked_cross_entropy allocates, in bytes, for N tokens of hidden size H over V classes with a
// `dtype` weight, products in `compute_dtype` (default: the weight's; autocast's for an fp32 weight
// under autocast) and hidden states in the compute dtype (the estimate adds these up; tests check
// them against the tracker). The figures are the CPU's; elsewhere ATen's log-sum-exp adds a chunk's
// fp32 temporary to forward.
struct ChunkedCrossEntropyBytes {
  int64_t kept = 0;                // for backward: one fp32 log-sum-exp per token (and the kept logits)
  int64_t forward_temporary = 0;   // at forward's peak: one chunk's fp32 logits (and the product's)
  int64_t backward_temporary = 0;  // at backward's peak: a chunk's gradient, the hidden-state gradient
  int64_t weight_gradient = 0;     // the weight's gradient: summed in fp32 over several chunks, or made
                                   // in the weight's dtype from one
};
ChunkedCrossEntropyBytes chunked_cross_entropy_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_size, at::ScalarType dtype,
                                                     std::optional<at::ScalarType> compute_dtype = std::nullopt);
// The same for linear_cross_entropy.
ChunkedCrossEntropyBytes linear_cross_entropy_bytes(int64_t N, int64_t H, int64_t V, at::ScalarType dtype,
                                                    std::optional<at::ScalarType> compute_dtype = std::nullopt);

}  // namespace loss
}  // namespace frugal
