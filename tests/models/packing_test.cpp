// Packed sequences (several examples in one row, told apart by segments) against each example run
// alone: the summed loss and every parameter's gradient, for llama (grouped-query heads; llama3
// rope scaling) and gpt2, both attention kernels, every checkpointing policy and a plan, the plain
// and the chunked loss, fp32 and bf16 autocast. Also: the layout helpers, examples that cannot see
// each other, a checkpointed backward after another forward, undefined segments as before, the loss
// reductions, and the bytes packing adds against the tracker.
#include <gtest/gtest.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include <cmath>
#include <string>
#include <vector>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/planner.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/models/attention.h"
#include "frugal/models/decoder.h"

using namespace frugal;
using models::AttentionKernel;
using models::DecoderConfig;

namespace {

DecoderConfig packing_config(const std::string& arch) {
  DecoderConfig c;
  c.arch = arch;
  c.vocab_size = 61;
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = arch == "llama" ? 2 : 4;  // llama: grouped-query heads, 4 over 2
  c.ffn_dim = arch == "llama" ? 48 : 64;
  c.max_seq_len = 32;
  return c;
}

DecoderConfig llama3_scaled() {
  DecoderConfig c = packing_config("llama");
  c.rope_scaling.type = "llama3";
  c.rope_scaling.factor = 8;
  c.rope_scaling.original_max_position_embeddings = 8;
  c.explicit_head_dim = 10;
  return c;
}

std::vector<DecoderConfig> configs() { return {packing_config("llama"), llama3_scaled(), packing_config("gpt2")}; }

std::string describe(const DecoderConfig& c) {
  return c.arch + (c.rope_scaling.type == "llama3" ? " llama3-rope" : "") + " " + models::attention_kernel_name(c.attention);
}

// Six examples of different lengths; packed three rows of 16 (each ends with padding, a segment of
// its own), unpacked one per row of 11 with padding after it. Targets: the next token, -100 at each
// example's last position and on padding.
const std::vector<int64_t> kLengths = {5, 9, 3, 7, 4, 11};
const std::vector<std::vector<int64_t>> kRows = {{0, 1}, {2, 3, 4}, {5}};
constexpr int64_t kRowLength = 16, kLongest = 11;

struct Batch {
  at::Tensor tokens, targets, segments;  // (rows, T); segments undefined when unpacked
};

std::vector<at::Tensor> examples(int64_t vocab, uint64_t seed = 5) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (int64_t n : kLengths) out.push_back(at::randint(1, vocab, {n}, at::kLong));
  return out;
}

// Writes example e at [row, at) of tokens and targets.
void place(const at::Tensor& e, int64_t row, int64_t at_pos, at::Tensor& tokens, at::Tensor& targets) {
  const int64_t n = e.size(0);
  tokens[row].narrow(0, at_pos, n).copy_(e);
  if (n > 1) targets[row].narrow(0, at_pos, n - 1).copy_(e.narrow(0, 1, n - 1));
}

Batch packed(const std::vector<at::Tensor>& ex) {
  const int64_t R = static_cast<int64_t>(kRows.size());
  Batch b{at::zeros({R, kRowLength}, at::kLong), at::full({R, kRowLength}, -100, at::kLong), at::zeros({R, kRowLength}, at::kLong)};
  for (int64_t r = 0; r < R; ++r) {
    int64_t pos = 0, seg = 0;
    for (int64_t i : kRows[static_cast<size_t>(r)]) {
      place(ex[static_cast<size_t>(i)], r, pos, b.tokens, b.targets);
      b.segments[r].narrow(0, pos, kLengths[static_cast<size_t>(i)]).fill_(seg++);
      pos += kLengths[static_cast<size_t>(i)];
    }
    b.segments[r].narrow(0, pos, kRowLength - pos).fill_(seg);  // padding: a segment of its own
  }
  return b;
}

