// The decoder models: sizes and Hugging Face names, the custom RMSNorm and rotary Functions against
// plain autograd, causality, and unchanged gradients under every checkpointing policy and the
// chunked loss.
#include <gtest/gtest.h>

#include <torch/csrc/autograd/autograd.h>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/models/decoder.h"

using namespace frugal;
using models::DecoderConfig;

namespace {

DecoderConfig tiny(const std::string& arch = "llama") {
  DecoderConfig c;
  c.arch = arch;
  c.vocab_size = 97;
  c.dim = 32;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = arch == "llama" ? 2 : 4;
  c.ffn_dim = arch == "llama" ? 88 : 128;
  c.max_seq_len = 64;
  return c;
}

int64_t count(const models::Decoder& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}

}  // namespace

TEST(Decoder, SizesAndHuggingFaceNames) {
  for (bool tied : {false, true}) {
    auto c = tiny();
    c.tie_embeddings = tied;
    auto m = models::make_decoder(c);
    EXPECT_EQ(count(m), c.param_count());
    const auto names = m->named_parameters();
    EXPECT_TRUE(names.contains("model.embed_tokens.weight"));
    EXPECT_TRUE(names.contains("model.layers.2.self_attn.k_proj.weight"));
    EXPECT_EQ(names["model.layers.0.self_attn.k_proj.weight"].sizes(), (std::vector<int64_t>{16, 32}));
    EXPECT_TRUE(names.contains("model.layers.1.mlp.gate_proj.weight"));
    EXPECT_TRUE(names.contains("model.layers.1.post_attention_layernorm.weight"));
    EXPECT_TRUE(names.contains("model.norm.weight"));
    EXPECT_EQ(names.contains("lm_head.weight"), !tied);
  }
  auto g = models::make_decoder(tiny("gpt2"));
  EXPECT_EQ(count(g), tiny("gpt2").param_count());
  EXPECT_TRUE(g->named_parameters().contains("transformer.h.1.attn.c_attn.weight"));
  auto bad = tiny();
  bad.n_kv_heads = 3;
  EXPECT_THROW(models::make_decoder(bad), std::invalid_argument);
}

TEST(Decoder, RMSNormFunctionMatchesPlainAutograd) {
  torch::manual_seed(0);
  models::RMSNorm norm(16, 1e-5);
  {
    at::NoGradGuard g;
    norm->weight.uniform_(0.5, 1.5);
  }
  const at::Tensor x = at::randn({3, 5, 16}).requires_grad_();
  const at::Tensor gy = at::randn({3, 5, 16});
  const auto ours = torch::autograd::grad({norm->forward(x)}, {x, norm->weight}, {gy});
  const at::Tensor plain = x * (x.pow(2).mean(-1, true) + 1e-5).rsqrt() * norm->weight;
  const auto ref = torch::autograd::grad({plain}, {x, norm->weight}, {gy});
  EXPECT_LE((ours[0] - ref[0]).abs().max().item<double>(), 1e-5);
  EXPECT_LE((ours[1] - ref[1]).abs().max().item<double>(), 1e-5);
}

TEST(Decoder, RotaryFunctionMatchesPlainAutogradAndKeepsNorms) {
  torch::manual_seed(1);
  const at::Tensor q = at::randn({2, 4, 7, 8}).requires_grad_(), k = at::randn({2, 4, 7, 8}).requires_grad_();
  const auto [qr, kr] = models::apply_rotary(q, k, 10000.0);
  EXPECT_LE((qr.norm(2, -1) - q.norm(2, -1)).abs().max().item<double>(), 1e-5);  // a rotation
  EXPECT_LE((qr.select(2, 0) - q.select(2, 0)).abs().max().item<double>(), 1e-6);  // position 0: identity
  // Plain version: y = x cos + rotate_half(x) sin
  const at::Tensor inv = at::pow(10000.0, at::arange(0, 8, 2, at::kFloat) / 8.0).reciprocal();
  const at::Tensor emb = at::cat({at::outer(at::arange(7, at::kFloat), inv), at::outer(at::arange(7, at::kFloat), inv)}, -1);
  auto plain = [&](const at::Tensor& x) {
    return x * emb.cos() + at::cat({-x.narrow(-1, 4, 4), x.narrow(-1, 0, 4)}, -1) * emb.sin();
  };
  EXPECT_LE((qr - plain(q)).abs().max().item<double>(), 1e-5);
  const at::Tensor g = at::randn({2, 4, 7, 8});
  const auto ours = torch::autograd::grad({qr}, {q}, {g});
  const auto ref = torch::autograd::grad({plain(q)}, {q}, {g});
  EXPECT_LE((ours[0] - ref[0]).abs().max().item<double>(), 1e-5);
}

