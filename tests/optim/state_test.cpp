// Low-memory optimizer state: code maps, blockwise round-trip error, bytes per parameter, state kept
// in memory-mapped files or host memory equal to in-memory state, state dicts across precisions,
// state loaded from a lazy source (checked first, then one parameter at a time), stochastic
// rounding, and training quality close to fp32 state.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <limits>

#include "frugal/checkpoint/policy.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/transformer_block.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/quantize.h"
#include "frugal/optim/state_buffer.h"
#include "../support/common.h"

#include <torch/nn/modules/container/modulelist.h>

using namespace frugal;
using namespace frugal::optim;

namespace {

using frugal::testing::max_param_diff;

// Mostly large tensors: three Linear layers (plus small biases).
struct Mlp : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  explicit Mlp(uint64_t seed, int64_t d = 128) {
    torch::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(d, 2 * d));
    b = register_module("b", torch::nn::Linear(2 * d, 2 * d));
    c = register_module("c", torch::nn::Linear(2 * d, d));
  }
  at::Tensor loss(const at::Tensor& x) { return (c(at::gelu(b(at::gelu(a(x))))) - x.flip(1)).pow(2).mean(); }
};

std::vector<at::Tensor> inputs(int n) {
  torch::manual_seed(99);
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(at::randn({32, 128}));
  return out;
}

double run_steps(Mlp& m, Optimizer& opt, const std::vector<at::Tensor>& xs) {
  double last = 0;
  for (const auto& x : xs) {
    at::Tensor loss = m.loss(x);
    last = loss.item<double>();
    opt.backward(loss);
    opt.step();
    opt.zero_grad();
  }
  return last;
}

OptimizerOptions adamw(StatePrecision p, StatePlacement where = StatePlacement::device) {
  return OptimizerOptions().lr(3e-3).weight_decay(0.01).state(StateOptions().precision(p).placement(where));
}

}  // namespace

TEST(CodeMap, PropertiesOfTheDynamicMaps) {
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) {
      SCOPED_TRACE(std::to_string(bits) + (is_signed ? " signed" : " unsigned"));
      const at::Tensor map = dynamic_code_map(is_signed, bits);
      ASSERT_EQ(map.numel(), 1 << bits);
      EXPECT_TRUE(at::equal(map, std::get<0>(map.sort())));                         // sorted
      EXPECT_EQ(std::get<1>(at::unique_consecutive(map, false, true)).numel(), 0);  // no repeats
      EXPECT_FLOAT_EQ(map.max().item<float>(), 1.0f);
      if (is_signed) {
        EXPECT_FLOAT_EQ(map.min().item<float>(), -1.0f);
        EXPECT_EQ((map == 0).sum().item<int64_t>(), 1);
      } else {
        EXPECT_GT(map.min().item<float>(), 0.0f);  // a second moment never rounds to zero
        EXPECT_LT(map.min().item<float>(), bits == 8 ? 1e-6f : 1e-2f);
      }
      // Denser near zero: the gaps grow with the magnitude.
      const at::Tensor pos = map.masked_select(map > 0);
      const at::Tensor gaps = pos.narrow(0, 1, pos.numel() - 1) - pos.narrow(0, 0, pos.numel() - 1);
      EXPECT_LT(gaps[0].item<float>(), gaps[-1].item<float>());
    }
  }
}

TEST(CodeMap, BlockRoundTripErrorIsBoundedByTheMapsGaps) {
  torch::manual_seed(0);
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) {
      SCOPED_TRACE(std::to_string(bits) + (is_signed ? " signed" : " unsigned"));
      const int64_t block = bits == 8 ? 256 : 128, n = 10 * block + 37;  // a short last block too
      at::Tensor x = at::randn({n}) * at::exp(at::randn({n}));           // heavy-tailed, like moments
      if (!is_signed) x = x.pow(2);
      QuantizedBuffer q(n, bits, block, is_signed);
      q.store(0, n, x);
      const at::Tensor back = q.load(0, n);
      const at::Tensor map = dynamic_code_map(is_signed, bits);
      const double max_gap = (map.narrow(0, 1, map.numel() - 1) - map.narrow(0, 0, map.numel() - 1)).max().item<double>();
      const at::Tensor padded = at::cat({x, at::zeros({(n + block - 1) / block * block - n})});
      const at::Tensor absmax = std::get<0>(padded.view({-1, block}).abs().max(1));
      const at::Tensor err = (back - x).abs() / absmax.repeat_interleave(block).narrow(0, 0, n);
      EXPECT_LE(err.max().item<double>(), max_gap / 2 + 1e-6);
      EXPECT_TRUE(at::allclose(absmax, q.absmax()));
      EXPECT_EQ(q.bytes(), (bits == 8 ? 11 * block : 11 * block / 2) + 11 * 4);
    }
  }
}