Batch unpacked(const std::vector<at::Tensor>& ex) {
  const int64_t N = static_cast<int64_t>(ex.size());
  Batch b{at::zeros({N, kLongest}, at::kLong), at::full({N, kLongest}, -100, at::kLong), at::Tensor()};
  for (int64_t i = 0; i < N; ++i) place(ex[static_cast<size_t>(i)], i, 0, b.tokens, b.targets);
  return b;
}

struct Result {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

// The summed loss of the batch and every parameter's gradient, the forward under `autocast`.
Result run(models::DecoderImpl& m, const Batch& b, models::LossOptions opt,
           const precision::AutocastState& autocast = precision::AutocastState::off()) {
  for (auto& p : m.parameters()) p.mutable_grad().reset();
  at::Tensor loss;
  {
    precision::AutocastGuard guard(autocast);
    loss = m.loss(b.tokens, b.targets, opt.reduction(loss::Reduction::sum), b.segments);
  }
  loss.backward();
  Result r{loss.item<double>(), {}};
  for (auto& p : m.parameters()) r.grads.push_back(p.grad().defined() ? p.grad().clone() : at::zeros_like(p));
  return r;
}

// |loss - ref| <= rtol |ref|, and per parameter max |g - ref| <= rtol max |ref|.
void expect_close(const Result& got, const Result& ref, double rtol) {
  EXPECT_LE(std::abs(got.loss - ref.loss), rtol * std::abs(ref.loss)) << got.loss << " vs " << ref.loss;
  ASSERT_EQ(got.grads.size(), ref.grads.size());
  for (size_t i = 0; i < got.grads.size(); ++i) {
    const double scale = ref.grads[i].abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << "parameter " << i << " has no gradient";
    EXPECT_LE((got.grads[i] - ref.grads[i]).abs().max().item<double>(), rtol * scale) << "parameter " << i;
  }
}

models::Decoder make(const DecoderConfig& c) {
  torch::manual_seed(11);
  auto m = models::make_decoder(c);
  at::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.normal_(0, 0.2);  // larger than the initialisation: attention far from uniform
  return m;
}

// A plan with a checkpointed segment of two blocks and a plain block, from the planner's own
// measurement of the model's (unpacked) chain.
checkpoint::ActivationPlan mixed_plan(models::DecoderImpl& m) {
  const at::Tensor x = m.embed(at::randint(1, m.config().vocab_size, {2, kRowLength}, at::kLong)).detach();
  const auto costs = checkpoint::measure_chain(m.chain(), x, 1);
  return checkpoint::make_plan(costs, {{0, 2, true}, {2, 3, false}});
}

void set_policy(models::DecoderImpl& m, const std::string& policy) {
  if (policy == "plan") {
    m.set_plan(mixed_plan(m));
  } else {
    m.set_checkpointing(checkpoint::CheckpointPolicy::parse(policy));
  }
}

}  // namespace

