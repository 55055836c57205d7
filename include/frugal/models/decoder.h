// frugal/models/decoder.h — decoder-only language models: Llama and GPT-2, sized from a config.
//
// Llama: token embedding, RMSNorm, rotary position embedding (Hugging Face's rotate-half layout),
// multi-head attention with optional grouped-query heads (explicit softmax or fused sdpa kernels), SwiGLU MLP, tied or untied output head.
// GPT-2: learned positions, LayerNorm, GELU MLP, biases, tied head. Parameter names follow Hugging
// Face's (model.layers.0.self_attn.q_proj.weight, ...), so checkpoints map one to one.
// Every block can run under any checkpointing policy or plan; the head can use the chunked loss.
//
//   frugal::models::DecoderConfig cfg;  cfg.vocab_size = 4096;  cfg.dim = 256;  cfg.n_layers = 6;
//   auto model = frugal::models::make_decoder(cfg);
//   at::Tensor loss = model->loss(tokens, targets, frugal::models::LossOptions().chunked(true));
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <string>
#include <vector>

#include "frugal/checkpoint/planner.h"
#include "frugal/models/attention.h"

namespace frugal {
namespace models {

struct DecoderConfig {
  std::string arch = "llama";  // "llama" or "gpt2"
  int64_t vocab_size = 32000;
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  int64_t n_kv_heads = 32;     // llama: grouped-query attention when < n_heads
  int64_t ffn_dim = 11008;     // llama: SwiGLU hidden size; gpt2: 4 * dim
  int64_t max_seq_len = 4096;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  // How attention is computed (attention.h); not part of the weights or a Hugging Face config.
  AttentionKernel attention = AttentionKernel::explicit_softmax;

  // "n_heads must divide dim" style message for the first inconsistency, or empty.
  std::string validate() const;
  int64_t head_dim() const { return dim / n_heads; }
  int64_t param_count() const;
};

// ---- KV cache interface (the model branch's real cache replaces the placeholder behind it) ----
// What generation carries between calls of logits_with_cache.
struct KVCache {
  std::vector<at::Tensor> keys, values;  // per layer: (B, n_kv_heads, T_seen, head_dim) (empty before the first call)
  int64_t length = 0;                    // positions seen
};
// ---- end KV cache interface ----

struct LossOptions {
  TORCH_ARG(bool, chunked) = false;
  TORCH_ARG(int64_t, chunk_size) = 1024;
  TORCH_ARG(int64_t, ignore_index) = -100;
};

class DecoderImpl : public torch::nn::Module {
 public:
  virtual ~DecoderImpl() = default;
  const DecoderConfig& config() const { return config_; }

  // tokens: (B, T) int64 -> the blocks' input: (B, T, dim)
  virtual at::Tensor embed(const at::Tensor& tokens) = 0;
  // tokens: (B, T) int64 -> hidden states after the final norm: (B, T, dim)
  virtual at::Tensor hidden_states(const at::Tensor& tokens) = 0;
  // The output head's weight: (vocab, dim) (the embedding's when tied).
  virtual at::Tensor head_weight() = 0;
  // The blocks as a chain (for checkpointing policies, plans and the planner).
  virtual std::vector<checkpoint::ChainBlock> chain() = 0;

  // How the blocks run: a policy (default none) or a plan.
  void set_checkpointing(const checkpoint::CheckpointPolicy& policy);
  void set_plan(const checkpoint::ActivationPlan& plan);

  // tokens: (B, T) -> logits (B, T, vocab)
  at::Tensor logits(const at::Tensor& tokens);
  // tokens: (B, T) at positions cache.length .. -> logits (B, T, vocab) in fp32; appends to the cache.
  // No autograd, no checkpointing. (PLACEHOLDER in this branch: see decoder.cpp.)
  at::Tensor logits_with_cache(const at::Tensor& tokens, KVCache& cache);
  // Mean cross-entropy of predicting targets (B, T) (ignore_index skipped).
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const LossOptions& options = {});

 protected:
  explicit DecoderImpl(DecoderConfig config) : config_(std::move(config)) {}
  // Runs the blocks over x (B, T, dim) as the policy or plan says.
  at::Tensor run_blocks(const at::Tensor& x);

  DecoderConfig config_;
  checkpoint::CheckpointPolicy policy_ = checkpoint::CheckpointPolicy::none();
  std::optional<checkpoint::ActivationPlan> plan_;
  std::vector<checkpoint::ChainBlock> chain_;  // built on first use
};

using Decoder = std::shared_ptr<DecoderImpl>;

// Builds the architecture the config names (throws std::invalid_argument for a bad config), each
// parameter made directly in options' dtype (default fp32) and moved to its device (default CPU)
// block by block, so building never holds more than the parameters and one block besides.
Decoder make_decoder(const DecoderConfig& config, const at::TensorOptions& options = {});

// x: (..., dim) -> x / rms(x) * weight, computed in fp32 and returned in x's dtype
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// q, k: (B, H, T, hd) rotated by position (rotate-half layout); positions 0..T-1.
std::pair<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, double theta);

}  // namespace models
}  // namespace frugal