TEST(OptimizerState, BytesPerParameterByPrecision) {
  const std::vector<std::pair<StatePrecision, double>> limits = {
      {StatePrecision::fp32, 8.0}, {StatePrecision::bf16, 4.0}, {StatePrecision::int8, 2.05}, {StatePrecision::int4, 1.1}};
  for (const auto& [precision, limit] : limits) {
    SCOPED_TRACE(precision_name(precision));
    Mlp m(1, 256);
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    auto tracker = memory::Tracker::create();
    memory::TrackingGuard on(tracker);
    Optimizer opt(m.named_parameters(), adamw(precision));
    run_steps(m, opt, {at::randn({8, 256})});
    const double by_tensors = static_cast<double>(opt.state_bytes()) / static_cast<double>(n);
    const double by_tracker =
        static_cast<double>(tracker->live_by_category()[static_cast<int>(memory::Category::optimizer_state)]) / static_cast<double>(n);
    EXPECT_LE(by_tensors, limit + 1e-9);
    EXPECT_GE(by_tensors, limit * 0.9);  // small tensors keep fp32, but the bulk is quantized
    EXPECT_NEAR(by_tracker, by_tensors, 0.01);
  }
}

TEST(OptimizerState, BytesFormulaEqualsWhatTheTrackerSees) {
  // state_bytes_for_parameter and shared_code_table_bytes (what the estimate adds up) against the
  // tracker, for every precision and placement: the same bytes, mapped files included.
  for (StatePrecision p : kAllStatePrecisions) {
    for (StatePlacement where : kAllStatePlacements) {
      SCOPED_TRACE(std::string(precision_name(p)) + " " + placement_name(where));
      Mlp m(1, 192);  // biases of 192 and 384 values keep fp32 state under the small-tensor rule
      auto tracker = memory::Tracker::create();
      memory::TrackingGuard on(tracker);
      OptimizerOptions o = adamw(p, where);
      o.state().mmap_dir(::testing::TempDir());
      std::vector<int64_t> numels;
      int64_t expected = 0, in_files = 0, largest_chunk = 0;
      for (const auto& t : m.parameters()) {
        numels.push_back(t.numel());
        const StateBufferBytes b = state_bytes_for_parameter(t.numel(), t.scalar_type(), o);
        expected += b.total;
        in_files += b.in_files;
        largest_chunk = std::max(largest_chunk, b.window);
      }
      {
        Optimizer opt(m.named_parameters(), o);
        run_steps(m, opt, {at::randn({8, 192})});
        const auto live = tracker->live_by_category();
        // File placement's files are not memory; the window's buffers are: kStateWindowSlots of
        // the largest chunk of one moment.
        const int64_t resident = where == StatePlacement::file ? expected - in_files + kStateWindowSlots * largest_chunk : expected;
        if (where == StatePlacement::file) {
          EXPECT_GT(largest_chunk, 0);
        }
        EXPECT_EQ(live[static_cast<int>(memory::Category::optimizer_state)], resident);
        EXPECT_EQ(opt.state_bytes(), expected);
        EXPECT_EQ(live[static_cast<int>(memory::Category::other)], shared_code_table_bytes(numels, o));
      }
      // Freed with the optimizer, the code tables too.
      EXPECT_EQ(tracker->live_by_category()[static_cast<int>(memory::Category::optimizer_state)], 0);
      EXPECT_EQ(tracker->live_by_category()[static_cast<int>(memory::Category::other)], 0);
    }
  }
  EXPECT_EQ(state_buffer_bytes(1000, StateOptions().precision(StatePrecision::int8)).total, 4000);  // small: fp32
  EXPECT_EQ(state_buffer_bytes(5000, StateOptions().precision(StatePrecision::int8)).total, 20 * 256 + 20 * 4);
  EXPECT_EQ(state_buffer_bytes(5000, StateOptions().precision(StatePrecision::int4).placement(StatePlacement::mmap)).in_files,
            40 * 128 / 2);
}