// The layout: positions restart at each run of equal values (whatever the values), the mask lets a
// token see exactly the earlier tokens of its own run.
TEST(Packing, SegmentPositionsAndMaskFollowTheRuns) {
  const at::Tensor segments = at::tensor({0, 0, 0, 1, 1, 2, 3, 3, /**/ 4, 4, 4, 4, 9, 9, 9, 9}, at::kLong).view({2, 8});
  const at::Tensor positions = models::segment_positions(segments);
  const at::Tensor want = at::tensor({0, 1, 2, 0, 1, 0, 0, 1, /**/ 0, 1, 2, 3, 0, 1, 2, 3}, at::kLong).view({2, 8});
  EXPECT_TRUE(at::equal(positions, want)) << positions;
  const at::Tensor mask = models::segment_attention_mask(segments);
  ASSERT_EQ(mask.sizes(), (std::vector<int64_t>{2, 1, 8, 8}));
  EXPECT_EQ(mask.scalar_type(), at::kBool);
  auto acc = segments.accessor<int64_t, 2>();
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 8; ++i) {
      for (int64_t j = 0; j < 8; ++j) {
        EXPECT_EQ(mask[b][0][i][j].item<bool>(), j <= i && acc[b][i] == acc[b][j]) << b << " " << i << " " << j;
      }
    }
  }
  // one segment per row: the causal triangle and 0..T-1
  const at::Tensor one = at::zeros({1, 5}, at::kLong);
  EXPECT_TRUE(at::equal(models::segment_positions(one), at::arange(5, at::kLong).view({1, 5})));
  EXPECT_TRUE(at::equal(models::segment_attention_mask(one), at::ones({1, 1, 5, 5}, at::kBool).tril()));
  // for sdpa the mask is additive in the compute dtype: 0 where allowed, -inf elsewhere
  const at::Tensor add = models::attention_mask_for(AttentionKernel::sdpa, mask, at::kBFloat16);
  EXPECT_EQ(add.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(add.eq(0), mask));
  EXPECT_TRUE(at::equal(models::attention_mask_for(AttentionKernel::explicit_softmax, mask, at::kFloat), mask));
}

// fp32: the packed rows' summed loss and every parameter's gradient equal the examples run one per
// row without segments to 1e-5 relative (loss; per parameter, of its largest gradient; measured at
// most 1.1e-7 and 4e-7 on LibTorch 1.13), whatever the
// checkpointing (none, full, selective, a plan of a checkpointed and a plain segment) and loss (plain,
// chunked in chunks of 7 tokens).
TEST(Packing, PackedEqualsUnpackedInFloat32) {
  for (DecoderConfig c : configs()) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      SCOPED_TRACE(describe(c));
      auto m = make(c);
      const auto ex = examples(c.vocab_size);
      const Result ref = run(*m, unpacked(ex), models::LossOptions());
      EXPECT_GT(ref.loss, 0.0);
      for (const std::string policy : {"none", "full", "selective", "plan"}) {
        set_policy(*m, policy);
        for (bool chunked : {false, true}) {
          SCOPED_TRACE(policy + (chunked ? " chunked" : " plain"));
          expect_close(run(*m, packed(ex), models::LossOptions().chunked(chunked).chunk_size(7)), ref, 1e-5);
        }
      }
    }
  }
}

// bf16 autocast (products in bf16, parameters and loss in fp32), both sides under it: within 2e-2
// relative, on the loss and per parameter of its largest gradient (bf16 keeps 8 bits, 4e-3 per
// rounding; the packed and the unpacked rows round different sums of the same values; measured
// at most 4.3e-3 on the gradients, where fp32 shows 4e-7).
TEST(Packing, PackedEqualsUnpackedUnderBFloat16Autocast) {
  const auto bf16 = precision::AutocastState::compute(c10::kCPU, at::kBFloat16);
  for (DecoderConfig c : configs()) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      SCOPED_TRACE(describe(c));
      auto m = make(c);
      const auto ex = examples(c.vocab_size);
      const Result ref = run(*m, unpacked(ex), models::LossOptions(), bf16);
      for (const std::string policy : {"none", "full"}) {
        set_policy(*m, policy);
        SCOPED_TRACE(policy);
        expect_close(run(*m, packed(ex), models::LossOptions().chunked(true).chunk_size(7), bf16), ref, 2e-2);
      }
    }
  }
}

