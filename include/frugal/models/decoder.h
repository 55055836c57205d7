// frugal/models/decoder.h — decoder-only language models: Llama and GPT-2, sized from a config.
//
// Llama: token embedding, RMSNorm, rotary position embedding (Hugging Face's rotate-half layout;
// default, linear, llama3 or dynamic-NTK frequencies), multi-head attention with optional
// grouped-query heads and an explicit head size (explicit softmax or fused sdpa kernels), gated MLP
// (SiLU or GELU), optional attention and MLP biases, tied or untied output head.
// GPT-2: learned positions, LayerNorm, GELU MLP (erf or tanh), biases, tied or untied head.
// Parameter names follow Hugging Face's (model.layers.0.self_attn.q_proj.weight, ...), so
// checkpoints map one to one. Every block can run under any checkpointing policy or plan; the head
// can use the chunked loss, averaged or summed over the counted tokens; logits_with_cache decodes
// incrementally with a KVCache.
// Packed sequences: an optional segments tensor (B, T) puts several examples in one row; each
// attends only within itself and its positions restart at 0 (the mask and Llama's rotary tables or
// GPT-2's positions are built once per forward and shared by every block, checkpointed or not).
//
//   frugal::models::DecoderConfig cfg;  cfg.vocab_size = 4096;  cfg.dim = 256;  cfg.n_layers = 6;
//   auto model = frugal::models::make_decoder(cfg);
//   at::Tensor loss = model->loss(tokens, targets, frugal::models::LossOptions().chunked(true));
//   at::Tensor sum = model->loss(tokens, targets,   // segments: (B, T) int64, one value per example
//       frugal::models::LossOptions().reduction(frugal::loss::Reduction::sum), segments);
#pragma once

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frugal/checkpoint/planner.h"
#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/models/attention.h"

namespace frugal {
namespace models {

// Rotary frequency scaling (Hugging Face's rope_parameters / rope_scaling), llama only.
//   default: inv_freq[i] = theta^(-2i/hd)
//   linear:  inv_freq / factor (positions divided by factor)
//   llama3:  wavelengths longer than original_max_position_embeddings / low_freq_factor divided by
//            factor, shorter than .../ high_freq_factor kept, smoothly interpolated between
//   dynamic: default while positions stay below max_seq_len; beyond it NTK's theta growth, which
//            Hugging Face applies statefully, so frugal refuses it there
struct RopeScaling {
  std::string type = "default";  // default, linear, llama3, dynamic
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  int64_t original_max_position_embeddings = 0;          // llama3 (required), dynamic (0: max_seq_len)
  // Every field equal.
  bool operator==(const RopeScaling& o) const {
    return type == o.type && factor == o.factor && low_freq_factor == o.low_freq_factor && high_freq_factor == o.high_freq_factor &&
           original_max_position_embeddings == o.original_max_position_embeddings;
  }
};

// The shape and options of a decoder-only Transformer (llama or gpt2 style), as a config.json describes it.
struct DecoderConfig {
  std::string arch = "llama";  // "llama" or "gpt2"
  int64_t vocab_size = 32000;
  int64_t dim = 4096;
  int64_t n_layers = 32;
  int64_t n_heads = 32;
  int64_t n_kv_heads = 32;  // llama: grouped-query attention when < n_heads
  int64_t ffn_dim = 11008;  // llama: SwiGLU hidden size; gpt2: 4 * dim
  int64_t max_seq_len = 4096;
  double rope_theta = 10000.0;
  double norm_eps = 1e-5;
  bool tie_embeddings = false;
  int64_t explicit_head_dim = 0;  // llama: Hugging Face's head_dim when set (0: dim / n_heads)
  RopeScaling rope_scaling;       // llama
  // The MLP's activation: "silu", "gelu" (erf) or "gelu_tanh" (tanh approximation: Hugging Face's
  // gelu_new and gelu_pytorch_tanh); "" is the arch's own: silu for llama, erf gelu for gpt2 (what
  // frugal's recipes have always run; a GPT-2 config.json without activation_function is gelu_tanh).
  std::string activation;
  bool attention_bias = false;  // llama: q, k, v, o projections carry biases (gpt2 always has them)
  bool mlp_bias = false;        // llama: gate, up, down projections carry biases
  // The file's largest dropout probability and the field that holds it (eval and generation run
  // without dropout; training refuses a nonzero one unless the recipe says model.ignore_dropout).
  double dropout = 0.0;
  std::string dropout_field;
  // The dtype the checkpoint's config declares (torch_dtype / dtype), if any: the parameter dtype
  // load_hf_checkpoint uses when its caller names none.
  std::optional<at::ScalarType> file_dtype;
  // Fields of a Hugging Face config.json that do not change the computation (token ids,
  // architectures, dropout probabilities, ...), key -> JSON text, written back as they came.
  std::vector<std::pair<std::string, std::string>> hf_passthrough;
  // How attention is computed (attention.h); not part of the weights or a Hugging Face config.
  AttentionKernel attention = AttentionKernel::explicit_softmax;