// Low-bit state says which tensors kept fp32: state_precision names it per parameter before the
// first update, and the state the updates made is held in that precision (biases, under 4096
// elements, keep fp32 moments; the weights hold codes and block scales).
TEST(OptimizerState, StatePrecisionNamesTheSmallTensorsFallback) {
  const auto xs = inputs(4);
  for (StatePrecision p : {StatePrecision::int8, StatePrecision::int4, StatePrecision::bf16}) {
    SCOPED_TRACE(precision_name(p));
    Mlp m(5);
    Optimizer opt(m.named_parameters(), adamw(p));
    const auto names = opt.parameter_names();
    const auto numels = opt.parameter_numels();
    std::vector<StatePrecision> before;
    for (size_t i = 0; i < names.size(); ++i) before.push_back(opt.state_precision(i));
    run_steps(m, opt, xs);
    const auto state = opt.state_dict();
    int fallbacks = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      SCOPED_TRACE(names[i]);
      const bool small = numels[i] < StateOptions().min_quantized_numel();
      const bool quantized = p != StatePrecision::bf16;
      EXPECT_EQ(before[i], quantized && small ? StatePrecision::fp32 : p);
      EXPECT_EQ(opt.state_precision(i), before[i]);
      const bool has_codes = state.count(names[i] + ".exp_avg.codes") == 1;
      EXPECT_EQ(has_codes, before[i] == StatePrecision::int8 || before[i] == StatePrecision::int4);
      if (!has_codes) {
        ASSERT_EQ(state.count(names[i] + ".exp_avg"), 1u);
        EXPECT_EQ(state.at(names[i] + ".exp_avg").scalar_type(), before[i] == StatePrecision::bf16 ? at::kBFloat16 : at::kFloat);
      }
      fallbacks += before[i] != p;
    }
    EXPECT_EQ(fallbacks, p == StatePrecision::bf16 ? 0 : 3);  // the three biases
  }
}

TEST(OptimizerState, MmapAndHostStateEqualInMemoryState) {
  const auto xs = inputs(20);
  for (StatePrecision p : {StatePrecision::fp32, StatePrecision::int8, StatePrecision::int4}) {
    SCOPED_TRACE(precision_name(p));
    Mlp ref(2), mapped(2), host(2);
    Optimizer o_ref(ref.named_parameters(), adamw(p)), o_map(mapped.named_parameters(), adamw(p, StatePlacement::mmap)),
        o_host(host.named_parameters(), adamw(p, StatePlacement::host));
    run_steps(ref, o_ref, xs);
    run_steps(mapped, o_map, xs);
    run_steps(host, o_host, xs);
    EXPECT_LE(max_param_diff(ref, mapped), 1e-6);
    EXPECT_LE(max_param_diff(ref, host), 1e-6);
  }
  // fp32 through the streamed path equals the plain fp32 update (and so torch::optim).
  Mlp plain(3), streamed(3);
  Optimizer o1(plain.named_parameters(), adamw(StatePrecision::fp32));
  Optimizer o2(streamed.named_parameters(), adamw(StatePrecision::fp32, StatePlacement::mmap));
  run_steps(plain, o1, xs);
  run_steps(streamed, o2, xs);
  EXPECT_LE(max_param_diff(plain, streamed), 1e-6);
}

TEST(OptimizerState, StateDictsRoundTripAcrossPrecisions) {
  const auto xs = inputs(16);
  const std::vector<at::Tensor> first(xs.begin(), xs.begin() + 8), second(xs.begin() + 8, xs.end());
  // int8 -> int8: exact continuation.
  Mlp straight(4), resumed(4);
  Optimizer o_straight(straight.named_parameters(), adamw(StatePrecision::int8));
  run_steps(straight, o_straight, first);
  TensorDict saved;
  for (const auto& [k, v] : o_straight.state_dict()) saved[k] = v.clone();
  EXPECT_TRUE(saved.count("a.weight.exp_avg.codes") && saved.count("a.weight.exp_avg_sq.absmax"));
  EXPECT_TRUE(saved.count("a.bias.exp_avg"));  // small tensors keep fp32 state
  {
    at::NoGradGuard g;
    auto src = straight.parameters(), dst = resumed.parameters();
    for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
  }
  Optimizer o_resumed(resumed.named_parameters(), adamw(StatePrecision::int8));
  o_resumed.load_state_dict(saved);
  const auto again = o_resumed.state_dict();
  for (const auto& [k, v] : saved) EXPECT_TRUE(at::equal(again.at(k), v)) << k;  // codes and scales exactly
  run_steps(straight, o_straight, second);
  run_steps(resumed, o_resumed, second);
  EXPECT_LE(max_param_diff(straight, resumed), 1e-6);

  // fp32 state into an 8-bit optimizer is quantized; 8-bit state into an fp32 one is decoded.
  Mlp f(5);
  Optimizer o_fp32(f.named_parameters(), adamw(StatePrecision::fp32));
  run_steps(f, o_fp32, first);
  Optimizer o_int8(f.named_parameters(), adamw(StatePrecision::int8));
  o_int8.load_state_dict(o_fp32.state_dict());
  const auto q = o_int8.state_dict();
  const at::Tensor m32 = o_fp32.state_dict().at("b.weight.exp_avg");
  Optimizer o_back(f.named_parameters(), adamw(StatePrecision::fp32));
  o_back.load_state_dict(q);
  const at::Tensor m_back = o_back.state_dict().at("b.weight.exp_avg");
  EXPECT_LE((m_back - m32).abs().max().item<double>(), 0.01 * m32.abs().max().item<double>());
  EXPECT_GT((m_back - m32).abs().max().item<double>(), 0.0);  // it really went through 8 bits
}

