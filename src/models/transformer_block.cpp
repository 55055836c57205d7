#include "frugal/models/transformer_block.h"

#include "frugal/checkpoint/selective.h"
#include "frugal/models/attention.h"

namespace frugal {
namespace models {

PreLNBlockImpl::PreLNBlockImpl(int64_t d_model, int64_t n_heads, AttentionKernel attention)
    : d_model_(d_model), n_heads_(n_heads), attention_(attention) {
  TORCH_CHECK(d_model > 0 && n_heads > 0 && d_model % n_heads == 0, "PreLNBlock: width ", d_model, " must be a positive multiple of heads ",
              n_heads);
  ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  qkv = register_module("qkv", torch::nn::Linear(d_model, 3 * d_model));
  proj = register_module("proj", torch::nn::Linear(d_model, d_model));
  ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d_model})));
  fc1 = register_module("fc1", torch::nn::Linear(d_model, 4 * d_model));
  fc2 = register_module("fc2", torch::nn::Linear(4 * d_model, d_model));
}

at::Tensor PreLNBlockImpl::forward(const at::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), d = x.size(2), H = n_heads_;
  TORCH_CHECK(d == d_model_, "PreLNBlock: input width ", d, " differs from the block's ", d_model_);
  // attention half
  const at::Tensor h = ln1->forward(x);
  const at::Tensor qkv_out = checkpoint::linear(h, qkv->weight, qkv->bias);             // (B, T, 3d)
  const at::Tensor parts = qkv_out.view({B, T, 3, H, d / H}).permute({2, 0, 3, 1, 4});  // (3, B, H, T, dh)
  const at::Tensor att = causal_attention(parts[0], parts[1], parts[2], attention_);    // (B, H, T, dh)
  const at::Tensor merged = att.transpose(1, 2).reshape({B, T, d});                     // (B, T, d)
  const at::Tensor x1 = x + checkpoint::linear(merged, proj->weight, proj->bias);
  // MLP half
  const at::Tensor up = checkpoint::linear(ln2->forward(x1), fc1->weight, fc1->bias);  // (B, T, 4d)
  return x1 + checkpoint::linear(at::gelu(up), fc2->weight, fc2->bias);
}

int64_t block_param_count(int64_t layers, int64_t d_model) {
  // qkv 3d^2+3d, proj d^2+d, fc1 4d^2+4d, fc2 4d^2+d, two LayerNorms 2d each.
  return layers * (12 * d_model * d_model + 13 * d_model);
}

int64_t predicted_saved_bytes(int64_t layers, int64_t batch, int64_t seq, int64_t d_model, int64_t n_heads, int64_t element_size,
                              AttentionKernel attention) {
  // Korthikanti et al. (2022), per layer in fp16 with dropout: 34*s*b*h + 5*a*s^2*b bytes, where
  //   attention: 2sbh (QKV input) + 4sbh (Q, K) + 2sbh (V) + 2sbh (proj input) + sbh (proj dropout mask)
  //              + 2as^2b (softmax out) + as^2b (attention dropout mask) + 2as^2b (dropout out)
  //   MLP:       2sbh (fc1 input) + 8sbh (GELU input) + 8sbh (fc2 input) + sbh (dropout mask)
  //   LayerNorm: 2sbh + 2sbh (inputs of the two norms)
  // This block has no dropout: drop the two 1-byte sbh masks -> 32sbh fp16 bytes = 16 sbh elements;
  // of the attention term only the softmax output (a*s^2*b elements) stays. In elements per layer:
  //   16*s*b*h + a*s^2*b,  times element_size bytes (4 for fp32).
  // Checked against this implementation: x (ln1 input), ln1 out (qkv input), Q, K, V (contiguous
  // copies made by the batched matmuls), the merged heads (proj input), x1 (ln2 input), ln2 out
  // (fc1 input), fc1 out (GELU input), GELU out (fc2 input): 16 (B, T, d)-sized tensors, plus the
  // (B, H, T, T) probabilities. The first block's x is the chain's input (not counted) and the last
  // block's output is kept by the loss, so the chain total is the per-layer figure times L. Not in
  // the formula: LayerNorm's mean and rstd (2 floats per token per norm, under 1% at d >= 64).
  //
  // sdpa (measured with the tracker on LibTorch 2.x's CPU flash kernel): autograd keeps q, k and v
  // as given -- views of the qkv output, the same 3 (B, T, d) as the copies above -- the output,
  // whose (B, T, H, dh) layout makes the merged heads a view of it (the same 1 (B, T, d)), and the
  // log-sum-exp, fp32 (B, H, T) whatever the dtype. So the a*s^2*b elements become a*s*b floats.
  const int64_t per_layer_elements = 16 * seq * batch * d_model;
  const int64_t attention_bytes =
      attention == AttentionKernel::sdpa ? n_heads * seq * batch * 4 : n_heads * seq * seq * batch * element_size;
  return layers * (per_layer_elements * element_size + attention_bytes);
}

}  // namespace models
}  // namespace frugal
