#include "frugal/train/estimate.h"

#include <algorithm>

#include "frugal/checkpoint/policy.h"

namespace frugal {
namespace train {

Recipe without_techniques(const Recipe& recipe) {
  Recipe r = recipe;
  r.checkpointing = "none";
  r.activation_budget = 0;
  r.chunked_loss = false;
  r.in_backward = false;
  if (r.clip == "global_norm_two_pass") r.clip = "global_norm";
  return r;
}

MemoryEstimate estimate_training_memory(const Recipe& r, int64_t vocab_size) {
  using memory::Category;
  models::DecoderConfig c = r.model;
  c.vocab_size = vocab_size;
  const int64_t e = r.dtype == "bf16" ? 2 : 4;  // bytes per element of parameters and activations
  const int64_t B = r.batch_size, T = r.seq_len, BT = B * T, d = c.dim, f = c.ffn_dim, H = c.n_heads;
  const int64_t kv = c.n_kv_heads * c.head_dim(), V = vocab_size, L = c.n_layers;
  const bool llama = c.arch == "llama";

  MemoryEstimate est;
  est.n_params = c.param_count();
  const int64_t P = est.n_params * e;
  const int64_t S = r.algorithm == "sgd" ? (r.momentum > 0 ? est.n_params * e : 0) : 2 * est.n_params * e;
  const int64_t input = 2 * BT * 8;  // inputs and targets, int64

  // Kept for backward by one block run plainly (see DESIGN notes in decoder.cpp / transformer_block.cpp):
  //   llama: x, norm1 out, q, k, v (as attention reads them), merged heads, x1, norm2 out   8 x (B,T,d)
  //          gate, silu(gate), up, silu*up                                               4 x (B,T,f)
  //          two 1/rms (fp32, one per token each) and the (B,H,T,T) probabilities
  //   gpt2:  the same 8 x (B,T,d), fc1 out and GELU out (2 x (B,T,f)), LayerNorm mean/rstd (fp32)
  const int64_t probs = B * H * T * T * e;
  const int64_t plain_layer = llama ? BT * ((8 * d + 4 * f) * e + 8) + probs : BT * ((8 * d + 2 * f) * e + 16) + probs;
  const int64_t block_input = BT * d * e;
  const int64_t kept_linears = llama ? BT * (4 * d + 2 * kv + 2 * f) * e : BT * (6 * d + f) * e;
  est.activation_per_layer = plain_layer;
  int64_t A = 0;
  bool recomputes = false;
  int64_t kept_when_checkpointed = block_input;  // what a checkpointed block keeps
  if (r.activation_budget > 0) {
    A = std::min(r.activation_budget, L * plain_layer);
    recomputes = A < L * plain_layer;
  } else {
    const auto policy = checkpoint::CheckpointPolicy::parse(r.checkpointing);
    for (int64_t i = 0; i < L; ++i) {
      if (!policy.checkpoints(i)) {
        A += plain_layer;
      } else {
        if (policy.kind == checkpoint::PolicyKind::selective) kept_when_checkpointed = block_input + kept_linears;
        A += kept_when_checkpointed;
        recomputes = true;
      }
    }
  }
  // The head: the final norm keeps its input and (llama) 1/rms, the loss keeps the normed states,
  // and the plain loss its fp32 log-softmax (B*T, V); the chunked loss one fp32 per token.
  A += BT * (2 * d * e + (llama ? 4 : 8)) + (r.chunked_loss ? BT * 4 : BT * V * 4);

  // Temporaries at the start of backward: the loss's gradient work.
  const int64_t chunk = std::min(r.loss_chunk, BT);
  const int64_t head_grad = V * d * e;
  const int64_t loss_bwd = r.chunked_loss ? 2 * chunk * V * 4 + V * d * 4 + BT * d * e : 2 * BT * V * 4 + BT * d * e;
  // A checkpointed block's recompute brings back what it did not keep.
  const int64_t recompute = recomputes ? plain_layer - kept_when_checkpointed : 0;
  // The optimizer's temporary: one parameter-sized buffer for the largest parameter.
  const int64_t largest_param = std::max({V * d, d * f, d * d}) * e;
  const int64_t opt_tmp = r.algorithm == "sgd" ? 0 : largest_param;

  // Gradients live together: all of them after a standard backward; in in-backward mode what one
  // backward node hands over (a checkpointed block's parameters, else the largest layer).
  const int64_t block_params = llama ? (2 * d + 2 * d * d + 2 * d * kv + 3 * d * f) * e : (12 * d * d + 13 * d) * e;
  const int64_t G_all = P;
  const int64_t G_node = recomputes ? std::max(block_params, head_grad) : largest_param;

  const int64_t bwd_start = A + std::max(loss_bwd, recompute) + head_grad;
  auto& cat = est.by_category;
  cat[static_cast<int>(Category::parameter)] = P;
  cat[static_cast<int>(Category::optimizer_state)] = S;
  cat[static_cast<int>(Category::input)] = input;
  if (r.in_backward) {
    cat[static_cast<int>(Category::activation)] = A;
    cat[static_cast<int>(Category::gradient)] = G_node;
    cat[static_cast<int>(Category::temporary)] = std::max(loss_bwd, recompute) + opt_tmp;
  } else if (bwd_start >= G_all + opt_tmp) {
    cat[static_cast<int>(Category::activation)] = A;
    cat[static_cast<int>(Category::gradient)] = head_grad;
    cat[static_cast<int>(Category::temporary)] = std::max(loss_bwd, recompute);
  } else {
    cat[static_cast<int>(Category::gradient)] = G_all;
    cat[static_cast<int>(Category::temporary)] = opt_tmp;
  }
  for (int64_t b : cat) est.peak_bytes += b;
  return est;
}

}  // namespace train
}  // namespace frugal