TEST(OptimizerState, StochasticRoundingMovesBf16ParametersBySmallUpdates) {
  torch::manual_seed(7);
  at::Tensor w_plain = at::ones({4096}, at::kBFloat16).requires_grad_();
  at::Tensor w_sr = at::ones({4096}, at::kBFloat16).requires_grad_();
  // SGD steps of 1e-4: below half of bf16's spacing at 1.0 (2^-8 = 0.0039).
  auto opts = OptimizerOptions().algorithm(Algorithm::sgd).lr(1e-4);
  ParamGroup g1{{"w"}, {w_plain}, std::nullopt, std::nullopt}, g2{{"w"}, {w_sr}, std::nullopt, std::nullopt};
  Optimizer plain({g1}, opts);
  Optimizer sr({g2}, OptimizerOptions(opts).algorithm(Algorithm::adamw).lr(1e-4).stochastic_rounding(true));
  // AdamW's first steps move each weight by about lr; 20 steps -> about 2e-3 in expectation.
  Optimizer rtn({ParamGroup{{"w"}, {w_plain}, std::nullopt, std::nullopt}}, OptimizerOptions().lr(1e-4));
  for (int i = 0; i < 20; ++i) {
    (w_plain.to(at::kFloat).sum()).backward();
    rtn.step();
    rtn.zero_grad();
    (w_sr.to(at::kFloat).sum()).backward();
    sr.step();
    sr.zero_grad();
  }
  EXPECT_EQ(w_plain.to(at::kFloat).mean().item<double>(), 1.0);  // round-to-nearest: stuck
  EXPECT_NEAR(w_sr.to(at::kFloat).mean().item<double>(), 1.0 - 20 * 1e-4, 3e-4);
  const at::Tensor x = at::full({10000}, 1.0f + 0.25f * 0.0078125f);  // a quarter of the way to the next bf16
  const double up = (stochastic_round_bf16(x).to(at::kFloat) > 1.0f).to(at::kFloat).mean().item<double>();
  EXPECT_NEAR(up, 0.25, 0.03);
}

TEST(OptimizerState, TrainingQualityCloseToFp32) {
  // A stack of Transformer blocks trained for 150 steps: 8-bit within 2%, 4-bit within 5%.
  auto run = [](StatePrecision p) {
    torch::manual_seed(11);
    std::vector<models::PreLNBlock> blocks;
    torch::nn::ModuleList list;
    for (int i = 0; i < 2; ++i) {
      blocks.emplace_back(64, 4);
      list->push_back(blocks.back());
    }
    Optimizer opt(list->named_parameters(), adamw(p));
    const auto chain = checkpoint::make_chain(blocks);
    torch::manual_seed(12);
    const at::Tensor target = at::randn({64, 64});
    double last = 0;
    for (int step = 0; step < 150; ++step) {
      const at::Tensor x = at::randn({4, 16, 64});
      at::Tensor loss = (checkpoint::run_chain(chain, x, checkpoint::CheckpointPolicy::none()) - x.matmul(target) * 0.1).pow(2).mean();
      if (step >= 140) last += loss.item<double>() / 10;
      opt.backward(loss);
      opt.step();
      opt.zero_grad();
    }
    return last;
  };
  const double fp32 = run(StatePrecision::fp32);
  EXPECT_NEAR(run(StatePrecision::int8) / fp32, 1.0, 0.02);
  EXPECT_NEAR(run(StatePrecision::int4) / fp32, 1.0, 0.05);
  EXPECT_NEAR(run(StatePrecision::bf16) / fp32, 1.0, 0.02);
}

TEST(CodeMap, FusedKernelMatchesTheTensorPath) {
  // The fused CPU step against the same step written with tensor operations on load()/store().
  torch::manual_seed(3);
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    const int64_t block = bits == 8 ? 256 : 128, n = 40 * block + 17;
    at::Tensor p1 = at::randn({n}), g = at::randn({n}) * 0.1;
    at::Tensor p2 = p1.clone();
    QuantizedBuffer m1(n, bits, block, true), v1(n, bits, block, false), m2(n, bits, block, true), v2(n, bits, block, false);
    const at::Tensor m0 = at::randn({n}) * 0.01, v0 = at::rand({n}) * 1e-4;
    for (auto* q : {&m1, &m2}) q->store(0, n, m0);
    for (auto* q : {&v1, &v2}) q->store(0, n, v0);
    const AdamStep h{1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - std::pow(0.9, 3), 1 - std::pow(0.999, 3), true};
    adam_step_quantized_cpu(h, p1.data_ptr<float>(), g.data_ptr<float>(), m1, v1, 0, n);
    at::Tensor m = m2.load(0, n), v = v2.load(0, n);
    p2.mul_(1 - h.lr * h.weight_decay);
    m.mul_(h.beta1).add_(g, 1 - h.beta1);
    v.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
    p2.addcdiv_(m, (v.sqrt() / std::sqrt(h.bias_correction2)).add_(h.eps), -h.lr / h.bias_correction1);
    m2.store(0, n, m);
    v2.store(0, n, v);
    EXPECT_LE((p1 - p2).abs().max().item<double>(), 1e-6);
    EXPECT_TRUE(at::allclose(m1.absmax(), m2.absmax(), 1e-6, 0));
    EXPECT_LE((m1.codes() != m2.codes()).sum().item<int64_t>(), m1.codes().numel() / 500);  // a rare tie at a boundary
    EXPECT_LE((v1.codes() != v2.codes()).sum().item<int64_t>(), v1.codes().numel() / 500);
  }
}

