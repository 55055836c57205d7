#include "frugal/models/activation_bytes.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>

#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace models {
namespace {

// A size that refuses to pass kMaxSizeBytes: configs come from recipes and flags, and a wrapped
// product (vocab_size 2^63-1) would print as a small or negative count.
struct Size {
  int64_t v;
  Size(int64_t x) : v(x) { check(); }  // NOLINT: implicit, so formulas read as plain arithmetic
  void check() const {
    if (v > kMaxSizeBytes || v < -kMaxSizeBytes) throw std::overflow_error("a size passes 2^56");
  }
};
Size operator*(Size a, Size b) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a.v, b.v, &out)) throw std::overflow_error("a size passes 2^56");
  return Size(out);
}
Size operator+(Size a, Size b) {
  int64_t out = 0;
  if (__builtin_add_overflow(a.v, b.v, &out)) throw std::overflow_error("a size passes 2^56");
  return Size(out);
}
Size operator/(Size a, Size b) { return Size(a.v / b.v); }
bool operator<(Size a, Size b) { return a.v < b.v; }

}  // namespace

DecoderActivationBytes decoder_activation_bytes(const DecoderConfig& c, int64_t batch, int64_t seq, at::ScalarType dtype,
                                                const LossOptions& loss, std::optional<at::ScalarType> compute_dtype) {
  const Size e = static_cast<int64_t>(c10::elementSize(dtype));
  const at::ScalarType compute = compute_dtype.value_or(dtype);
  // Under autocast (compute differs from the parameters' dtype) the tensors the products read and
  // make are in the compute dtype: ce per element; the residual stream and the norms' inputs stay in e.
  const Size ce = static_cast<int64_t>(c10::elementSize(compute));
  const bool autocast = compute != dtype;
  const Size B = batch, T = seq, BT = B * T, d = c.dim, f = c.ffn_dim, H = c.n_heads, V = c.vocab_size;
  const Size kv = Size(c.n_kv_heads) * c.head_dim(), qd = Size(c.n_heads) * c.head_dim();  // qd = d unless head_dim is explicit
  const bool llama = c.arch == "llama";
  DecoderActivationBytes a;
  // Kept for backward by one block run plainly (the tensors decoder.cpp's blocks save):
  //   llama: x, norm1 out, q, k, v (as attention reads them), merged heads, x1, norm2 out   8 x (B,T,d)
  //          gate, up, silu(gate)*up (SwiGLU's Function keeps gate and up only)          3 x (B,T,f)
  //          a GELU Llama's autograd ops keep act(gate) too                              4 x (B,T,f)
  //          two 1/rms (fp32, one per token each), the rotary tables cos and sin (fp32 (T, hd)
  //          each) and the (B,H,T,T) probabilities
  //   gpt2:  the same 8 x (B,T,d), fc1 out and GELU out (2 x (B,T,f)), LayerNorm mean and rstd
  //          (two per token per norm, in the dtype) and the probabilities
  // With sdpa (attention.h) the probabilities become one fp32 log-sum-exp per query and head
  // (measured with the tracker on LibTorch 2.x's CPU flash kernel); q, k and v are kept as
  // attention reads them (the same tensors as above), and its output takes the query's (B, T, H, hd)
  // layout, so the merged heads are a view of it: the same 8 x (B,T,d).
  //
  // Under autocast: x and x1 (the residual stream) stay in e; the six (B,T,d) the products read or
  // make (norm outputs, which RMSNorm emits in the compute dtype and GPT-2's products cast once, q,
  // k, v, merged heads), the MLP's and the probabilities are in ce; and each product keeps its
  // weight's low-precision copy (the block's matrices and biases, in ce).
  const Size attention_kept = c.attention == AttentionKernel::sdpa ? B * H * T * 4 : B * H * T * T * ce;
  const Size rotary_tables = 2 * T * Size(c.head_dim()) * 4;
  // inner: the two norm outputs (d wide), q, k, v and the merged heads (qd wide: k and v repeated to H heads)
  const Size residual = 2 * d * e, inner = (2 * d + 4 * qd) * ce;
  const Size llama_biases = (c.attention_bias ? qd + 2 * kv + d : Size(0)) + (c.mlp_bias ? 2 * f + d : Size(0));
  const Size matrices = llama ? 2 * d * qd + 2 * d * kv + 3 * d * f + llama_biases : 4 * d * d + 2 * d * f + 5 * d + f;
  const Size weight_copies = autocast ? matrices * ce : Size(0);
  // act(gate) too for a GELU Llama (autograd's ops); SwiGLU's Function keeps gate and up only
  const bool swiglu_fn = c.resolved_activation() == "silu";
  const Size mlp_kept = swiglu_fn ? Size(3) : Size(4);
  a.block_plain = (llama ? BT * (residual + inner + mlp_kept * f * ce + 8) + rotary_tables + attention_kept + weight_copies
                         : BT * (residual + inner + 2 * f * ce + 4 * e) + attention_kept + weight_copies)
                      .v;
  a.block_input = (BT * d * e).v;
  // Selective keeps the input and the matrix products' outputs but the closing tail_linear's, which
  // its recompute does not multiply (selective.h): q, k, v, o, gate, up (llama); qkv, proj, fc (gpt2).
  a.block_selective = (a.block_input + (llama ? BT * (2 * d + qd + 2 * kv + 2 * f) * ce : BT * (5 * d + f) * ce)).v;
  // A checkpointed block's backward holds gradients of its intermediates worth a little under half a block's
  // activations at its peak (measured with the tracker in backward mode: 0.43 on the tiny recipe;
  // on the default one, where the last block of an activation plan stays whole, its recomputed
  // blocks' peak is below the whole block's, which 0.38 keeps so; trainer_test checks both, on
  // LibTorch 1.13 and 2.15), unless attention's backward holds more (measured on LibTorch 2.x, B 4, d 64,
  // fp32): explicit, the gradients of the probabilities and of the scores, 2 x (B,H,T,T), with the
  // output's gradient (exact at T 256 and 1024, where it is 0.94 and 1.55 of block_plain); sdpa, the
  // gradients of q, k, v and the output with one fp32 (B,T,d) of the kernel's accumulators (5 (B,T,d)
  // at T 1024; 4.25 at T 128).
  const Size attention_backward = c.attention == AttentionKernel::sdpa ? BT * d * (4 * ce + 4) : 2 * B * H * T * T * ce + BT * d * ce;
  // SwiGLU's backward holds its gradient in and two out (ce), beside the residual stream's
  // gradient, when silu(gate) * up is already freed: on small models (the tiny recipe) this, not
  // the fraction above, is the peak (estimate.cpp makes it a moment of its own). On the CPU it is
  // one fused pass; off it (CUDA, fp16) a slice of fp32 scratch comes on top, at most
  // kSwiGLUSliceElements x 10 bytes, which this leaves out.
  if (llama && swiglu_fn) {
    a.swiglu_backward_working_set = (3 * BT * f * ce + BT * d * e).v;
    a.swiglu_freed_before = (BT * f * ce).v;
  }
  a.peak_after_first_weight_gradient = !autocast || llama;
  // Llama with explicit attention 0.38; with sdpa and for GPT-2, 0.42 (their configurations in
  // trainer_test, on 1.13 and 2.15).
  const Size recomputed_percent = llama && c.attention == AttentionKernel::explicit_softmax ? 38 : 42;
  a.block_backward_working_set = std::max(Size(a.block_plain) * recomputed_percent / 100, attention_backward).v;
  // In fp32 a SwiGLU Llama's layers are fused (RMSNorm, rotary, SwiGLU: fused_ops.h) and its
  // products are MKL's, which takes no scratch from the allocator: with every activation live its
  // backward holds at most down_proj's input gradient and the residual stream's (exact on the tiny
  // and default recipes; SwiGLU's moment right after holds more), or attention's. bf16 products
  // take packing buffers of the backend's choosing (oneDNN: about a padded copy of an operand),
  // which the fraction above keeps covering.
  const bool exact_fp32 = llama && swiglu_fn && compute == at::kFloat;
  if (exact_fp32) {
    a.block_backward_working_set = (BT * f * ce + BT * d * e).v;
    // Attention's backward comes after the MLP's, which has freed gate, up and silu(gate) * up.
    a.attention_backward_working_set = attention_backward.v;
    a.attention_freed_before = (3 * BT * f * ce).v;
    a.attention_gradients_before = ((3 * d * f + d * qd + d + (c.mlp_bias ? 2 * f + d : Size(0)) + (c.attention_bias ? d : Size(0))) * e).v;
  }
  // A block run plainly (not recomputed in its backward) holds less: 0.334 of block_plain on the
  // tiny recipe (every_2's plain block), 0.318 on the default recipe's whole last block, on
  // LibTorch 1.13 and 2.15 alike.
  a.plain_block_backward_working_set = std::max(Size(a.block_plain) * 34 / 100, attention_backward).v;
  if (exact_fp32) a.plain_block_backward_working_set = a.block_backward_working_set;
  a.block_largest_matrix = (std::max({d * f, d * qd, d * kv}) * e).v;
  a.block_params = ((llama ? 2 * d + 2 * d * qd + 2 * d * kv + 3 * d * f + llama_biases : 12 * d * d + 13 * d) * e).v;
  // The head: the final norm keeps its input (and llama's 1/rms), the loss the normed states.
  // Under autocast the normed states are in the compute dtype.
  a.head_kept = (BT * (d * e + d * ce + (llama ? 4 : 8))).v;
  // The loss multiplies these without checks: the largest of its products must fit with room.
  (void)(BT * V * 8 + BT * d * 8 + V * d * 8);
  const auto l = loss.chunked() ? loss::chunked_cross_entropy_bytes(BT.v, d.v, V.v, loss.chunk_size(), dtype, compute)
                                : loss::linear_cross_entropy_bytes(BT.v, d.v, V.v, dtype, compute);
  a.head_kept = (Size(a.head_kept) + l.kept).v;
  a.loss_forward_temporary = l.forward_temporary;
  a.loss_backward_temporary = l.backward_temporary;
  a.loss_weight_gradient = l.weight_gradient;
  return a;
}

