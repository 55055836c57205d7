// Mixed precision: the autocast state frugal sets and re-enters, checkpointed regions and the chunked
// loss recomputing under the forward's state, and bf16 training numerics against fp32.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sched.h>

#include <torch/csrc/autograd/autograd.h>
#include <torch/torch.h>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/checkpoint.h"
#include "frugal/checkpoint/policy.h"
#include "frugal/checkpoint/selective.h"
#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/models/decoder.h"

using namespace frugal;
using precision::AutocastGuard;
using precision::AutocastState;

namespace {

const AutocastState kBf16 = AutocastState::compute(c10::kCPU, at::kBFloat16);

double max_rel_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor d = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max();
  return d.item<double>() / std::max(b.to(at::kDouble).abs().max().item<double>(), 1e-30);
}

models::DecoderConfig small_llama() {
  models::DecoderConfig c;
  c.vocab_size = 96;
  c.dim = 64;
  c.n_layers = 3;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 160;
  c.max_seq_len = 32;
  c.tie_embeddings = true;
  return c;
}

// The loss and every parameter's gradient of one forward (under `state`) and backward (outside it).
struct TrainPass {
  double loss = 0;
  std::vector<at::Tensor> grads;
};
TrainPass run(const models::DecoderConfig& c, const checkpoint::CheckpointPolicy& policy, const AutocastState& state, bool chunked) {
  torch::manual_seed(3);
  auto model = models::make_decoder(c);
  model->set_checkpointing(policy);
  torch::manual_seed(4);
  const at::Tensor x = torch::randint(0, c.vocab_size, {4, 24}), y = torch::randint(0, c.vocab_size, {4, 24});
  at::Tensor loss;
  {
    AutocastGuard on(state);
    loss = model->loss(x, y, models::LossOptions().chunked(chunked).chunk_size(40));
  }
  loss.backward();
  TrainPass r;
  r.loss = loss.item<double>();
  for (const auto& p : model->parameters()) r.grads.push_back(p.grad().clone());
  return r;
}

}  // namespace

TEST(Autocast, GuardSetsAndRestoresTheThreadsState) {
  const AutocastState before = AutocastState::current();
  EXPECT_FALSE(before.enabled());
  {
    AutocastGuard on(kBf16);
    EXPECT_EQ(AutocastState::current(), kBf16);
    EXPECT_EQ(AutocastState::current().describe(), "cpu bf16");
    EXPECT_FALSE(AutocastState::current().cache);
    const at::Tensor a = torch::randn({8, 8}), b = torch::randn({8, 8});
    EXPECT_EQ(at::mm(a, b).scalar_type(), at::kBFloat16);  // products in bf16
    EXPECT_EQ((a + b).scalar_type(), at::kFloat);          // everything else as it was
    EXPECT_EQ(precision::compute_dtype_for(a), at::kBFloat16);
    {
      AutocastGuard off(AutocastState::off());
      EXPECT_EQ(at::mm(a, b).scalar_type(), at::kFloat);
      EXPECT_EQ(precision::compute_dtype_for(a), at::kFloat);
    }
    EXPECT_EQ(AutocastState::current(), kBf16);
  }
  EXPECT_EQ(AutocastState::current(), before);
  EXPECT_EQ(AutocastState::current().describe(), "off");
  EXPECT_FALSE(AutocastState::compute(c10::kCPU, at::kFloat).enabled());
  EXPECT_THROW(AutocastState::compute(c10::kCPU, at::kDouble), c10::Error);
}

TEST(Autocast, FastBf16NamesItsReason) {
  std::string why;
  const bool fast = precision::fast_bf16(c10::kCPU, &why);
  EXPECT_FALSE(why.empty());
  EXPECT_NE(why.find(fast ? "has" : "neither"), std::string::npos) << why;
}

