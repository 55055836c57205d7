// Generation (greedy, top-k, top-p, seeds, EOS, option checks), the KV-cache interface, and evaluation's windows.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "frugal/models/evaluate.h"
#include "frugal/models/generation.h"
#include "../support/common.h"

using namespace frugal;

namespace {

using frugal::testing::greedy;

models::Decoder tiny_model(const std::string& arch = "llama") {
  at::manual_seed(7);
  models::DecoderConfig c;
  c.arch = arch;
  c.vocab_size = 97;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = arch == "llama" ? 2 : 4;
  c.ffn_dim = arch == "llama" ? 64 : 128;
  c.max_seq_len = 48;
  auto m = models::make_decoder(c);
  // Larger weights than the default init, so the distribution is far from uniform.
  at::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.mul_(3);
  return m;
}

const std::vector<int32_t> kPrompt = {3, 14, 15, 92, 65};

}  // namespace

TEST(Generation, CachedLogitsEqualFullLogits) {
  for (const std::string arch : {"llama", "gpt2"}) {
    auto m = tiny_model(arch);
    m->eval();
    at::NoGradGuard no_grad;
    const at::Tensor ids = at::randint(0, 97, {2, 9}, at::kLong);  // (B, T)
    const at::Tensor full = m->logits(ids);                        // (B, T, V)
    models::KVCache cache;
    const at::Tensor a = m->logits_with_cache(ids.narrow(1, 0, 6), cache);  // (B, 6, V)
    EXPECT_EQ(cache.length, 6);
    const at::Tensor b = m->logits_with_cache(ids.narrow(1, 6, 1), cache);
    const at::Tensor c = m->logits_with_cache(ids.narrow(1, 7, 2), cache);
    EXPECT_EQ(cache.length, 9);
    EXPECT_TRUE(at::allclose(at::cat({a, b, c}, 1), full, 1e-5, 1e-5)) << arch;
  }
}

TEST(Generation, GreedyIsDeterministicAndIgnoresTheSeed) {
  auto m = tiny_model();
  const auto a = models::generate_ids(*m, kPrompt, greedy(12).seed(1));
  const auto b = models::generate_ids(*m, kPrompt, greedy(12).seed(2));
  EXPECT_EQ(a.tokens.size(), 12u);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.stop, models::GenerationStop::token_limit);
  // Greedy is the argmax of the full forward at every step.
  std::vector<int64_t> seq(kPrompt.begin(), kPrompt.end());
  at::NoGradGuard no_grad;
  for (int32_t t : a.tokens) {
    const at::Tensor logits = m->logits(at::tensor(seq, at::kLong).unsqueeze(0));  // (1, T, V)
    EXPECT_EQ(logits.select(1, -1).argmax().item<int64_t>(), t);
    seq.push_back(t);
  }
}

TEST(Generation, SamplingIsDeterministicForASeed) {
  auto m = tiny_model();
  const auto opts = models::GenerationOptions().max_new_tokens(16).temperature(1.5);
  const auto a = models::generate_ids(*m, kPrompt, models::GenerationOptions(opts).seed(5));
  const auto b = models::generate_ids(*m, kPrompt, models::GenerationOptions(opts).seed(5));
  EXPECT_EQ(a.tokens, b.tokens);
  bool differs = false;
  for (uint64_t s = 6; s < 12 && !differs; ++s)
    differs = models::generate_ids(*m, kPrompt, models::GenerationOptions(opts).seed(s)).tokens != a.tokens;
  EXPECT_TRUE(differs);
}

TEST(Generation, TopKOneTopPTinyAndTinyTemperatureAreGreedy) {
  auto m = tiny_model();
  const auto g = models::generate_ids(*m, kPrompt, greedy(10)).tokens;
  for (uint64_t seed : {0, 1, 2}) {
    const auto sampled = models::GenerationOptions().max_new_tokens(10).temperature(2.0).seed(seed);
    EXPECT_EQ(models::generate_ids(*m, kPrompt, models::GenerationOptions(sampled).top_k(1)).tokens, g);
    EXPECT_EQ(models::generate_ids(*m, kPrompt, models::GenerationOptions(sampled).top_p(1e-9)).tokens, g);
    EXPECT_EQ(models::generate_ids(*m, kPrompt, models::GenerationOptions(sampled).temperature(1e-300)).tokens, g);
  }
}

