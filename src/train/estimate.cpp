#include "frugal/train/estimate.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <torch/version.h>

#include "frugal/checkpoint/planner.h"
#include "frugal/checkpoint/policy.h"
#include "frugal/dist/sharded_exchange.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/io/units.h"
#include "frugal/precision/autocast.h"

namespace frugal {
namespace train {
namespace {

// Sizes from a recipe can be absurd (model.vocab_size=9223372036854775807): refuse past the bound
// every size of models/activation_bytes.h keeps, models::kMaxSizeBytes (2^56), rather than wrap.
// These throw std::overflow_error; estimate_training_memory turns it into a RecipeError naming the keys.
int64_t within_bound(int64_t v, bool overflowed, const char* what) {
  if (overflowed || v > models::kMaxSizeBytes || v < -models::kMaxSizeBytes) {
    throw std::overflow_error(std::string(what) + " pass 2^56 bytes");
  }
  return v;
}
int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  const bool overflowed = __builtin_add_overflow(a, b, &out);
  return within_bound(out, overflowed, what);
}
int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  const bool overflowed = __builtin_mul_overflow(a, b, &out);
  return within_bound(out, overflowed, what);
}

}  // namespace

RecipeError unmet_activation_budget(int64_t budget, const std::vector<checkpoint::BlockCost>& costs) {
  return RecipeError("memory.activation_budget " + std::to_string(budget) + " cannot be met: the smallest achievable activation peak is " +
                     std::to_string(checkpoint::min_achievable_bytes(costs)) + " bytes");
}

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