// bf16 compute on the CPU sizes LibTorch's pool to the cores this process may use and OpenBLAS's
// to one thread, and puts both back; fp32 compute changes nothing.
TEST(Autocast, ComputeThreadsFollowThePrecisionAndAreRestored) {
  cpu_set_t set;
  CPU_ZERO(&set);
  ASSERT_EQ(::sched_getaffinity(0, sizeof(set), &set), 0);
  const int cores = CPU_COUNT(&set), before = at::get_num_threads();
  using GetThreads = int (*)();
  const auto blas = reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const int blas_before = blas ? blas() : 0;
  {
    precision::ComputeThreadsGuard fp32(c10::kCPU, at::kFloat);
    EXPECT_EQ(at::get_num_threads(), before);
    EXPECT_TRUE(fp32.describe().empty());
    if (blas) {
      EXPECT_EQ(blas(), blas_before);
    }
  }
  {
    precision::ComputeThreadsGuard bf16(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(at::get_num_threads(), std::max(before, cores));
    if (blas) {
      EXPECT_EQ(blas(), 1);
    }
    EXPECT_EQ(bf16.describe().empty(), before >= cores && (!blas || blas_before <= 1)) << bf16.describe();
  }
  EXPECT_EQ(at::get_num_threads(), before);
  if (blas) {
    EXPECT_EQ(blas(), blas_before);
  }
  {
    ::setenv("FRUGAL_NUM_THREADS", "1", 1);  // a launcher's share caps the pool
    precision::ComputeThreadsGuard shared(c10::kCPU, at::kBFloat16);
    EXPECT_EQ(at::get_num_threads(), before);
    ::unsetenv("FRUGAL_NUM_THREADS");
  }
}

// The recompute of a checkpointed region runs under the forward's autocast state even though
// backward() is called outside it: the gradients equal the plain run's under autocast, bit for
// bit, and differ from an fp32 run's (so the comparison can tell the two precisions apart).
TEST(Autocast, CheckpointedRegionRecomputesUnderTheForwardsState) {
  torch::manual_seed(0);
  const at::Tensor w1 = torch::randn({48, 32}).requires_grad_(), w2 = torch::randn({32, 48}).requires_grad_();
  const at::Tensor x0 = torch::randn({6, 32});
  auto region = [&](const at::Tensor& x) { return at::linear(at::gelu(at::linear(x, w1)), w2) + x; };
  auto grads = [&](bool checkpointed, const AutocastState& state) {
    w1.mutable_grad() = at::Tensor();
    w2.mutable_grad() = at::Tensor();
    const at::Tensor x = x0.clone().requires_grad_();
    at::Tensor y;
    {
      AutocastGuard on(state);
      y = checkpointed ? checkpoint::checkpoint(checkpoint::UnaryFn(region), x, {w1, w2},
                                                checkpoint::CheckpointOptions().strict(true).strict_rtol(0))
                       : region(x);
    }
    EXPECT_EQ(y.scalar_type(), at::kFloat);  // the residual keeps the output fp32: dtype alone cannot tell
    y.pow(2).sum().backward();
    return std::vector<at::Tensor>{x.grad(), w1.grad(), w2.grad()};
  };
  const auto plain = grads(false, kBf16), ckpt = grads(true, kBf16), fp32 = grads(false, AutocastState::off());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(at::equal(plain[i], ckpt[i])) << "gradient " << i << ": " << max_rel_diff(ckpt[i], plain[i]);
    EXPECT_GT(max_rel_diff(plain[i], fp32[i]), 1e-4) << "gradient " << i << " is the fp32 one";
  }
}

// The decoder's blocks (every policy) and the chunked loss: under autocast, checkpointing changes
// nothing (1e-6: the same products in the same precision), and bf16 stays near fp32 (loss within
// 1%, each gradient within 5% of its largest element).
TEST(Autocast, DecoderGradientsMatchThePlainRunAndStayNearFp32) {
  const auto c = small_llama();
  const TrainPass plain = run(c, checkpoint::CheckpointPolicy::none(), kBf16, false);
  const TrainPass fp32 = run(c, checkpoint::CheckpointPolicy::none(), AutocastState::off(), false);
  EXPECT_NEAR(plain.loss, fp32.loss, 0.01 * fp32.loss);
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    EXPECT_LT(max_rel_diff(plain.grads[i], fp32.grads[i]), 0.05) << "parameter " << i;
    EXPECT_EQ(plain.grads[i].scalar_type(), at::kFloat);  // gradients accumulate in the parameters' fp32
  }
  for (const char* policy : {"full", "every_2", "selective"}) {
    for (bool chunked : {false, true}) {
      SCOPED_TRACE(std::string(policy) + (chunked ? " chunked" : ""));
      const TrainPass r = run(c, checkpoint::CheckpointPolicy::parse(policy), kBf16, chunked);
      EXPECT_NEAR(r.loss, plain.loss, 1e-5 * plain.loss);
      for (size_t i = 0; i < r.grads.size(); ++i) {
        EXPECT_LT(max_rel_diff(r.grads[i], plain.grads[i]), chunked ? 2e-2 : 1e-6) << "parameter " << i;
      }
    }
  }
}

// The chunked loss fixes its products' dtype in forward: its gradients are the same whether
// backward() runs inside or outside autocast, and near the plain head's under autocast.
TEST(Autocast, ChunkedLossUsesTheForwardsPrecisionInBackward) {
  torch::manual_seed(1);
  const at::Tensor h0 = torch::randn({50, 32}), w0 = torch::randn({70, 32}) * 0.2;
  const at::Tensor t = torch::randint(0, 70, {50});
  auto grads = [&](bool backward_inside, bool chunked) {
    const at::Tensor h = h0.clone().requires_grad_(), w = w0.clone().requires_grad_();
    std::optional<AutocastGuard> on(std::in_place, kBf16);
    at::Tensor loss = chunked ? loss::chunked_cross_entropy(h, w, at::Tensor(), t, loss::ChunkedCrossEntropyOptions().chunk_size(16))
                              : at::cross_entropy_loss(at::linear(h, w).to(at::kFloat), t);
    if (!backward_inside) on.reset();
    loss.backward();
    return std::vector<at::Tensor>{loss.detach(), h.grad(), w.grad()};
  };
  const auto outside = grads(false, true), inside = grads(true, true), plain = grads(false, false);
  for (size_t i = 0; i < outside.size(); ++i) {
    EXPECT_TRUE(at::equal(outside[i], inside[i])) << i;
    EXPECT_LT(max_rel_diff(outside[i], plain[i]), 2e-2) << i;
  }
  EXPECT_EQ(outside[1].scalar_type(), at::kFloat);
}