// The mutation check: what the layout is for shows in the logits. Changing the first example of a
// row leaves the later examples' logits unchanged with segments (the mask), and changes them without;
// a later example's logits equal its logits run alone (position 0 onwards) with segments, and differ
// when the segments are ignored. (Llama's rotary embedding is relative, so for it positions that did
// not restart would not show here; SegmentPositionsAndMaskFollowTheRuns checks them, and GPT-2's
// learned positions show them.)
TEST(Packing, ExamplesDoNotSeeEachOtherAndStartAtPositionZero) {
  for (DecoderConfig c : configs()) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      SCOPED_TRACE(describe(c));
      auto m = make(c);
      const auto ex = examples(c.vocab_size);
      const Batch b = packed(ex);
      at::Tensor changed = b.tokens.clone();
      changed[1].narrow(0, 0, kLengths[2]).add_(1).remainder_(c.vocab_size);  // row 1's first example
      at::NoGradGuard no_grad;
      const int64_t later = kLengths[2];  // row 1's later examples start here
      const int64_t n = kRowLength - later;
      auto tail = [&](const at::Tensor& tokens, const at::Tensor& segments) { return m->logits(tokens, segments)[1].narrow(0, later, n); };
      EXPECT_LE((tail(b.tokens, b.segments) - tail(changed, b.segments)).abs().max().item<double>(), 1e-6);
      EXPECT_GT((tail(b.tokens, at::Tensor()) - tail(changed, at::Tensor())).abs().max().item<double>(), 1e-3);
      // row 1's second example (ex[3]) alone, against its place in the packed row
      const at::Tensor alone = m->logits(ex[3].unsqueeze(0))[0];  // (7, V)
      auto second = [&](const at::Tensor& segments) { return m->logits(b.tokens, segments)[1].narrow(0, later, kLengths[3]); };
      EXPECT_LE((second(b.segments) - alone).abs().max().item<double>(), 1e-5);
      EXPECT_GT((second(at::Tensor()) - alone).abs().max().item<double>(), 1e-3);
    }
  }
}

// A checkpointed block recomputes in backward with the mask and positions of its own forward: a
// forward with other segments (and an unpacked one) in between changes nothing.
TEST(Packing, RecomputeUsesItsOwnForwardsLayout) {
  for (DecoderConfig c : configs()) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      SCOPED_TRACE(describe(c));
      auto m = make(c);
      for (const std::string policy : {"full", "plan"}) {
        SCOPED_TRACE(policy);
        set_policy(*m, policy);
        const auto ex = examples(c.vocab_size);
        const Batch b = packed(ex);
        const Result alone = run(*m, b, models::LossOptions());
        // Other boundaries, same shape: every row one example.
        for (auto& p : m->parameters()) p.mutable_grad().reset();
        const at::Tensor first = m->loss(b.tokens, b.targets, models::LossOptions().reduction(loss::Reduction::sum), b.segments);
        const at::Tensor other = m->loss(b.tokens, b.targets, models::LossOptions(), at::zeros_like(b.segments));
        const at::Tensor plain = m->loss(b.tokens, b.targets);
        first.backward();
        std::vector<at::Tensor> grads;
        for (auto& p : m->parameters()) grads.push_back(p.grad().clone());
        ASSERT_EQ(grads.size(), alone.grads.size());
        for (size_t i = 0; i < grads.size(); ++i) EXPECT_TRUE(at::equal(grads[i], alone.grads[i])) << "parameter " << i;
        (void)other;
        (void)plain;
      }
    }
  }
}

// Undefined segments are the computation without them: the same code path, bit for bit (loss,
// logits and gradients), and no layout is made (the unpacked forward keeps what
// decoder_activation_bytes says, as decoder_test checks, and packing adds exactly packing_bytes).
TEST(Packing, UndefinedSegmentsAreTheUnpackedComputationBitForBit) {
  for (DecoderConfig c : configs()) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      SCOPED_TRACE(describe(c));
      auto m = make(c);
      const Batch b = unpacked(examples(c.vocab_size));
      for (bool chunked : {false, true}) {
        auto grads_of = [&](const at::Tensor& loss) {
          for (auto& p : m->parameters()) p.mutable_grad().reset();
          loss.backward();
          std::vector<at::Tensor> g;
          for (auto& p : m->parameters()) g.push_back(p.grad().clone());
          return g;
        };
        const models::LossOptions opt = models::LossOptions().chunked(chunked).chunk_size(7);
        const at::Tensor a = m->loss(b.tokens, b.targets, opt), e = m->loss(b.tokens, b.targets, opt, at::Tensor());
        EXPECT_TRUE(at::equal(a, e));
        const auto ga = grads_of(a), ge = grads_of(e);
        for (size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(at::equal(ga[i], ge[i])) << "parameter " << i;
      }
      at::NoGradGuard no_grad;
      EXPECT_TRUE(at::equal(m->logits(b.tokens), m->logits(b.tokens, at::Tensor())));
      EXPECT_TRUE(at::equal(m->hidden_states(b.tokens), m->hidden_states(b.tokens, at::Tensor())));
    }
  }
}

