// frugal/models/transformer_block.h — the pre-LN Transformer block that `frugal account` measures.
//
// x -> x + proj(causal_attention(qkv(ln1(x)))) -> x + fc2(gelu(fc1(ln2(x)))), no dropout
// (causal_attention is models/attention.h, with either kernel).
// Its Linear layers go through checkpoint::linear, so selective checkpointing can keep them.
//
//   frugal::models::PreLNBlock block(/*d_model=*/128, /*n_heads=*/4);
//   at::Tensor y = block->forward(x);                          // x, y: (B, T, d_model)
//   int64_t kept = frugal::models::predicted_saved_bytes(6, 16, 64, 128, 4);
//   block->set_attention(frugal::models::AttentionKernel::sdpa);  // LibTorch >= 2.0
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "frugal/models/attention.h"

namespace frugal {
namespace models {

// The pre-LN block above, with LayerNorms and Linear layers of width d_model (MLP: 4 * d_model).
class PreLNBlockImpl : public torch::nn::Module {
 public:
  // Throws c10::Error unless d_model is a positive multiple of n_heads.
  PreLNBlockImpl(int64_t d_model, int64_t n_heads, AttentionKernel attention = AttentionKernel::explicit_softmax);
  // x: (B, T, d_model) -> (B, T, d_model)
  at::Tensor forward(const at::Tensor& x);

  // The block's width.
  int64_t d_model() const { return d_model_; }
  // The number of attention heads.
  int64_t n_heads() const { return n_heads_; }
  // The attention kernel forward uses.
  AttentionKernel attention() const { return attention_; }
  // Switches the attention kernel for later forwards (the parameters are the same).
  void set_attention(AttentionKernel attention) { attention_ = attention; }

 private:
  int64_t d_model_;
  int64_t n_heads_;
  AttentionKernel attention_;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(PreLNBlock);

// Parameters of `layers` blocks: L * (12 d^2 + 13 d).
int64_t block_param_count(int64_t layers, int64_t d_model);

// Bytes autograd keeps between forward and backward for `layers` blocks without checkpointing,
// excluding the parameters and the chain's input (derivation next to the code). With sdpa the
// (B, H, T, T) probabilities become one fp32 log-sum-exp per query and head.
int64_t predicted_saved_bytes(int64_t layers, int64_t batch, int64_t seq, int64_t d_model, int64_t n_heads, int64_t element_size = 4,
                              AttentionKernel attention = AttentionKernel::explicit_softmax);

}  // namespace models
}  // namespace frugal