TEST(CodeMap, VectorKernelGivesTheSameBitsAsThePortableOne) {
  if (!quant_kernel_vectorized()) GTEST_SKIP() << "this processor has no AVX2: only the portable kernel runs here";
  torch::manual_seed(5);
  for (int bits : {8, 4}) {
    for (bool decoupled : {true, false}) {
      SCOPED_TRACE(std::to_string(bits) + (decoupled ? " adamw" : " adam"));
      const int64_t block = bits == 8 ? 256 : 128, n = 37 * block + 45;  // a short last block
      const at::Tensor p0 = at::randn({n}), g = at::randn({n}) * 0.1;
      // moments spanning several decades, some blocks all zero, and one non-finite gradient value
      at::Tensor m0 = at::randn({n}) * at::pow(10.0, -at::randint(0, 6, {n}).to(at::kFloat));
      at::Tensor v0 = at::rand({n}) * at::pow(10.0, -at::randint(0, 8, {n}).to(at::kFloat));
      m0.narrow(0, 2 * block, block).zero_();
      v0.narrow(0, 2 * block, block).zero_();
      at::Tensor g_bad = g.clone();
      g_bad[7 * block + 3] = std::numeric_limits<float>::quiet_NaN();
      for (const at::Tensor& grad : {g, g_bad}) {
        at::Tensor pa = p0.clone(), pb = p0.clone();
        QuantizedBuffer ma(n, bits, block, true), va(n, bits, block, false), mb(n, bits, block, true), vb(n, bits, block, false);
        for (auto* q : {&ma, &mb}) q->store(0, n, m0);
        for (auto* q : {&va, &vb}) q->store(0, n, v0);
        const AdamStep h{1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - std::pow(0.9, 4), 1 - std::pow(0.999, 4), decoupled};
        // two ranges, as the optimizer's chunks call it: [0, 5 blocks) and [5 blocks, n)
        for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 5 * block}, {5 * block, n}}) {
          adam_step_quantized_cpu(h, pa.data_ptr<float>() + b, grad.data_ptr<float>() + b, ma, va, b, e, QuantKernel::automatic);
          adam_step_quantized_cpu(h, pb.data_ptr<float>() + b, grad.data_ptr<float>() + b, mb, vb, b, e, QuantKernel::portable);
        }
        EXPECT_TRUE(at::equal(pa.isnan(), pb.isnan()));
        EXPECT_TRUE(at::equal(pa.nan_to_num(0), pb.nan_to_num(0)));
        EXPECT_TRUE(at::equal(ma.codes(), mb.codes()));
        EXPECT_TRUE(at::equal(va.codes(), vb.codes()));
        EXPECT_TRUE(at::equal(ma.absmax().nan_to_num(0), mb.absmax().nan_to_num(0)));
        EXPECT_TRUE(at::equal(va.absmax().nan_to_num(0), vb.absmax().nan_to_num(0)));
      }
    }
  }
}

TEST(CodeMap, FusedBf16StepIsTheFp32StepRoundedToNearest) {
  // A bf16 parameter and gradient through the fused kernel, rounded to nearest, against the fp32
  // kernel on the widened values followed by ATen's bf16 conversion: the same bits, codes and scales.
  torch::manual_seed(21);
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    const int64_t block = bits == 8 ? 256 : 128, n = 23 * block + 30;  // a short last block
    const at::Tensor pb = at::randn({n}).to(at::kBFloat16), gb = (at::randn({n}) * 0.1).to(at::kBFloat16);
    const at::Tensor m0 = at::randn({n}) * 0.01, v0 = at::rand({n}) * 1e-4;
    for (QuantKernel kernel : {QuantKernel::automatic, QuantKernel::portable}) {
      QuantizedBuffer m1(n, bits, block, true), v1(n, bits, block, false), m2(n, bits, block, true), v2(n, bits, block, false);
      for (auto* q : {&m1, &m2}) q->store(0, n, m0);
      for (auto* q : {&v1, &v2}) q->store(0, n, v0);
      const AdamStep h{1e-2, 0.9, 0.999, 1e-8, 0.01, 1 - std::pow(0.9, 2), 1 - std::pow(0.999, 2), true};
      at::Tensor p16 = pb.clone();
      adam_step_quantized_cpu(h, p16, gb, m1, v1, 0, n, Bf16Rounding{}, kernel);
      at::Tensor p32 = pb.to(at::kFloat);
      const at::Tensor g32 = gb.to(at::kFloat);
      adam_step_quantized_cpu(h, p32.data_ptr<float>(), g32.data_ptr<float>(), m2, v2, 0, n, kernel);
      EXPECT_TRUE(at::equal(p16, p32.to(at::kBFloat16)));
      EXPECT_GT((p16 != pb).sum().item<int64_t>(), n / 2);  // the step moved most parameters
      EXPECT_TRUE(at::equal(m1.codes(), m2.codes()));
      EXPECT_TRUE(at::equal(v1.codes(), v2.codes()));
      EXPECT_TRUE(at::equal(m1.absmax(), m2.absmax()));
    }
  }
}