// reduction sum is the mean times the counted tokens (targets != ignore_index), on the plain and
// the chunked path, for the loss and its gradients, packed or not (fp32, 1e-5 relative).
TEST(Packing, LossSumIsMeanTimesCount) {
  for (const char* arch : {"llama", "gpt2"}) {
    SCOPED_TRACE(arch);
    auto m = make(packing_config(arch));
    const auto ex = examples(packing_config(arch).vocab_size);
    for (const Batch& b : {packed(ex), unpacked(ex)}) {
      const double count = b.targets.ne(-100).sum().item<double>();
      ASSERT_GT(count, 0);
      ASSERT_LT(count, static_cast<double>(b.targets.numel()));
      for (bool chunked : {false, true}) {
        SCOPED_TRACE(chunked ? "chunked" : "plain");
        const auto opt = models::LossOptions().chunked(chunked).chunk_size(7);
        const at::Tensor mean = m->loss(b.tokens, b.targets, opt, b.segments);
        const at::Tensor sum = m->loss(b.tokens, b.targets, models::LossOptions(opt).reduction(loss::Reduction::sum), b.segments);
        EXPECT_EQ(sum.scalar_type(), at::kFloat);
        EXPECT_NEAR(sum.item<double>(), mean.item<double>() * count, 1e-5 * sum.item<double>());
        const at::Tensor w = m->head_weight();
        const at::Tensor gm = torch::autograd::grad({mean}, {w})[0], gs = torch::autograd::grad({sum}, {w})[0];
        EXPECT_LE((gs - gm * count).abs().max().item<double>(), 1e-5 * gs.abs().max().item<double>());
      }
    }
  }
}

namespace {

// Activation bytes live at the end of a forward of hidden_states (tracked from its start), fp32 or
// bf16 parameters, or fp32 under bf16 autocast.
int64_t forward_kept(models::DecoderImpl& m, const at::Tensor& tokens, const at::Tensor& segments, bool autocast) {
  auto tracker = memory::Tracker::create();
  at::Tensor y;
  {
    precision::AutocastGuard guard(autocast ? precision::AutocastState::compute(c10::kCPU, at::kBFloat16)
                                            : precision::AutocastState::off());
    memory::TrackingGuard on(tracker);
    memory::PhaseScope fw(memory::Phase::forward);
    y = m.hidden_states(tokens, segments);
  }
  return tracker->live_by_category()[static_cast<int>(memory::Category::activation)];
}

}  // namespace