namespace {

struct LossAndGrads {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

// The model (seeded) with the given attention kernel: causal, and its loss and gradients unchanged
// by every checkpointing policy (the recompute runs the same kernel) and the chunked loss. Returns
// the plain run's loss and gradients.
LossAndGrads expect_causal_and_unchanged(const char* arch, models::AttentionKernel kernel) {
  torch::manual_seed(2);
  auto c = tiny(arch);
  c.attention = kernel;
  auto m = models::make_decoder(c);
  const at::Tensor tokens = at::randint(0, 97, {2, 12}, at::kLong);
  at::Tensor changed = tokens.clone();
  changed.index_put_({0, 11}, (tokens.index({0, 11}) + 1) % 97);
  {
    at::NoGradGuard g;
    const at::Tensor a = m->logits(tokens), b = m->logits(changed);
    EXPECT_LE((a.narrow(1, 0, 11) - b.narrow(1, 0, 11)).abs().max().item<double>(), 1e-5);  // the past ignores the future
    EXPECT_GT((a.select(1, 11) - b.select(1, 11)).abs().max().item<double>(), 1e-6);
  }
  const at::Tensor targets = at::randint(0, 97, {2, 12}, at::kLong);
  auto grads = [&](const models::LossOptions& opt) {
    for (auto& p : m->parameters()) p.mutable_grad().reset();
    const at::Tensor loss = m->loss(tokens, targets, opt);
    loss.backward();
    std::vector<at::Tensor> g;
    for (auto& p : m->parameters()) g.push_back(p.grad().clone());
    return std::make_pair(loss.item<double>(), g);
  };
  m->set_checkpointing(checkpoint::CheckpointPolicy::none());
  const auto ref = grads(models::LossOptions());
  EXPECT_NEAR(ref.first, std::log(97.0), 0.5);  // near-uniform at initialisation
  for (const char* policy : {"full", "every_2", "selective"}) {
    m->set_checkpointing(checkpoint::CheckpointPolicy::parse(policy));
    for (bool chunked : {false, true}) {
      SCOPED_TRACE(std::string(policy) + (chunked ? " chunked" : ""));
      const auto got = grads(models::LossOptions().chunked(chunked).chunk_size(5));
      EXPECT_NEAR(got.first, ref.first, 1e-5);
      for (size_t i = 0; i < got.second.size(); ++i) {
        EXPECT_LE((got.second[i] - ref.second[i]).abs().max().item<double>(), 1e-5) << "parameter " << i;
      }
    }
  }
  return {ref.first, ref.second};
}

}  // namespace

TEST(Decoder, CausalAndUnchangedByCheckpointingOrChunkedLoss) {
  for (const char* arch : {"llama", "gpt2"}) {
    SCOPED_TRACE(arch);
    expect_causal_and_unchanged(arch, models::AttentionKernel::explicit_softmax);
  }
}

// The same with sdpa, whose loss and gradients equal the explicit kernel's to 1e-5 (fp32; llama
// with grouped-query heads, 4 over 2).
TEST(Decoder, SdpaIsCausalUnchangedByCheckpointingAndEqualToExplicit) {
  const std::string why = models::attention_kernel_unavailable(models::AttentionKernel::sdpa);
  if (!why.empty()) GTEST_SKIP() << "sdpa " << why;
  for (const char* arch : {"llama", "gpt2"}) {
    SCOPED_TRACE(arch);
    const LossAndGrads sdpa = expect_causal_and_unchanged(arch, models::AttentionKernel::sdpa);
    const LossAndGrads expl = expect_causal_and_unchanged(arch, models::AttentionKernel::explicit_softmax);
    EXPECT_NEAR(sdpa.loss, expl.loss, 1e-5);
    ASSERT_EQ(sdpa.grads.size(), expl.grads.size());
    for (size_t i = 0; i < sdpa.grads.size(); ++i) {
      EXPECT_LE((sdpa.grads[i] - expl.grads[i]).abs().max().item<double>(), 1e-5) << "parameter " << i;
    }
    // The recompute reproduces the forward's values exactly (strict mode compares them).
    auto c = tiny(arch);
    c.attention = models::AttentionKernel::sdpa;
    auto m = models::make_decoder(c);
    const at::Tensor x = m->embed(at::randint(0, 97, {2, 12}, at::kLong)).detach().requires_grad_();
    const auto chain = m->chain();
    EXPECT_NO_THROW(checkpoint::checkpoint(chain[0].forward, x, chain[0].params,
                                           checkpoint::CheckpointOptions().strict(true).strict_rtol(0))
                        .sum()
                        .backward());
  }
}

TEST(Decoder, RunsInBFloat16) {
  auto m = models::make_decoder(tiny());
  m->to(at::kBFloat16);
  const at::Tensor tokens = at::randint(0, 97, {1, 8}, at::kLong);
  const at::Tensor loss = m->loss(tokens, tokens, models::LossOptions().chunked(true));
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
  loss.backward();
  EXPECT_EQ(m->named_parameters()["model.embed_tokens.weight"].grad().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
}

TEST(Decoder, ParameterNumelsAndKeptBytesMatchTheModel) {
  for (const char* arch : {"llama", "gpt2"}) {
    for (bool tied : {true, false}) {
      SCOPED_TRACE(std::string(arch) + (tied ? " tied" : " untied"));
      models::DecoderConfig c;
      c.arch = arch;
      c.vocab_size = 96;
      c.dim = 32;
      c.n_layers = 2;
      c.n_heads = 4;
      c.n_kv_heads = std::string(arch) == "llama" ? 2 : 4;
      c.ffn_dim = 64;
      c.max_seq_len = 16;
      c.tie_embeddings = tied;
      auto model = models::make_decoder(c);
      std::vector<int64_t> real;
      for (const auto& p : model->parameters()) real.push_back(p.numel());
      EXPECT_EQ(models::parameter_numels(c), real);
      int64_t sum = 0;
      for (int64_t n : real) sum += n;
      EXPECT_EQ(sum, c.param_count());
    }
  }
  // What one plain llama block keeps, measured with the tracker, against block_plain.
  models::DecoderConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 64;
  c.max_seq_len = 16;
  auto model = models::make_decoder(c);
  const at::Tensor x = model->embed(at::randint(0, 64, {2, 16}, at::kLong)).detach().requires_grad_();
  const auto chain = model->chain();
  auto tracker = memory::Tracker::create();
  at::Tensor y;
  {
    memory::TrackingGuard on(tracker);
    memory::PhaseScope fw(memory::Phase::forward);
    y = chain[0].forward(x);
  }
  const int64_t kept = tracker->live_by_category()[static_cast<int>(memory::Category::activation)];
  const auto a = models::decoder_activation_bytes(c, 2, 16, at::kFloat, models::LossOptions());
  // block_plain counts the block's input (kept by its first norm, made outside here); the measured
  // bytes count its output instead (the next block's input): the same size.
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(a.block_plain), 1.0, 0.05)
      << "measured " << kept << " vs formula " << a.block_plain;
}

namespace {

// What one plain block keeps for backward, measured with the tracker: from the end of the block's
// forward, what its forward left allocated (its output included, which stands in for its input:
// block_plain counts the input, made outside here, and the two are the same size).
int64_t measured_block_kept(const models::DecoderConfig& c, int64_t batch, int64_t seq, at::ScalarType dtype) {
  torch::manual_seed(3);
  auto model = models::make_decoder(c, at::TensorOptions().dtype(dtype));
  const at::Tensor x = model->embed(at::randint(0, c.vocab_size, {batch, seq}, at::kLong)).detach().requires_grad_();
  const auto chain = model->chain();
  auto tracker = memory::Tracker::create();
  at::Tensor y;
  {
    memory::TrackingGuard on(tracker);
    memory::PhaseScope fw(memory::Phase::forward);
    y = chain[0].forward(x);
  }
  return tracker->live_by_category()[static_cast<int>(memory::Category::activation)];
}

}  // namespace

// With sdpa a block keeps no (T, T) matrix: what the tracker measures is exactly block_plain, for
// llama with grouped-query heads and gpt2, in fp32 and bf16 (the log-sum-exp stays fp32).
TEST(Decoder, SdpaKeptBytesEqualTheFormula) {
  const std::string why = models::attention_kernel_unavailable(models::AttentionKernel::sdpa);
  if (!why.empty()) GTEST_SKIP() << "sdpa " << why;
  for (const char* arch : {"llama", "gpt2"}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(arch) + " " + c10::toString(dtype));
      auto c = tiny(arch);
      c.n_layers = 1;
      c.attention = models::AttentionKernel::sdpa;
      const int64_t B = 2, T = 48;
      const auto a = models::decoder_activation_bytes(c, B, T, dtype, models::LossOptions());
      EXPECT_EQ(measured_block_kept(c, B, T, dtype), a.block_plain);
      // the explicit kernel's formula has the (B, H, T, T) probabilities on top
      auto e = c;
      e.attention = models::AttentionKernel::explicit_softmax;
      const auto ae = models::decoder_activation_bytes(e, B, T, dtype, models::LossOptions());
      EXPECT_EQ(ae.block_plain - a.block_plain,
                B * c.n_heads * T * (T * static_cast<int64_t>(c10::elementSize(dtype)) - 4));
    }
  }
}

// The explicit kernel's block keeps exactly block_plain too (the probabilities, the rotary tables,
// the norms' statistics), on every LibTorch.
TEST(Decoder, ExplicitKeptBytesEqualTheFormula) {
  for (const char* arch : {"llama", "gpt2"}) {
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(arch) + " " + c10::toString(dtype));
      auto c = tiny(arch);
      c.n_layers = 1;
      const int64_t B = 2, T = 48;
      EXPECT_EQ(measured_block_kept(c, B, T, dtype), models::decoder_activation_bytes(c, B, T, dtype, models::LossOptions()).block_plain);
    }
  }
}