TEST(CodeMap, FusedBf16StochasticRoundingIsUnbiasedAndTheSameInAnyChunking) {
  // Every value lands on one of the two bf16 neighbours of the exact fp32 result, on average on the
  // exact result, and the bits depend on the seed and the element only: not on how the range is
  // split into calls, nor on the kernel.
  const int64_t block = 128, n = 4096 * block;
  const at::Tensor pb = at::full({n}, 1.0).to(at::kBFloat16), gb = (at::randn({n}) * 1e-3).to(at::kBFloat16);
  const AdamStep h{1e-3, 0.9, 0.999, 1e-8, 0.0, 1 - 0.9, 1 - 0.999, true};  // a first step: each value moves by ~lr
  auto run = [&](std::vector<int64_t> cuts, QuantKernel kernel, uint64_t seed) {
    QuantizedBuffer m(n, 4, block, true), v(n, 4, block, false);
    at::Tensor p = pb.clone();
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int64_t b = cuts[i], e = cuts[i + 1];
      adam_step_quantized_cpu(h, p.narrow(0, b, e - b), gb.narrow(0, b, e - b), m, v, b, e, Bf16Rounding{true, seed}, kernel);
    }
    return p;
  };
  const at::Tensor whole = run({0, n}, QuantKernel::automatic, 7);
  EXPECT_TRUE(at::equal(whole, run({0, 5 * block, 77 * block, n}, QuantKernel::automatic, 7)));
  EXPECT_TRUE(at::equal(whole, run({0, n}, QuantKernel::portable, 7)));
  EXPECT_FALSE(at::equal(whole, run({0, n}, QuantKernel::automatic, 8)));
  // the exact result, from the fp32 kernel
  QuantizedBuffer m(n, 4, block, true), v(n, 4, block, false);
  at::Tensor exact = pb.to(at::kFloat);
  const at::Tensor g32 = gb.to(at::kFloat);
  adam_step_quantized_cpu(h, exact.data_ptr<float>(), g32.data_ptr<float>(), m, v, 0, n);
  const at::Tensor got = whole.to(at::kFloat);
  // bf16 neighbours of values just below 1 are 2^-8 apart, just above 2^-7
  const at::Tensor nearest = exact.to(at::kBFloat16).to(at::kFloat);
  const at::Tensor spacing = at::where(exact < 1.0, at::full_like(exact, 1.0 / 256), at::full_like(exact, 1.0 / 128));
  EXPECT_LE(((got - exact).abs() - spacing).max().item<double>(), 0.0);  // never further than one spacing
  EXPECT_TRUE(at::equal(at::isfinite(got), at::ones_like(got, at::kBool)));
  const double bias = ((got - exact) / spacing).mean().item<double>();
  EXPECT_NEAR(bias, 0.0, 0.005);  // ~0.0004 standard error over 2^19 values
  // each value is ~lr = 0.26 (below 1) or 0.13 (above) of a spacing from its nearest bf16: about a
  // fifth of them round away from it, as they would not with round-to-nearest
  EXPECT_GT((got != nearest).to(at::kFloat).mean().item<double>(), 0.1);
}

namespace {

// A state dict behind a StateDictSource that records every load and hands out fresh tensors (as a
// file reader does), remembering each one weakly so a test can see whether it is still alive.
struct RecordingSource {
  TensorDict dict;
  std::vector<std::string> param_names;
  std::vector<std::string> calls;
  std::vector<std::pair<std::string, c10::weak_intrusive_ptr<c10::StorageImpl>>> handed_out;  // parameter, data
  int64_t alive_from_other_parameters = 0;                                                    // seen at load calls

  RecordingSource(TensorDict d, std::vector<std::string> names) : dict(std::move(d)), param_names(std::move(names)) {}

