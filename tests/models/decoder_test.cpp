// The decoder models: sizes and Hugging Face names, the custom RMSNorm and rotary Functions against
// plain autograd, causality, and unchanged gradients under every checkpointing policy and the
// chunked loss.
#include <gtest/gtest.h>

#include <torch/csrc/autograd/autograd.h>

#include <cmath>

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
  c.tie_embeddings = arch == "gpt2";  // frugal's GPT-2 recipes tie it
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
  EXPECT_LE((qr.norm(2, -1) - q.norm(2, -1)).abs().max().item<double>(), 1e-5);    // a rotation
  EXPECT_LE((qr.select(2, 0) - q.select(2, 0)).abs().max().item<double>(), 1e-6);  // position 0: identity
  // Plain version: y = x cos + rotate_half(x) sin
  const at::Tensor inv = at::pow(10000.0, at::arange(0, 8, 2, at::kFloat) / 8.0).reciprocal();
  const at::Tensor emb = at::cat({at::outer(at::arange(7, at::kFloat), inv), at::outer(at::arange(7, at::kFloat), inv)}, -1);
  auto plain = [&](const at::Tensor& x) { return x * emb.cos() + at::cat({-x.narrow(-1, 4, 4), x.narrow(-1, 0, 4)}, -1) * emb.sin(); };
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
    EXPECT_NO_THROW(
        checkpoint::checkpoint(chain[0].forward, x, chain[0].params, checkpoint::CheckpointOptions().strict(true).strict_rtol(0))
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
      EXPECT_EQ(ae.block_plain - a.block_plain, B * c.n_heads * T * (T * static_cast<int64_t>(c10::elementSize(dtype)) - 4));
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

TEST(Decoder, RotaryFrequenciesFollowTheirScalingFormulas) {
  const int64_t hd = 16;
  const double theta = 5000;
  models::RopeScaling r;
  const at::Tensor plain = models::rotary_inv_freq(hd, theta, r, 64, 64).to(at::kDouble);
  for (int64_t i = 0; i < hd / 2; ++i) EXPECT_NEAR(plain[i].item<double>(), std::pow(theta, -2.0 * i / hd), 1e-6);
  r.type = "linear";
  r.factor = 4;
  EXPECT_TRUE(at::allclose(models::rotary_inv_freq(hd, theta, r, 64, 64).to(at::kDouble), plain / 4));
  // llama3, each frequency by its wavelength against orig / low (slowed), orig / high (kept), between (blended)
  r.type = "llama3";
  r.factor = 8;
  r.low_freq_factor = 1;
  r.high_freq_factor = 4;
  r.original_max_position_embeddings = 64;
  const at::Tensor l3 = models::rotary_inv_freq(hd, theta, r, 256, 256).to(at::kDouble);
  int slowed = 0, kept = 0, blended = 0;
  for (int64_t i = 0; i < hd / 2; ++i) {
    const double f = plain[i].item<double>(), wavelength = 2 * M_PI / f;
    double want;
    if (wavelength > 64.0 / 1) {
      want = f / 8, ++slowed;
    } else if (wavelength < 64.0 / 4) {
      want = f, ++kept;
    } else {
      const double s = (64.0 / wavelength - 1) / (4 - 1);
      want = (1 - s) * f / 8 + s * f, ++blended;
    }
    EXPECT_NEAR(l3[i].item<double>(), want, 1e-6 * want) << i;
  }
  EXPECT_GT(slowed, 0);
  EXPECT_GT(kept, 0);
  EXPECT_GT(blended, 0);
  // dynamic: the default frequencies within max_seq_len, refused by name beyond it
  r = models::RopeScaling();
  r.type = "dynamic";
  r.factor = 2;
  EXPECT_TRUE(at::equal(models::rotary_inv_freq(hd, theta, r, 64, 64), models::rotary_inv_freq(hd, theta, {}, 64, 64)));
  try {
    models::rotary_inv_freq(hd, theta, r, 64, 65);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("dynamic"), std::string::npos) << e.what();
  }
}

TEST(Decoder, ActivationsFollowTheirFormulas) {
  // One GPT-2 block with zero attention output weights isolates the MLP: logits' difference
  // between gelu and gelu_tanh models with the same weights is the activations' difference.
  auto c = tiny("gpt2");
  c.n_layers = 1;
  torch::manual_seed(0);
  auto erf = models::make_decoder(c);
  c.activation = "gelu_tanh";
  auto tanh = models::make_decoder(c);
  {
    at::NoGradGuard no_grad;
    auto a = erf->named_parameters(), b = tanh->named_parameters();
    for (const auto& item : a) b[item.key()].copy_(item.value());
  }
  const at::Tensor tokens = at::randint(0, c.vocab_size, {1, 8}, at::kLong);
  at::NoGradGuard no_grad;
  const double diff = (erf->logits(tokens) - tanh->logits(tokens)).abs().max().item<double>();
  EXPECT_GT(diff, 0.0);   // a different function ...
  EXPECT_LT(diff, 1e-2);  // ... close to the same one
  const at::Tensor x = at::linspace(-4, 4, 101, at::kDouble);
  const at::Tensor tanh_ref = 0.5 * x * (1 + at::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x.pow(3))));
  EXPECT_TRUE(at::allclose(at::gelu(x, "tanh"), tanh_ref, 1e-12, 1e-12));
}

TEST(Decoder, DecodingWithTheCacheGivesTheWholeSequencesLogits) {
  DecoderConfig l = tiny("llama");  // GQA (4 heads, 2 kv heads)
  l.explicit_head_dim = 10;
  l.attention_bias = l.mlp_bias = true;
  l.rope_scaling.type = "llama3";
  l.rope_scaling.factor = 8;
  l.rope_scaling.original_max_position_embeddings = 8;
  DecoderConfig g = tiny("gpt2");
  g.tie_embeddings = false;
  g.activation = "gelu_tanh";
  for (auto c : {l, g}) {
    for (models::AttentionKernel kernel : models::available_attention_kernels()) {
      SCOPED_TRACE(c.arch + " " + models::attention_kernel_name(kernel));
      c.attention = kernel;
      torch::manual_seed(0);
      auto m = models::make_decoder(c);
      {
        at::NoGradGuard no_grad;
        for (auto& p : m->parameters()) p.normal_(0, 0.2);
      }
      const at::Tensor tokens = at::randint(0, c.vocab_size, {2, 12}, at::kLong);
      at::Tensor whole;
      {
        at::NoGradGuard no_grad;
        whole = m->logits(tokens);  // (2, 12, V)
      }
      // one token at a time, then in uneven pieces
      for (const std::vector<int64_t>& pieces : {std::vector<int64_t>(12, 1), std::vector<int64_t>{5, 1, 4, 2}}) {
        models::KVCache cache;
        std::vector<at::Tensor> parts;
        int64_t at_pos = 0;
        for (int64_t n : pieces) {
          parts.push_back(m->logits_with_cache(tokens.narrow(1, at_pos, n), cache));
          at_pos += n;
        }
        EXPECT_EQ(cache.length, 12);
        ASSERT_EQ(static_cast<int64_t>(cache.keys.size()), c.n_layers);
        EXPECT_EQ(cache.keys[0].sizes(), (std::vector<int64_t>{2, c.n_kv_heads, 12, c.head_dim()}));
        const at::Tensor stepped = at::cat(parts, 1);
        EXPECT_FALSE(stepped.requires_grad());
        EXPECT_LT((stepped - whole).abs().max().item<double>(), 1e-5);
      }
    }
  }
}