  // "n_heads must divide dim" style message for the first inconsistency, or empty.
  std::string validate() const;
  // The size of one attention head: explicit_head_dim when set, else dim / n_heads.
  int64_t head_dim() const { return explicit_head_dim > 0 ? explicit_head_dim : dim / n_heads; }
  // activation with "" resolved by arch: "silu", "gelu" or "gelu_tanh"
  std::string resolved_activation() const { return !activation.empty() ? activation : arch == "gpt2" ? "gelu" : "silu"; }
  int64_t param_count() const;  // the number of parameter elements (the sum of parameter_numels, activation_bytes.h)
};

// How DecoderImpl::loss computes the cross-entropy: chunked or not, ignored targets, reduction.
struct LossOptions {
  TORCH_ARG(bool, chunked) = false;
  TORCH_ARG(int64_t, chunk_size) = 1024;
  TORCH_ARG(int64_t, ignore_index) = -100;
  // mean: over the targets != ignore_index; sum: their token losses added up (a trainer divides by
  // the label tokens of a whole step, across micro-batches and ranks, as transformers does).
  TORCH_ARG(loss::Reduction, reduction) = loss::Reduction::mean;
};

// Keys and values of the positions already seen, per layer, for incremental decoding.
struct KVCache {
  std::vector<at::Tensor> keys, values;  // per layer: (B, n_kv_heads, T_seen, head_dim) (empty before the first call)
  int64_t length = 0;                    // positions seen
};

// A decoder-only language model (make_decoder builds one): embedding, blocks, final norm, head.
class DecoderImpl : public torch::nn::Module {
 public:
  virtual ~DecoderImpl() = default;
  // The config it was built from.
  const DecoderConfig& config() const { return config_; }

  // tokens: (B, T) int64 -> the blocks' input: (B, T, dim)
  virtual at::Tensor embed(const at::Tensor& tokens) = 0;
  // tokens: (B, T) int64 -> hidden states after the final norm: (B, T, dim).
  // segments (optional): (B, T) int64, each row non-decreasing; the tokens of one run of equal
  // values are one example: they attend only to each other (and causally), at positions from 0.
  // Undefined: one sequence per row, exactly the computation without the argument.
  virtual at::Tensor hidden_states(const at::Tensor& tokens, const at::Tensor& segments) = 0;
  // The same without segments: one sequence per row.
  at::Tensor hidden_states(const at::Tensor& tokens) { return hidden_states(tokens, at::Tensor()); }
  // The output head's weight: (vocab, dim) (the embedding's when tied).
  virtual at::Tensor head_weight() = 0;
  // The blocks as a chain (for checkpointing policies, plans and the planner): unpacked rows. A
  // packed forward runs a chain of its own, whose closures hold that forward's mask and positions
  // until a checkpointed block's recompute in backward has used them.
  virtual std::vector<checkpoint::ChainBlock> chain() = 0;

  // How the blocks run: a policy (default none) or a plan.
  void set_checkpointing(const checkpoint::CheckpointPolicy& policy);
  void set_plan(const checkpoint::ActivationPlan& plan);  // runs the blocks by the plan until set_checkpointing