  std::string parameter_of(const std::string& entry) const {
    std::string best;
    for (const auto& p : param_names) {
      if (entry.rfind(p + ".", 0) == 0 && p.size() > best.size()) best = p;
    }
    return best;
  }
  StateDictSource source() {
    StateDictSource s;
    for (const auto& [k, v] : dict) s.entries.emplace_back(k, v.sizes().vec());
    s.load = [this](const std::string& name) {
      calls.push_back(name);
      const std::string param = parameter_of(name);
      for (const auto& [p, data] : handed_out) alive_from_other_parameters += p != param && !data.expired();
      at::Tensor t = dict.at(name).clone();
      handed_out.emplace_back(param, t.storage().getWeakStorageImpl());
      return t;
    };
    return s;
  }
};

std::vector<std::string> names_of(torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& item : m.named_parameters()) out.push_back(item.key());
  return out;
}

}  // namespace

// Damaged values are refused by entry name before anything is restored: a moment of an integer type
// (it would convert silently), a non-finite value, a negative second moment or scale, a step that is
// not a positive integer, codes of another type. Nothing of the state is left half-restored.
TEST(OptimizerState, LoadStateRefusesDamagedValues) {
  const auto xs = inputs(4);
  Mlp trained(6);
  Optimizer o_trained(trained.named_parameters(), adamw(StatePrecision::int8));
  run_steps(trained, o_trained, xs);
  TensorDict saved;
  for (const auto& [k, v] : o_trained.state_dict()) saved[k] = v.clone();
  ASSERT_TRUE(saved.count("a.bias.exp_avg") && saved.count("a.weight.exp_avg.codes"));  // dense (small) and 8-bit

  auto refused = [&](const std::string& key, const at::Tensor& value, const std::string& expected) {
    SCOPED_TRACE(key + ": " + expected);
    TensorDict dict = saved;
    dict[key] = value;
    Mlp m(6);
    Optimizer o(m.named_parameters(), adamw(StatePrecision::int8));
    try {
      o.load_state_dict(dict);
      ADD_FAILURE() << "loaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("state entry " + key + " " + expected), std::string::npos) << e.what();
    }
    EXPECT_TRUE(o.state_dict().empty()) << "a refused state must leave none restored";
  };
  const at::Tensor m1 = saved.at("a.bias.exp_avg");
  refused("a.bias.exp_avg", m1.to(at::kInt), "is Int; a moment must be floating point");
  at::Tensor nan = m1.clone();
  nan[7] = std::numeric_limits<float>::quiet_NaN();
  refused("a.bias.exp_avg", nan, "holds a value that is not finite");
  at::Tensor inf = saved.at("a.bias.exp_avg_sq").clone();
  inf[0] = std::numeric_limits<float>::infinity();
  refused("a.bias.exp_avg_sq", inf, "holds a value that is not finite");
  refused("a.bias.exp_avg_sq", saved.at("a.bias.exp_avg_sq") - 1.0, "holds a negative value; a second moment cannot be negative");
  refused("a.bias.step", at::scalar_tensor(-3, at::kLong), "is -3; a step count must be from 1 to 2^53");
  refused("a.bias.step", at::scalar_tensor(0, at::kLong), "is 0; a step count must be from 1 to 2^53");
  refused("a.bias.step", at::scalar_tensor(2.5, at::kFloat), "is Float; a step count must be an integer");
  refused("a.weight.exp_avg.codes", saved.at("a.weight.exp_avg.codes").to(at::kInt), "is Int; quantized codes must be U8");
  at::Tensor scales = saved.at("a.weight.exp_avg.absmax").clone();
  scales[0] = std::numeric_limits<float>::quiet_NaN();
  refused("a.weight.exp_avg.absmax", scales, "holds a value that is not finite");
  refused("a.weight.exp_avg_sq.absmax", -saved.at("a.weight.exp_avg_sq.absmax") - 1.0,
          "holds a negative value; block scales cannot be negative");
  refused("a.weight.exp_avg.absmax", saved.at("a.weight.exp_avg.absmax").to(at::kDouble), "is Double; block scales must be F32");

  // The undamaged state loads (a bf16 moment is a moment too: precisions convert on load).
  TensorDict ok = saved;
  ok["a.bias.exp_avg"] = m1.to(at::kBFloat16);
  Mlp m(6);
  Optimizer o(m.named_parameters(), adamw(StatePrecision::int8));
  o.load_state_dict(ok);
  EXPECT_FALSE(o.state_dict().empty());
}

