// frugal/models/activation_bytes.h — what a decoder keeps for backward and allocates around it,
// in bytes, from its shape alone (no model is built).
//
// Counted from the tensors this implementation saves (decoder.cpp), so the training-memory estimate
// (train/estimate.h) only adds these up; tests check them against the allocation tracker.
//
//   auto a = frugal::models::decoder_activation_bytes(cfg, /*batch=*/16, /*seq=*/128, at::kFloat, loss_options);
//   int64_t kept = cfg.n_layers * a.block_plain + a.head_kept;   // no checkpointing
//   auto numels = frugal::models::parameter_numels(cfg);          // one per parameter, in module order
//   auto p = frugal::models::packing_bytes(cfg, 16, 128, at::kFloat);  // packed rows (segments) add
//   kept += p.kept(cfg.n_layers);                                 // ... this, with every block plain
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "frugal/models/decoder.h"

namespace frugal {
namespace models {

// The activation bytes of a decoder's pieces for one batch, which the memory estimate adds up.
struct DecoderActivationBytes {
  int64_t block_plain = 0;                       // one block run plainly: everything its backward reads
  int64_t block_input = 0;                       // a checkpointed block keeps only its input: (B, T, d)
  int64_t block_selective = 0;                   // selective checkpointing: its input and its matrix products
  int64_t block_backward_working_set = 0;        // a checkpointed block's backward temporaries at their peak
  int64_t plain_block_backward_working_set = 0;  // the same for a block that is not recomputed
  // Llama's SwiGLU backward, a moment of its own: its temporaries (the gradient of silu(gate) * up
  // and the two it makes, beside the residual stream's gradient), and the block's activations
  // freed by then (silu(gate) * up, down_proj's input, used by down_proj's backward). 0 elsewhere.
  int64_t swiglu_backward_working_set = 0;
  int64_t swiglu_freed_before = 0;
  // Attention's backward as a moment of its own, where the MLP's backward is counted exactly (fp32
  // SwiGLU Llama): its temporaries, the MLP's activations freed by then, and the block's weight
  // gradients made by then (the MLP's, the output projection's, the second norm's). 0 elsewhere:
  // attention's working set is then within block_backward_working_set, with every activation live.
  int64_t attention_backward_working_set = 0;
  int64_t attention_freed_before = 0;
  int64_t attention_gradients_before = 0;
  int64_t head_kept = 0;                // the final norm and the loss (plain: fp32 log-softmax of the logits)
  int64_t loss_forward_temporary = 0;   // at the loss's forward peak
  int64_t loss_backward_temporary = 0;  // at the loss's backward peak
  int64_t loss_weight_gradient = 0;     // the head weight's gradient, made by the loss's backward
  int64_t block_largest_matrix = 0;     // the largest weight of a block (one backward node's gradient)
  int64_t block_params = 0;             // bytes of one block's parameters
  // Whether a block's backward peaks after its last product's weight gradient is made in the
  // parameters' dtype: under autocast GPT-2's peaks while that gradient is still the product's
  // low-precision one; Llama's (SwiGLU's, after down_proj) and every fp32 one after it.
  bool peak_after_first_weight_gradient = true;
};

// Off the CPU (CUDA, fp16), Llama's SwiGLU casts rows to fp32 this many elements at a time (decoder.cpp).
constexpr int64_t kSwiGLUSliceElements = int64_t{1} << 18;

// Every size here is computed with overflow checks: one past kMaxSizeBytes (2^56, 64 PiB) throws
// std::overflow_error naming the product, so the sums and small multiples callers take of them
// (the estimate, optimizer state per parameter) cannot wrap either.
constexpr int64_t kMaxSizeBytes = int64_t{1} << 56;

// dtype: the parameters'; compute_dtype: the matrix products' under autocast (default: dtype).
DecoderActivationBytes decoder_activation_bytes(const DecoderConfig& config, int64_t batch, int64_t seq, at::ScalarType dtype,
                                                const LossOptions& loss, std::optional<at::ScalarType> compute_dtype = std::nullopt);

// What a packed forward (segments given to hidden_states, logits or loss) keeps beyond the same
// forward unpacked, in bytes: the layout is made once per forward and shared by every block; the
// chain's closures hold it until the last checkpointed block's backward, whatever the policy.
struct PackingBytes {
  int64_t mask = 0;         // the (B, 1, T, T) attention mask: bool (explicit kernel) or additive in
                            // the compute dtype (sdpa), attention.h's attention_mask_for
  int64_t positions = 0;    // llama: the rotary tables cos and sin, (B, T, hd) fp32 each; gpt2: the
                            // (B, T) int64 positions wpe keeps for backward, less the (T) arange the
                            // unpacked forward keeps there
  int64_t block_plain = 0;  // per block run plainly, to add to block_plain: llama's packed blocks make
                            // no (T, hd) tables of their own (minus 2 T hd 4); 0 for gpt2
  int64_t segments = 0;     // the (B, T) int64 input beside tokens and targets (the input category)
  // Kept through forward and backward with plain_blocks blocks run plainly (the rest checkpointed).
  int64_t kept(int64_t plain_blocks) const { return mask + positions + plain_blocks * block_plain; }
};
// dtype: the parameters'; compute_dtype: the matrix products' under autocast (default: dtype); the
// kernel is config.attention.
PackingBytes packing_bytes(const DecoderConfig& config, int64_t batch, int64_t seq, at::ScalarType dtype,
                           std::optional<at::ScalarType> compute_dtype = std::nullopt);

// Floating-point operations of the matrix products (and attention's two batched products) of one
// forward pass over batch x seq tokens; a training step is 3x that, plus one more forward of every
// recomputed block.
struct DecoderFlops {
  double forward = 0;        // the whole model, head included
  double block_forward = 0;  // one block
};
DecoderFlops decoder_flops(const DecoderConfig& config, int64_t batch, int64_t seq);

// The element count of each parameter, in the order make_decoder(config)->named_parameters() gives.
std::vector<int64_t> parameter_numels(const DecoderConfig& config);

}  // namespace models
}  // namespace frugal
