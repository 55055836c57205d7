#include "frugal/train/estimate.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "frugal/checkpoint/policy.h"
#include "frugal/io/units.h"

namespace frugal {
namespace train {

Recipe without_techniques(const Recipe& recipe) {
  Recipe r = recipe;
  r.checkpointing = checkpoint::CheckpointPolicy::none();
  r.activation_budget = 0;
  r.loss.chunked(false);
  r.optimizer.mode(optim::Mode::standard);
  if (r.optimizer.clip() == optim::Clip::global_norm_two_pass) r.optimizer.clip(optim::Clip::global_norm);
  r.optimizer.state().precision(optim::StatePrecision::fp32);
  r.optimizer.state().placement(optim::StatePlacement::device);
  r.optimizer.stochastic_rounding(false);
  return r;
}

MemoryEstimate estimate_training_memory(const Recipe& r, int64_t vocab_size) {
  using memory::Category;
  models::DecoderConfig c = r.model;
  c.vocab_size = vocab_size;
  const int64_t e = r.dtype == at::kBFloat16 ? 2 : 4;  // bytes per element of parameters and activations
  const int64_t B = r.batch_size, T = r.seq_len, BT = B * T, d = c.dim, f = c.ffn_dim, H = c.n_heads;
  const int64_t kv = c.n_kv_heads * c.head_dim(), V = vocab_size, L = c.n_layers;
  const bool llama = c.arch == "llama";

  MemoryEstimate est;
  est.n_params = c.param_count();
  const int64_t P = est.n_params * e;
  // Adam(W) state per parameter: two moments in the state precision (parameter dtype for fp32 state
  // of bf16 parameters, as torch's optimizers keep it); off the device when placed in host memory
  // or files (the estimate is of the compute device's memory).
  const optim::StatePrecision precision = r.optimizer.state().precision();
  const double per_moment = precision == optim::StatePrecision::int8   ? 1.0 + 4.0 / 256
                            : precision == optim::StatePrecision::int4 ? 0.5 + 4.0 / 128
                            : precision == optim::StatePrecision::bf16 ? 2.0
                                                                       : static_cast<double>(e);
  const bool state_on_device = r.optimizer.state().placement() == optim::StatePlacement::device;
  const bool sgd = r.optimizer.algorithm() == optim::Algorithm::sgd;
  const int64_t S = sgd ? (r.optimizer.momentum() > 0 ? est.n_params * e : 0)
                    : state_on_device     ? static_cast<int64_t>(2.0 * per_moment * static_cast<double>(est.n_params))
                                          : 0;
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
  // What each block keeps until its backward, and whether it is recomputed.
  std::vector<int64_t> kept(static_cast<size_t>(L), plain_layer);
  std::vector<bool> recomputed(static_cast<size_t>(L), false);
  if (r.activation_budget > 0) {
    // The planner fits the budget; bound each block by it evenly (the plan itself needs measurements).
    const int64_t per_block = std::min(plain_layer, r.activation_budget / std::max<int64_t>(1, L));
    for (int64_t i = 0; i < L; ++i) {
      kept[static_cast<size_t>(i)] = per_block;
      recomputed[static_cast<size_t>(i)] = per_block < plain_layer;
    }
  } else {
    const checkpoint::CheckpointPolicy& policy = r.checkpointing;
    for (int64_t i = 0; i < L; ++i) {
      if (!policy.checkpoints(i)) continue;
      kept[static_cast<size_t>(i)] = policy.kind == checkpoint::PolicyKind::selective ? block_input + kept_linears : block_input;
      recomputed[static_cast<size_t>(i)] = true;
    }
  }
  // The head: the final norm keeps its input and (llama) 1/rms, the loss keeps the normed states,
  // and the plain loss its fp32 log-softmax (B*T, V); the chunked loss one fp32 per token.
  const int64_t head_kept = BT * (2 * d * e + (llama ? 4 : 8)) + (r.loss.chunked() ? BT * 4 : BT * V * 4);
  int64_t A = head_kept;
  for (int64_t k : kept) A += k;

  // Gradients live together: all of them after a standard backward; in in-backward mode what one
  // backward node hands over (a checkpointed block's parameters, else the largest layer).
  const int64_t head_grad = V * d * e;
  const int64_t largest_param = std::max({V * d, d * f, d * d}) * e;
  const int64_t block_params = llama ? (2 * d + 2 * d * d + 2 * d * kv + 3 * d * f) * e : (12 * d * d + 13 * d) * e;
  const bool any_recompute = std::find(recomputed.begin(), recomputed.end(), true) != recomputed.end();
  const int64_t G_node = any_recompute ? std::max(block_params, head_grad) : largest_param;

  // Candidate peaks (activations + temporaries + live gradients):
  //  (a) the loss's backward at the start of backward: its gradient work on top of every kept tensor;
  //  (b) a block's backward: everything kept before it, the block's full activations (recomputed
  //      if checkpointed) and its backward working set, about half a block's activations.
  const int64_t chunk = std::min(r.loss.chunk_size(), BT);
  const int64_t loss_bwd = r.loss.chunked() ? 2 * chunk * V * 4 + V * d * 4 + BT * d * e : 2 * BT * V * 4 + BT * d * e;
  const int64_t working_set = plain_layer / 2;
  int64_t peak_act = A, peak_tmp = loss_bwd, peak_grad = r.in_backward() ? G_node : 0;
  int64_t prefix = 0, grads_after = head_grad;  // standard mode: gradients of the head and later blocks
  std::vector<int64_t> grads_after_block(static_cast<size_t>(L));
  for (int64_t i = L - 1; i >= 0; --i) {
    grads_after_block[static_cast<size_t>(i)] = grads_after;
    grads_after += block_params;
  }
  for (int64_t i = 0; i < L; ++i) {
    const int64_t act = prefix + plain_layer;
    const int64_t grad = r.in_backward() ? G_node : grads_after_block[static_cast<size_t>(i)];
    if (act + working_set + grad > peak_act + peak_tmp + peak_grad) {
      peak_act = prefix + kept[static_cast<size_t>(i)];
      peak_tmp = plain_layer - kept[static_cast<size_t>(i)] + working_set;
      peak_grad = grad;
    }
    prefix += kept[static_cast<size_t>(i)];
  }
  //  (c) the optimizer step after backward: every gradient and one parameter-sized temporary.
  const int64_t opt_tmp = sgd ? 0 : largest_param;
  auto& cat = est.by_category;
  cat[static_cast<int>(Category::parameter)] = P;
  cat[static_cast<int>(Category::optimizer_state)] = S;
  cat[static_cast<int>(Category::input)] = input;
  if (!r.in_backward() && P + opt_tmp > peak_act + peak_tmp + peak_grad) {
    cat[static_cast<int>(Category::gradient)] = P;
    cat[static_cast<int>(Category::temporary)] = opt_tmp;
  } else {
    cat[static_cast<int>(Category::activation)] = peak_act;
    cat[static_cast<int>(Category::temporary)] = peak_tmp;
    cat[static_cast<int>(Category::gradient)] = peak_grad;
  }
  for (int64_t b : cat) est.peak_bytes += b;
  return est;
}

}  // namespace train
}  // namespace frugal