TEST(Generation, TopPKeepsTheSmallestSetReachingP) {
  // probabilities 0.5, 0.3, 0.15, 0.05: p = 0.8 keeps two, p = 0.81 keeps three.
  const at::Tensor logits = at::log(at::tensor({0.05, 0.5, 0.15, 0.3}, at::kFloat));
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  for (auto [p, allowed] : std::vector<std::pair<double, std::vector<int64_t>>>{{0.8, {1, 3}}, {0.81, {1, 3, 2}}, {0.3, {1}}}) {
    std::set<int64_t> seen;
    const auto o = models::GenerationOptions().temperature(1).top_p(p);
    for (int i = 0; i < 300; ++i) seen.insert(models::choose_next_token(logits, o, gen));
    EXPECT_EQ(seen, std::set<int64_t>(allowed.begin(), allowed.end())) << p;
  }
}

TEST(Generation, StopsAtEndOfSequenceAndAtTheContext) {
  auto m = tiny_model();
  const auto g = models::generate_ids(*m, kPrompt, greedy(10)).tokens;
  // The last new id of the greedy run as EOS: generation stops just before its first appearance.
  const size_t k = static_cast<size_t>(std::find(g.begin(), g.end(), g.back()) - g.begin());
  const auto stopped = models::generate_ids(*m, kPrompt, greedy(10).eos_ids({99, g.back()}));
  EXPECT_EQ(stopped.stop, models::GenerationStop::end_of_sequence);
  EXPECT_EQ(stopped.tokens, std::vector<int32_t>(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(k)));
  const auto full = models::generate_ids(*m, kPrompt, greedy(1000));
  EXPECT_EQ(full.stop, models::GenerationStop::context_full);
  EXPECT_EQ(full.tokens.size() + kPrompt.size(), 48u);
  EXPECT_EQ(models::generate_ids(*m, kPrompt, greedy(0)).tokens.size(), 0u);
}

TEST(Generation, RefusesNonsense) {
  auto m = tiny_model();
  for (double t : std::vector<double>{-1.0, NAN, INFINITY})
    EXPECT_THROW(models::generate_ids(*m, kPrompt, greedy(2).temperature(t)), std::invalid_argument);
  for (double p : std::vector<double>{0.0, -0.5, 1.5, NAN})
    EXPECT_THROW(models::generate_ids(*m, kPrompt, greedy(2).top_p(p)), std::invalid_argument);
  EXPECT_THROW(models::generate_ids(*m, kPrompt, greedy(2).top_k(-1)), std::invalid_argument);
  EXPECT_THROW(models::generate_ids(*m, {}, greedy(2)), std::invalid_argument);
  EXPECT_THROW(models::generate_ids(*m, {97}, greedy(2)), std::invalid_argument);
}

TEST(Evaluate, WindowsAndTheMeanOverPredictedTokens) {
  const auto w = models::cut_windows({1, 2, 3, 4, 5, 6, 7}, 3);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[2], std::vector<int32_t>({7}));
  auto m = tiny_model();
  std::vector<int32_t> ids;
  for (int i = 0; i < 40; ++i) ids.push_back((i * 37 + 11) % 97);
  const auto windows = models::cut_windows(ids, 16);  // 16, 16, 8 ids: 15 + 15 + 7 predicted
  const auto one = models::score_windows(*m, windows, 1);
  const auto three = models::score_windows(*m, windows, 3, true);
  EXPECT_EQ(one.tokens, 37);
  EXPECT_EQ(three.tokens, 37);
  EXPECT_NEAR(one.loss_sum, three.loss_sum, 1e-4);
  ASSERT_TRUE(three.last_logits.defined());
  EXPECT_EQ(three.last_logits.sizes(), at::IntArrayRef({1, 8, 97}));
  // One window's mean is the model's own loss with labels shifted by one.
  const auto first = models::score_windows(*m, {windows[0]}, 1);
  const at::Tensor x = at::tensor(std::vector<int64_t>(ids.begin(), ids.begin() + 16), at::kLong).unsqueeze(0);  // (1, 16)
  at::NoGradGuard no_grad;
  m->eval();
  const double ref = m->loss(x.narrow(1, 0, 15), x.narrow(1, 1, 15)).item<double>();
  EXPECT_NEAR(first.mean_loss(), ref, 1e-5);
  EXPECT_THROW(models::score_windows(*m, {{1, 200}}, 1), std::invalid_argument);
}