TEST(OptimizerState, LoadStateChecksEverythingFirstThenLoadsOneParameterAtATime) {
  const auto xs = inputs(4);
  Mlp trained(6);
  Optimizer o_trained(trained.named_parameters(), adamw(StatePrecision::int8));
  run_steps(trained, o_trained, xs);
  TensorDict saved;
  for (const auto& [k, v] : o_trained.state_dict()) saved[k] = v.clone();

  // Each mistake is found from the names and shapes alone: no load is called.
  auto refused = [&](TensorDict dict, const std::string& expected, bool repeat_first = false) {
    SCOPED_TRACE(expected);
    Mlp m(6);
    Optimizer o(m.named_parameters(), adamw(StatePrecision::int8));
    RecordingSource r(std::move(dict), names_of(m));
    StateDictSource s = r.source();
    if (repeat_first) s.entries.push_back(s.entries.front());
    try {
      o.load_state(s);
      ADD_FAILURE() << "loaded";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
    }
    EXPECT_TRUE(r.calls.empty());
  };
  TensorDict bad = saved;
  bad["a.bias.exp_avg"] = at::zeros({3});
  refused(bad, "Wrong shapes: a.bias.exp_avg [3] vs parameter [256]");
  bad = saved;
  bad["a.weight.exp_avg.absmax"] = at::zeros({7});
  refused(bad, "a.weight.exp_avg: 32768 codes and 7 scales fit no 8- or 4-bit blocks of 32768 values");
  bad = saved;
  bad["c.weight.step"] = at::zeros({2}, at::kLong);
  refused(bad, "c.weight.step [2] vs a single count");
  bad = saved;
  bad["d.weight.exp_avg"] = at::zeros({1});
  refused(bad, "Unknown entries: d.weight.exp_avg");
  bad = saved;
  bad.erase("b.weight.exp_avg_sq.codes");
  refused(bad, "Missing: b.weight.exp_avg/exp_avg_sq");
  bad = saved;
  bad.erase("c.bias.step");
  bad.erase("c.bias.exp_avg");
  bad.erase("c.bias.exp_avg_sq");
  refused(bad, "Missing: c.bias");
  refused(saved, "Repeated entries: a.bias.exp_avg", /*repeat_first=*/true);

  // A good source: every entry loaded once, parameter by parameter, each parameter's tensors
  // dropped before the next one's are loaded; the state is restored exactly.
  Mlp m(6);
  Optimizer o(m.named_parameters(), adamw(StatePrecision::int8));
  RecordingSource r(saved, names_of(m));
  o.load_state(r.source());
  std::vector<std::string> loaded = r.calls, expected;
  for (const auto& [k, v] : saved) expected.push_back(k);
  std::sort(loaded.begin(), loaded.end());
  EXPECT_EQ(loaded, expected);
  std::vector<std::string> order;  // parameters in the order their entries were loaded
  for (const auto& c : r.calls) {
    if (order.empty() || order.back() != r.parameter_of(c)) order.push_back(r.parameter_of(c));
  }
  EXPECT_EQ(order, names_of(m));  // one run per parameter, in the optimizer's order
  EXPECT_EQ(r.alive_from_other_parameters, 0);
  for (const auto& [p, data] : r.handed_out) EXPECT_TRUE(data.expired()) << p;
  const auto again = o.state_dict();
  ASSERT_EQ(again.size(), saved.size());
  for (const auto& [k, v] : saved) EXPECT_TRUE(at::equal(again.at(k), v)) << k;

  // A load that fails part-way leaves no half-restored state; one of the wrong shape is refused.
  RecordingSource failing(saved, names_of(m));
  StateDictSource s = failing.source();
  s.load = [&](const std::string& name) {
    if (name.rfind("b.", 0) == 0) throw std::runtime_error("disk gone");
    return failing.dict.at(name);
  };
  EXPECT_THROW(o.load_state(s), std::runtime_error);
  EXPECT_TRUE(o.state_dict().empty());
  EXPECT_EQ(o.state_bytes(), 0);
  s.load = [&](const std::string& name) { return name == "c.weight.exp_avg.codes" ? at::zeros({5}, at::kByte) : failing.dict.at(name); };
  try {
    o.load_state(s);
    ADD_FAILURE() << "loaded";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("c.weight.exp_avg.codes was listed as [32768] but loaded as [5]"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(o.state_dict().empty());
}

TEST(OptimizerState, MappedStateIsReservedWhenMadeAndAFullFolderIsNamed) {
  // RLIMIT_FSIZE stands in for a full disk (no root needed): a reservation past it fails at once,
  // where a sparse file would be made and the process killed by SIGBUS at its first write.
  const at::Tensor param = at::zeros({64, 96});
  const std::string dir = ::testing::TempDir();
  const StateOptions o = StateOptions().precision(StatePrecision::fp32).placement(StatePlacement::mmap).mmap_dir(dir);
  EXPECT_NO_THROW(StateBuffer(param, true, o));
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto* previous = ::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string what;
  try {
    StateBuffer b(param, true, o);
  } catch (const std::runtime_error& e) {
    what = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, previous);
  EXPECT_NE(what.find("cannot reserve 24576 bytes in " + dir), std::string::npos) << what;
  EXPECT_EQ(what.find('\n'), std::string::npos) << what;
}