PackingBytes packing_bytes(const DecoderConfig& c, int64_t batch, int64_t seq, at::ScalarType dtype,
                           std::optional<at::ScalarType> compute_dtype) {
  const Size ce = static_cast<int64_t>(c10::elementSize(compute_dtype.value_or(dtype)));
  const Size B = batch, T = seq, hd = c.head_dim();
  PackingBytes p;
  // explicit: where's condition, the bool mask itself; sdpa: the additive mask of q's dtype
  p.mask = (B * T * T * (c.attention == AttentionKernel::sdpa ? ce : Size(1))).v;
  if (c.arch == "llama") {
    p.positions = (2 * B * T * hd * 4).v;
    p.block_plain = -(2 * T * hd * 4).v;
  } else {
    p.positions = (Size(batch - 1) * T * 8).v;
  }
  p.segments = (B * T * 8).v;
  return p;
}

DecoderFlops decoder_flops(const DecoderConfig& c, int64_t batch, int64_t seq) {
  const double BT = static_cast<double>(batch * seq), d = static_cast<double>(c.dim), f = static_cast<double>(c.ffn_dim);
  const double kv = static_cast<double>(c.n_kv_heads * c.head_dim()), T = static_cast<double>(seq);
  const double qd = static_cast<double>(c.n_heads * c.head_dim());
  // 2 flops per multiply-add: projections, the MLP, then scores and the weighted sum over T keys.
  const double weights = c.arch == "gpt2" ? 4 * d * d + 2 * d * f : 2 * d * qd + 2 * d * kv + 3 * d * f;
  DecoderFlops out;
  out.block_forward = 2 * BT * weights + 4 * BT * T * qd;
  out.forward = static_cast<double>(c.n_layers) * out.block_forward + 2 * BT * d * static_cast<double>(c.vocab_size);
  return out;
}

std::vector<int64_t> parameter_numels(const DecoderConfig& c) {
  // Elements, checked as sizes: optimizer state and gradients multiply them by a few bytes. The
  // shapes are hf_parameter_shapes's, in the model's named_parameters order.
  std::vector<int64_t> out;
  for (const auto& [name, shape] : hf_parameter_shapes(c)) {
    Size n = 1;
    for (const int64_t s : shape) n = n * s;
    out.push_back(n.v);
  }
  return out;
}

}  // namespace models
}  // namespace frugal