  // tokens: (B, T), segments as hidden_states' -> logits (B, T, vocab)
  at::Tensor logits(const at::Tensor& tokens, const at::Tensor& segments = {});
  // tokens: (B, T) at positions cache.length .. cache.length+T-1 -> logits (B, T, vocab) in fp32;
  // appends those positions' keys and values to the cache. Runs without autograd and without checkpointing.
  //   models::KVCache cache;
  //   at::Tensor first = model->logits_with_cache(prompt, cache);        // (B, T, V), cache.length = T
  //   at::Tensor next = model->logits_with_cache(last_token, cache);     // (B, 1, V) at position T
  at::Tensor logits_with_cache(const at::Tensor& tokens, KVCache& cache);
  // Cross-entropy of predicting targets (B, T) (ignore_index skipped), averaged or summed over the
  // counted tokens (options.reduction); segments as hidden_states'. In fp32.
  at::Tensor loss(const at::Tensor& tokens, const at::Tensor& targets, const LossOptions& options = {}, const at::Tensor& segments = {});

 protected:
  // Keeps the config; the subclass builds the modules.
  explicit DecoderImpl(DecoderConfig config) : config_(std::move(config)) {}
  // tokens: (B, T) at positions cache.length.. -> final hidden states (B, T, dim), the cache extended
  virtual at::Tensor hidden_states_with_cache(const at::Tensor& tokens, KVCache& cache) = 0;
  // Runs the blocks over x (B, T, dim) as the policy or plan says.
  at::Tensor run_blocks(const at::Tensor& x);
  // The same with block i running forwards[i] (a packed forward's closures over its layout); the
  // parameters and buffers are the chain's.
  at::Tensor run_blocks(const at::Tensor& x, std::vector<checkpoint::UnaryFn> forwards);
  // Checks segments against tokens (both (B, T), int64, one device).
  static void check_segments(const at::Tensor& tokens, const at::Tensor& segments);

  DecoderConfig config_;
  checkpoint::CheckpointPolicy policy_ = checkpoint::CheckpointPolicy::none();
  std::optional<checkpoint::ActivationPlan> plan_;
  std::vector<checkpoint::ChainBlock> chain_;  // built on first use
};

using Decoder = std::shared_ptr<DecoderImpl>;

// How make_decoder sets the weights: Hugging Face's random initialisation (matrices drawn from
// N(0, 0.02), biases zero), or no draw beyond the modules' own constructors, for a caller that
// loads every parameter next (a checkpoint): drawing a 7B model's values takes minutes on a CPU.
enum class WeightInit { random, for_loading };

// Builds the architecture the config names (throws std::invalid_argument for a bad config), each
// parameter made directly in options' dtype (default fp32) and moved to its device (default CPU)
// block by block, so building never holds more than the parameters and one block besides.
Decoder make_decoder(const DecoderConfig& config, const at::TensorOptions& options = {}, WeightInit init = WeightInit::random);

// x: (..., dim) -> x / rms(x) * weight, computed in fp32 and returned in x's dtype
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);     // weight: `dim` ones; eps is added to the mean square
  at::Tensor forward(const at::Tensor& x);  // x / rms(x) * weight, as above
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// segments: (B, T) integers, each row non-decreasing -> (B, T) int64: each token's index within its
// run of equal values (its example), i.e. its index minus the index where its run starts.
at::Tensor segment_positions(const at::Tensor& segments);

// q, k: (B, H, T, hd) rotated by position (rotate-half layout); positions 0..T-1.
std::pair<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, double theta);
// The rotary inverse frequencies (hd / 2) for head size hd, base theta and scaling, in fp32; `end`
// is one past the last position the tables will serve (dynamic scaling refuses end > max_seq_len).
at::Tensor rotary_inv_freq(int64_t hd, double theta, const RopeScaling& scaling, int64_t max_seq_len, int64_t end,
                           const at::TensorOptions& options = {});

}  // namespace models
}  // namespace frugal