namespace {

// Live bytes at one candidate moment of the step, in the categories that change over it.
struct Moment {
  std::string what;
  int64_t activation = 0, temporary = 0, gradient = 0;
  int64_t total() const { return activation + temporary + gradient; }
};

// The blocks as segments (a plan's, or one block each for a policy) and what each block keeps.
struct BlockLayout {
  std::vector<checkpoint::Segment> segments;
  std::vector<int64_t> kept;  // per block
};

BlockLayout block_layout(const Recipe& r, const models::DecoderActivationBytes& a, int64_t L,
                         const std::vector<checkpoint::Segment>* chosen) {
  BlockLayout out;
  out.kept.assign(static_cast<size_t>(L), a.block_plain);
  if (r.activation_budget > 0) {
    // The trainer's plan, or the planner on the formula's block costs (identical blocks, equal
    // times): the plan the trainer makes from measured blocks when the formula is right and the
    // blocks take equal times.
    if (chosen != nullptr) {
      out.segments = *chosen;
    } else {
      std::vector<checkpoint::BlockCost> costs(static_cast<size_t>(L), checkpoint::BlockCost{a.block_plain, a.block_input, 1.0});
      const auto plan = checkpoint::plan_for_budget(costs, r.activation_budget);
      if (!plan) throw unmet_activation_budget(r.activation_budget, costs);
      out.segments = plan->segments;
    }
    for (const auto& s : out.segments) {
      if (!s.checkpointed) continue;
      for (int64_t i = s.begin; i < s.end; ++i) out.kept[static_cast<size_t>(i)] = i == s.begin ? a.block_input : 0;
    }
    return out;
  }
  const bool selective = r.checkpointing.kind == checkpoint::PolicyKind::selective;
  for (int64_t i = 0; i < L; ++i) {
    const bool ckpt = r.checkpointing.checkpoints(i);
    out.segments.push_back({i, i + 1, ckpt});
    if (ckpt) out.kept[static_cast<size_t>(i)] = selective ? a.block_selective : a.block_input;
  }
  return out;
}

// Whether autograd sums two gradients of one input in place when it may (2.x: into the first, when it
// is a plain tensor nothing else holds) or always into a new tensor (1.13). Seen with the tracker.
constexpr bool kAutogradSumsInPlace = TORCH_VERSION_MAJOR >= 2;

// The parameters' bytes, and the optimizer state of the parameters (and slices) this rank owns,
// with the estimate's fields about them filled in (parameter count, state in files, fp32 fallbacks).
struct StaticBytes {
  int64_t parameters = 0, state = 0, code_tables = 0;
};

StaticBytes parameters_and_state(const Recipe& r, const std::vector<int64_t>& numels, const DataParallel& dp, MemoryEstimate& est) {
  StaticBytes out;
  const int64_t e = static_cast<int64_t>(c10::elementSize(r.dtype));
  for (int64_t n : numels) est.n_params = checked_add(est.n_params, n, "the parameter count");
  out.parameters = checked_mul(est.n_params, e, "the parameter bytes");
  int64_t S = 0;
  // Data parallel: the state of the parameters, and slices of parameters, this rank owns (the
  // sizes decide the owners).
  const dist::Ownership owners = dist::assign_owners(numels, dp.world_size);
  for (size_t i = 0; i < numels.size(); ++i) {
    const auto range = dist::owned_range(owners[i], dp.rank);
    const int64_t n = range.second - range.first;
    if (n == 0) continue;
    const optim::StateBufferBytes b = optim::state_bytes_for_parameter(n, r.dtype, r.optimizer);
    S = checked_add(S, b.total, "the optimizer state");
    est.state_in_files_bytes += b.in_files;
    est.state_window_bytes = std::max(est.state_window_bytes, b.window);
    const optim::StatePrecision asked = r.optimizer.state().precision();
    if (r.optimizer.algorithm() != optim::Algorithm::sgd && optim::effective_precision(n, r.optimizer.state()) != asked) {
      ++est.state_fp32_fallback_tensors;
      est.state_fp32_fallback_params += n;
    }
  }
  // A checkpoint holds the weights and every parameter's whole state (all ranks' shards).
  int64_t saved_state = 0;
  for (int64_t n : numels) {
    saved_state =
        checked_add(saved_state, optim::state_bytes_for_parameter(n, r.dtype, r.optimizer).total, "a checkpoint's optimizer state");
  }
  est.checkpoint_tensor_bytes = checked_add(out.parameters, saved_state, "a checkpoint");
  // File placement: the state in files is not memory; the window's buffers are (kStateWindowSlots
  // of the largest chunk, made with the first state), and paths other than the fused CPU kernels
  // map a chunk in within the update besides (update_temporary_bytes counts it there).
  if (r.optimizer.state().placement() == optim::StatePlacement::file) {
    est.state_window_bytes = checked_mul(est.state_window_bytes, optim::kStateWindowSlots, "the state's window");
    S = S - est.state_in_files_bytes + est.state_window_bytes;
  }
  // Host or file placement keeps the state off a GPU; on the CPU that memory is the device's.
  if (r.device.is_cuda() && r.optimizer.state().placement() != optim::StatePlacement::device) {
    est.state_off_device_bytes = S;
    S = 0;
  }
  out.state = S;
  out.code_tables = optim::shared_code_table_bytes(numels, r.optimizer);
  return out;
}

// What forward keeps for backward: each block's activations as the checkpointing leaves them,
// the head's, and packed examples' mask and positions.
struct KeptBytes {
  BlockLayout layout;
  int64_t all = 0;           // everything forward keeps, at the loss
  int64_t packed_kept = 0;   // packed examples: kept from the forward's start to its backward's end
  int64_t packed_input = 0;  // packed examples: their segments, beside the inputs
};

KeptBytes kept_by_forward(const Recipe& r, const models::DecoderConfig& c, const models::DecoderActivationBytes& a, at::ScalarType compute,
                          const std::vector<checkpoint::Segment>* plan) {
  KeptBytes k;
  k.layout = block_layout(r, a, c.n_layers, plan);
  int64_t kept_blocks = 0;
  for (int64_t b : k.layout.kept) kept_blocks = checked_add(kept_blocks, b, "the activations");
  k.all = checked_add(kept_blocks, a.head_kept, "the activations");
  // Packed examples: each forward's attention mask and per-token positions, kept from its start to
  // the end of its backward (shared by every block), and the segments beside the inputs.
  if (!r.text_data() && r.packing) {
    const models::PackingBytes pb = models::packing_bytes(c, r.batch_size, r.seq_len, r.dtype, compute);
    int64_t plain_blocks = 0;
    for (const auto& s : k.layout.segments) plain_blocks += s.checkpointed ? 0 : s.end - s.begin;
    k.packed_kept = pb.kept(plain_blocks);
    k.packed_input = checked_mul(pb.segments, r.optimizer.accumulation_steps(), "the inputs");
    k.all = checked_add(k.all, k.packed_kept, "the activations");
  }
  return k;
}

// The candidate peaks of one step, in order: the loss's forward and backward, each segment's
// backward (last first; in backward mode also the update of its largest matrix), the embedding's
// backward (and its update), and the optimizer step after a standard backward.
std::vector<Moment> step_moments(const Recipe& r, const models::DecoderConfig& c, const models::DecoderActivationBytes& a,
                                 const KeptBytes& kept, at::ScalarType compute, const std::vector<int64_t>& numels, int64_t parameter_bytes,
                                 const DataParallel& dp) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(r.dtype));
  const bool in_backward = r.in_backward();
  const bool bf16_instructions = r.device.is_cpu() && precision::fast_bf16(c10::DeviceType::CPU);
  const BlockLayout& layout = kept.layout;
  const int64_t kept_all = kept.all, packed_kept = kept.packed_kept, P = parameter_bytes;
  std::vector<Moment> moments;
  //  the loss's forward, on top of everything forward kept;
  moments.push_back({"forward, in the loss", kept_all, a.loss_forward_temporary, 0});
  //  the loss's backward: the logits' gradients (chunk by chunk when chunked) and the head's gradient.
  //  With tied embeddings the head's gradient waits for the embedding's, to be summed with it at the
  //  end of backward: an autograd intermediate (temporary), except where LibTorch 2.x sums the two
  //  in place into the first -- the loss's gradient, chunked or not, a plain tensor of its own --
  //  making that buffer the .grad (gradient).
  //  Accumulating over micro-batches (standard mode), a later micro-batch's head gradient is added
  //  to the .grad the first one left: a temporary.
  const bool tied = c.tie_embeddings;
  const bool head_grad_is_gradient = !tied || kAutogradSumsInPlace;
  const bool accumulating = !in_backward && r.optimizer.accumulation_steps() > 1;
  const bool loss_grad_is_gradient = head_grad_is_gradient && !accumulating;
  moments.push_back({"backward, in the loss", kept_all, a.loss_backward_temporary + (loss_grad_is_gradient ? 0 : a.loss_weight_gradient),
                     loss_grad_is_gradient ? a.loss_weight_gradient : 0});
  //  each segment's backward (last first): what the blocks before it keep, its blocks' activations
  //  all live (recomputed when checkpointed), its working set, and the gradients live by then
  //  (standard: the head's and those of every later block; in backward: one node's).
  const int64_t head_grad = checked_mul(checked_mul(c.vocab_size, c.dim, "the head"), e, "the head");
  // The tied head's gradient is pending until the embedding's backward, in either mode.
  const int64_t pending_head = tied ? head_grad : 0;
  const int64_t pending_head_temporary = head_grad_is_gradient ? 0 : pending_head;
  const int64_t pending_head_gradient = pending_head - pending_head_temporary;
  // The final norm's weight (and a LayerNorm's bias) is the first gradient backward completes, before
  // any block's: live from then on in a standard backward, and on the update thread's queue first.
  const int64_t final_norm_grad = checked_mul(c.arch == "gpt2" ? 2 * c.dim : c.dim, e, "the final norm");
  int64_t later_grads = checked_add(tied ? pending_head_gradient : head_grad, final_norm_grad, "the gradients");
  // In-backward gradients held beyond the one in hand (optimizer.h): with data parallel those
  // waiting for their averages, up to optimizer.bytes_in_flight; with optimizer.update_threads
  // those waiting for or in their update on the update thread, up to bytes_in_flight or one
  // gradient of any size. By a block's backward, of those completed so far (the later blocks', the
  // final norm's, an untied head's) and, on the update thread, `within` bytes of the block's own completed by the
  // moment (its MLP's, which that thread may still be updating while backward goes on).
  const int64_t bound = r.optimizer.bytes_in_flight();
  const bool queued = in_backward && dp.world_size > 1;
  const bool threaded = in_backward && r.optimizer.update_threads() > 0;
  int64_t completed = checked_add(tied ? 0 : head_grad, final_norm_grad, "the gradients");
  int64_t largest_completed = tied ? final_norm_grad : head_grad;
  auto in_flight = [&](int64_t within = 0) {
    if (threaded) {
      const int64_t largest = std::max(largest_completed, within > 0 ? a.block_largest_matrix : int64_t{0});
      return std::min(checked_add(completed, within, "the gradients"), std::max(bound, largest));
    }
    return queued ? std::min(bound, completed) : int64_t{0};
  };
  // The update thread's temporaries beside backward's working set.
  const int64_t beside = threaded ? optim::update_temporary_bytes(a.block_largest_matrix / e, r.dtype, r.device, r.optimizer) : 0;
  for (auto s = layout.segments.rbegin(); s != layout.segments.rend(); ++s) {
    int64_t prefix = 0;
    for (int64_t i = 0; i < s->begin; ++i) prefix = checked_add(prefix, layout.kept[static_cast<size_t>(i)], "the activations");
    const int64_t live = checked_mul(s->end - s->begin, a.block_plain, "the activations");
    // The block's own first gradients (its last matrix's) are made early in its backward. In
    // backward mode each gradient is used and freed as soon as it is complete (a checkpointed
    // segment's recompute accumulates straight into .grad too), so none is live at the working
    // set's peak (the tracker shows it) but the tied head's; the update of the largest matrix, with
    // its temporaries, while the block's activations are still live, is a moment of its own.
    // The block's first weight gradient: in the parameters' dtype by the peak, or still the
    // product's low-precision one (a temporary; activation_bytes.h).
    // Under autocast on a CPU with bf16 matrix instructions (oneDNN's bf16 products) a Llama block's
    // backward peaks while that gradient is still the product's bf16 one: measured with the tracker
    // on an AVX512-BF16 EPYC (tiny recipe, full checkpointing); where bf16 products are emulated
    // (AVX2) after its conversion, as activation_bytes.h says.
    const bool first_made = a.peak_after_first_weight_gradient && !(compute != r.dtype && bf16_instructions);
    const int64_t first_low = first_made ? 0 : a.block_largest_matrix / e * static_cast<int64_t>(c10::elementSize(compute));
    const int64_t first_grad = first_made ? a.block_largest_matrix : 0;
    prefix = checked_add(prefix, packed_kept, "the activations");
    const int64_t block_gradients =
        in_backward ? pending_head_gradient + in_flight(first_grad) : checked_add(first_grad, later_grads, "the gradients");
    moments.push_back({"backward of block " + std::to_string(s->end - 1), checked_add(prefix, live, "the activations"),
                       checked_add(s->checkpointed ? a.block_backward_working_set : a.plain_block_backward_working_set,
                                   pending_head_temporary + (in_backward ? 0 : first_low) + beside, "the temporaries"),
                       block_gradients});
    if (a.swiglu_backward_working_set > 0) {  // the last block's SwiGLU, after down_proj's backward
      moments.push_back(
          {"SwiGLU's backward in block " + std::to_string(s->end - 1), prefix + live - a.swiglu_freed_before,
           checked_add(a.swiglu_backward_working_set, pending_head_temporary + (in_backward ? 0 : first_low), "the temporaries"),
           in_backward ? pending_head_gradient + in_flight(a.block_largest_matrix) : block_gradients});
    }
    if (a.attention_backward_working_set > 0) {  // the last block's attention, after its MLP's backward
      // In backward mode one (d, f) gradient is still live there, not yet used by its update (the
      // tracker shows it on the default recipe: one of the MLP's projections').
      moments.push_back(
          {"attention's backward in block " + std::to_string(s->end - 1), prefix + live - a.attention_freed_before,
           checked_add(a.attention_backward_working_set, pending_head_temporary, "the temporaries"),
           in_backward ? checked_add(pending_head_gradient + in_flight(2 * a.block_largest_matrix), a.block_largest_matrix, "the gradients")
                       : checked_add(later_grads, a.attention_gradients_before, "the gradients")});
    }
    if (in_backward) {
      moments.push_back({"update in block " + std::to_string(s->end - 1) + "'s backward", prefix + live,
                         checked_add(optim::update_temporary_bytes(a.block_largest_matrix / e, r.dtype, r.device, r.optimizer),
                                     pending_head_temporary, "the temporaries"),
                         checked_add(a.block_largest_matrix, pending_head_gradient + in_flight(), "the gradients")});
    }
    later_grads = checked_add(later_grads, checked_mul(s->end - s->begin, a.block_params, "the gradients"), "the gradients");
    completed = checked_add(completed, checked_mul(s->end - s->begin, a.block_params, "the gradients"), "the gradients");
    largest_completed = std::max(largest_completed, a.block_largest_matrix);
  }
  //  the embedding's backward, last of all: its weight's gradient (V, H) is made, and with tied
  //  embeddings the head's pending gradient is summed with it -- into the head's where autograd sums
  //  in place (the two live), else into a new tensor (the two and their sum live). In backward mode
  //  the summed gradient is then used by its update and freed.
  {
    const int64_t embedding_grad = head_grad;                        // (V, H), like the head's
    const int64_t others = in_backward ? in_flight() : later_grads;  // later_grads holds a tied head's gradient, if any
    Moment m{"backward of the embedding", packed_kept, 0,
             checked_add(others, tied && head_grad_is_gradient ? 0 : embedding_grad, "the gradients")};
    if (tied) m.temporary = checked_add(pending_head_temporary, embedding_grad, "the temporaries");
    m.temporary = checked_add(m.temporary, beside, "the temporaries");
    if (in_backward && tied) m.gradient = checked_add(m.gradient, pending_head_gradient, "the gradients");
    moments.push_back(m);
    if (in_backward) {
      moments.push_back({"update of the embedding in backward", packed_kept,
                         optim::update_temporary_bytes(c.vocab_size * c.dim, r.dtype, r.device, r.optimizer),
                         checked_add(embedding_grad, in_flight(), "the gradients")});
    }
  }
  const int64_t largest = *std::max_element(numels.begin(), numels.end());
  // the optimizer step after a standard backward: every gradient and the largest update's temporaries.
  if (!in_backward) {
    moments.push_back({"optimizer step", 0, optim::update_temporary_bytes(largest, r.dtype, r.device, r.optimizer), P});
  }
  // Accumulating over micro-batches (standard mode), every gradient stays live from the first
  // micro-batch's backward to the update: through every later forward and backward.
  if (accumulating) {
    for (Moment& m : moments) m.gradient = std::max(m.gradient, P);
  }
  return moments;
}