// What packing adds to a forward, measured with the tracker (the packed forward less the same rows
// unpacked), is exactly packing_bytes: with every block plain, kept(n_layers); with every block
// checkpointed, kept(0), the shared layout alone; for llama and gpt2, both kernels, fp32, bf16
// parameters and bf16 autocast.
TEST(Packing, PackingBytesEqualTheTracker) {
  for (DecoderConfig c : {packing_config("llama"), packing_config("gpt2")}) {
    for (AttentionKernel kernel : models::available_attention_kernels()) {
      c.attention = kernel;
      for (const char* mode : {"fp32", "bf16", "autocast"}) {
        SCOPED_TRACE(describe(c) + " " + mode);
        const bool bf16 = std::string(mode) == "bf16", autocast = std::string(mode) == "autocast";
        torch::manual_seed(0);
        auto m = models::make_decoder(c, at::TensorOptions().dtype(bf16 ? at::kBFloat16 : at::kFloat));
        const int64_t B = 3, T = 24;
        const at::Tensor tokens = at::randint(0, c.vocab_size, {B, T}, at::kLong);
        at::Tensor segments = at::zeros({B, T}, at::kLong);
        segments.narrow(1, 5, 10).fill_(1);
        segments.narrow(1, 15, 9).fill_(2);
        const auto p = models::packing_bytes(c, B, T, bf16 ? at::kBFloat16 : at::kFloat,
                                             autocast ? std::optional<at::ScalarType>(at::kBFloat16) : std::nullopt);
        EXPECT_EQ(p.segments, B * T * 8);
        for (const char* policy : {"none", "full"}) {
          SCOPED_TRACE(policy);
          m->set_checkpointing(checkpoint::CheckpointPolicy::parse(policy));
          const int64_t added = forward_kept(*m, tokens, segments, autocast) - forward_kept(*m, tokens, at::Tensor(), autocast);
          EXPECT_EQ(added, p.kept(std::string(policy) == "none" ? c.n_layers : 0))
              << "mask " << p.mask << " positions " << p.positions << " per block " << p.block_plain;
        }
      }
    }
  }
}

// What sdpa keeps with a mask (LibTorch 2.x's CPU kernel), measured: with a bool mask, one copy of
// the mask in q's dtype per call on top of the unmasked kernel's (no (B, H, T, T) probabilities: the
// flash kernel still runs); with the additive mask of q's dtype (attention_mask_for), nothing on
// top: the caller's one tensor is what it keeps.
TEST(Packing, SdpaKeepsNoProbabilitiesAndOnlyTheSharedMask) {
  const std::string why = models::attention_kernel_unavailable(AttentionKernel::sdpa);
  if (!why.empty()) GTEST_SKIP() << "sdpa " << why;
  const int64_t B = 2, H = 4, T = 64, dh = 16;
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(0);
    const at::Tensor q = at::randn({B, H, T, dh}).to(dtype).requires_grad_(true);
    const at::Tensor k = at::randn({B, H, T, dh}).to(dtype).requires_grad_(true);
    const at::Tensor v = at::randn({B, H, T, dh}).to(dtype).requires_grad_(true);
    at::Tensor segments = at::zeros({B, T}, at::kLong);
    segments.narrow(1, 20, 44).fill_(1);
    const at::Tensor allowed = models::segment_attention_mask(segments);
    const at::Tensor additive = models::attention_mask_for(AttentionKernel::sdpa, allowed, dtype);
    auto kept = [&](const at::Tensor& mask) {
      auto tracker = memory::Tracker::create();
      at::Tensor out;
      {
        memory::TrackingGuard on(tracker);
        memory::PhaseScope fw(memory::Phase::forward);
        out = models::causal_attention(q, k, v, AttentionKernel::sdpa, mask);
      }
      return tracker->live_bytes();
    };
    const int64_t unmasked = kept(at::Tensor()), with_bool = kept(allowed), with_additive = kept(additive);
    const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
    EXPECT_EQ(with_bool - unmasked, B * T * T * e);      // the bool mask converted on this call, kept
    EXPECT_EQ(with_additive, unmasked);                  // the caller's mask itself
    EXPECT_LT(with_bool - unmasked, B * H * T * T * e);  // not the probabilities (the math kernel's)
    // and the masked kernel computes what the explicit one does
    const at::Tensor a = models::causal_attention(q, k, v, AttentionKernel::sdpa, additive).to(at::kFloat);
    const at::Tensor b = models::causal_attention(q, k, v, AttentionKernel::explicit_softmax, allowed).to(at::kFloat);
    EXPECT_LE((a - b).abs().max().item<double>(), dtype == at::kFloat ? 1e-5 : 2e-2);
  }
}