namespace frugal {
namespace train {

std::string explain_memory_limit(const Recipe& recipe, int64_t vocab_size, const memory::Tracker::LimitReport& report,
                                 int64_t limit_bytes) {
  std::ostringstream out;
  if (report.allocation_failed) {
    out << "an allocation of " << io::human_bytes(report.requested_bytes) << " failed";
  } else {
    out << "the memory limit of " << io::human_bytes(limit_bytes) << " was exceeded";
  }
  out << " at step " << report.step << " (" << memory::phase_name(report.phase) << "), with "
      << io::human_bytes(report.live_bytes) << " live:";
  for (memory::Category c : memory::kAllCategories) {
    const int64_t b = report.by_category[static_cast<int>(c)];
    if (b > 0) out << "\n  " << memory::category_name(c) << " " << io::human_bytes(b);
  }
  out << "\nestimated peak now " << io::human_bytes(estimate_training_memory(recipe, vocab_size).peak_bytes)
      << "; with one more technique:";
  std::vector<std::pair<std::string, Recipe>> options;
  auto add = [&](const std::string& what, Recipe r) { options.emplace_back(what, std::move(r)); };
  Recipe all = recipe;
  if (recipe.activation_budget == 0 && recipe.checkpointing.kind != checkpoint::PolicyKind::full) {
    Recipe r = recipe;
    r.checkpointing = checkpoint::CheckpointPolicy::full();
    all.checkpointing = checkpoint::CheckpointPolicy::full();
    add("memory.checkpointing=full", r);
  }
  if (!recipe.loss.chunked()) {
    Recipe r = recipe;
    r.loss.chunked(true);
    all.loss.chunked(true);
    add("memory.chunked_loss=true", r);
  }
  if (!recipe.in_backward()) {
    Recipe r = recipe;
    r.optimizer.mode(optim::Mode::in_backward);
    all.optimizer.mode(optim::Mode::in_backward);
    if (r.optimizer.clip() == optim::Clip::global_norm) {
      r.optimizer.clip(optim::Clip::global_norm_two_pass);
      all.optimizer.clip(optim::Clip::global_norm_two_pass);
    }
    add("optimizer.in_backward=true", r);
  }
  const bool sgd = recipe.optimizer.algorithm() == optim::Algorithm::sgd;
  const optim::StatePrecision precision = recipe.optimizer.state().precision();
  if (!sgd && (precision == optim::StatePrecision::fp32 || precision == optim::StatePrecision::bf16)) {
    Recipe r = recipe;
    r.optimizer.state().precision(optim::StatePrecision::int8);
    all.optimizer.state().precision(optim::StatePrecision::int8);
    add("optimizer.state_precision=int8", r);
  }
  if (!sgd && recipe.optimizer.state().placement() == optim::StatePlacement::device) {
    Recipe r = recipe;
    const optim::StatePlacement off_device = recipe.device.is_cpu() ? optim::StatePlacement::mmap : optim::StatePlacement::host;
    r.optimizer.state().placement(off_device);
    all.optimizer.state().placement(off_device);
    add(std::string("optimizer.state_placement=") + optim::placement_name(off_device), r);
  }
  if (options.size() > 1) add("all of the above", all);
  if (options.empty()) out << " (every technique is already on; lower train.batch_size or train.seq_len)";
  for (const auto& [what, r] : options) {
    const int64_t peak = estimate_training_memory(r, vocab_size).peak_bytes;
    out << "\n  " << what << ": " << io::human_bytes(peak) << (peak <= limit_bytes ? "  (fits)" : "");
  }
  return out.str();
}

}  // namespace train
}  // namespace frugal