// Adds up the byte formulas the layers publish at each candidate moment of a step and takes the
// largest. Throws std::overflow_error past kMaxSizeBytes; estimate_training_memory names the keys.
MemoryEstimate add_up_estimate(const Recipe& r, int64_t vocab_size, const DataParallel& dp = {},
                               const std::vector<checkpoint::Segment>* plan = nullptr) {
  using memory::Category;
  models::DecoderConfig c = r.model;
  c.vocab_size = vocab_size;
  MemoryEstimate est;
  // Each byte formula lives with the code that allocates those bytes; this only adds them up.
  const std::vector<int64_t> numels = models::parameter_numels(c);
  const StaticBytes fixed = parameters_and_state(r, numels, dp, est);
  // inputs and targets, int64, of the whole step (every micro-batch's rows)
  const int64_t BT = checked_mul(r.batch_size, r.seq_len, "the tokens of a batch");
  const int64_t input = checked_mul(checked_mul(BT, 16, "the inputs"), r.optimizer.accumulation_steps(), "the inputs");
  const at::ScalarType compute = resolve_compute_dtype(r);
  const models::DecoderActivationBytes a = models::decoder_activation_bytes(c, r.batch_size, r.seq_len, r.dtype, r.loss, compute);
  est.activation_per_layer = a.block_plain;
  const KeptBytes kept = kept_by_forward(r, c, a, compute, plan);
  const std::vector<Moment> moments = step_moments(r, c, a, kept, compute, numels, fixed.parameters, dp);
  for (const Moment& m : moments) checked_add(checked_add(m.activation, m.temporary, "the peak"), m.gradient, "the peak");
  const Moment peak =
      *std::max_element(moments.begin(), moments.end(), [](const Moment& x, const Moment& y) { return x.total() < y.total(); });
  est.peak_at = peak.what;
  auto& cat = est.by_category;
  cat[static_cast<int>(Category::parameter)] = fixed.parameters;
  cat[static_cast<int>(Category::optimizer_state)] = fixed.state;
  cat[static_cast<int>(Category::input)] = checked_add(input, kept.packed_input, "the inputs");
  cat[static_cast<int>(Category::other)] = fixed.code_tables;
  cat[static_cast<int>(Category::activation)] = peak.activation;
  cat[static_cast<int>(Category::temporary)] = peak.temporary;
  cat[static_cast<int>(Category::gradient)] = peak.gradient;
  for (int64_t b : cat) est.peak_bytes = checked_add(est.peak_bytes, b, "the peak");
  return est;
}

}  // namespace

MemoryEstimate estimate_training_memory(const Recipe& r, int64_t vocab_size, const DataParallel& dp,
                                        const std::vector<checkpoint::Segment>* plan) {
  const int64_t rows = r.rows_per_rank(dp.world_size);
  if (dp.rank < 0 || dp.rank >= dp.world_size) {
    throw RecipeError("rank " + std::to_string(dp.rank) + " is not one of the " + std::to_string(dp.world_size) + " ranks");
  }
  try {
    if (dp.world_size > 1) {
      Recipe share = r;
      share.batch_size = rows;
      return add_up_estimate(share, vocab_size, dp, plan);
    }
    return add_up_estimate(r, vocab_size, dp, plan);
  } catch (const std::overflow_error&) {
    // Blame the size keys that, each set to 1 alone, bring the sizes back in range.
    struct SizeKey {
      const char* key;
      int64_t Recipe::*train_member;
      int64_t models::DecoderConfig::*model_member;
    };
    const SizeKey keys[] = {{"model.vocab_size", nullptr, nullptr},
                            {"model.dim", nullptr, &models::DecoderConfig::dim},
                            {"model.ffn_dim", nullptr, &models::DecoderConfig::ffn_dim},
                            {"model.n_layers", nullptr, &models::DecoderConfig::n_layers},
                            {"model.n_heads", nullptr, &models::DecoderConfig::n_heads},
                            {"model.n_kv_heads", nullptr, &models::DecoderConfig::n_kv_heads},
                            {"model.max_seq_len", nullptr, &models::DecoderConfig::max_seq_len},
                            {"train.batch_size", &Recipe::batch_size, nullptr},
                            {"train.seq_len", &Recipe::seq_len, nullptr}};
    std::string blamed, all;
    for (const SizeKey& k : keys) {
      Recipe probe = r;
      int64_t probe_vocab = vocab_size, value = vocab_size;
      if (k.train_member) {
        value = r.*k.train_member;
        probe.*k.train_member = 1;
      } else if (k.model_member) {
        value = r.model.*k.model_member;
        probe.model.*k.model_member = 1;
      } else {
        probe_vocab = 1;
      }
      const std::string named = std::string(k.key) + "=" + std::to_string(value);
      all += (all.empty() ? "" : ", ") + named;
      try {
        add_up_estimate(probe, probe_vocab);
        blamed += (blamed.empty() ? "" : ", ") + named;
      } catch (const std::overflow_error&) {
      }
    }
    throw RecipeError((blamed.empty() ? all : blamed) + ": too large: the memory of this job would pass 2^56 bytes (64 PiB)");
  }
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
  out << " at step " << report.step << " (" << memory::phase_name(report.phase) << "), with " << io::human_bytes(report.live_bytes)
      << " live:";
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
  // On a GPU, host memory takes the state off the device; on the CPU host memory and mapped files
  // are the device's memory too, so no placement lowers the peak there.
  if (!sgd && recipe.device.is_cuda() && recipe.optimizer.state().placement() == optim::StatePlacement::device) {
    Recipe r = recipe;
    r.optimizer.state().placement(optim::StatePlacement::host);
    all.optimizer.state().placement(optim::StatePlacement::host);
    add("optimizer.state_placement=host", r);
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
