// Checkpointing is safe to switch on: dropout masks match (RNG), BatchNorm statistics end exactly
// as in the plain run (buffers), a recompute that differs is caught (checks), sequential segments
// and nested regions work, and the edge cases (non-differentiable outputs, a second backward,
// recurrent models over time segments) behave.
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/rnn.h>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/checkpoint/sequential.h"

using namespace frugal;
using checkpoint::CheckpointOptions;

namespace {

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return g;
}

void clear_grads(const std::vector<at::Tensor>& params) {
  for (auto p : params) p.mutable_grad().reset();
}

double max_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    EXPECT_EQ(a[i].defined(), b[i].defined()) << "gradient " << i;
    if (a[i].defined() && b[i].defined()) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  }
  return m;
}

// A block with dropout in the middle: x (N, 16) -> (N, 16)
struct DropoutBlock {
  torch::nn::Linear a{16, 32}, b{32, 16};
  std::vector<at::Tensor> params() {
    auto p = a->parameters();
    for (auto& t : b->parameters()) p.push_back(t);
    return p;
  }
  at::Tensor operator()(const at::Tensor& x) { return b(at::dropout(at::relu(a(x)), 0.5, /*train=*/true)); }
};

// Conv2d -> BatchNorm2d -> ReLU, x: (N, in, H, W) -> (N, out, H, W)
struct ConvBNReLUImpl : torch::nn::Cloneable<ConvBNReLUImpl> {
  int64_t in, out;
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  ConvBNReLUImpl(int64_t in_channels, int64_t out_channels) : in(in_channels), out(out_channels) { reset(); }
  void reset() override {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
    bn = register_module("bn", torch::nn::BatchNorm2d(out));
  }
  at::Tensor forward(const at::Tensor& x) { return at::relu(bn(conv(x))); }
};
TORCH_MODULE(ConvBNReLU);

// A Linear that counts its forward calls.
struct CountedLinearImpl : torch::nn::Module {
  torch::nn::Linear inner{nullptr};
  int* calls;
  CountedLinearImpl(torch::nn::Linear lin, int* counter) : calls(counter) { inner = register_module("inner", lin); }
  at::Tensor forward(const at::Tensor& x) {
    ++*calls;
    return inner(x);
  }
};
TORCH_MODULE(CountedLinear);

}  // namespace

TEST(CheckpointRng, DropoutGivesThePlainRunsGradients) {
  torch::manual_seed(0);
  DropoutBlock block;
  const at::Tensor x = at::randn({8, 16}).requires_grad_();
  auto params = block.params();

  torch::manual_seed(42);
  const at::Tensor y_plain = block(x);
  y_plain.pow(2).sum().backward();
  const auto plain = grads_of(params);
  const at::Tensor gx = x.grad().clone();
  const at::Tensor next_draw_plain = at::rand({4});

  clear_grads(params);
  x.mutable_grad().reset();
  torch::manual_seed(42);
  const at::Tensor y = checkpoint::checkpoint([&](const at::Tensor& in) { return block(in); }, x, params);
  EXPECT_TRUE(at::equal(y, y_plain));
  y.pow(2).sum().backward();
  EXPECT_EQ(max_diff(grads_of(params), plain), 0.0);
  EXPECT_TRUE(at::equal(x.grad(), gx));
  // The recompute put the generator back: training draws the same numbers afterwards.
  EXPECT_TRUE(at::equal(at::rand({4}), next_draw_plain));
}

TEST(CheckpointRng, WithoutPreservingTheStateTheMasksDiffer) {
  torch::manual_seed(0);
  DropoutBlock block;
  const at::Tensor x = at::randn({8, 16});
  auto params = block.params();
  torch::manual_seed(42);
  block(x).pow(2).sum().backward();
  const auto plain = grads_of(params);
  clear_grads(params);
  torch::manual_seed(42);
  checkpoint::checkpoint([&](const at::Tensor& in) { return block(in); }, x, params, CheckpointOptions().preserve_rng_state(false))
      .pow(2)
      .sum()
      .backward();
  EXPECT_GT(max_diff(grads_of(params), plain), 1e-3);
}

namespace {

std::shared_ptr<torch::nn::SequentialImpl> copy_of(const torch::nn::Sequential& net) {
  return std::dynamic_pointer_cast<torch::nn::SequentialImpl>(net->clone());
}

void expect_same_buffers(torch::nn::Module& a, torch::nn::Module& b) {
  const auto ba = a.named_buffers(), bb = b.named_buffers();
  ASSERT_EQ(ba.size(), bb.size());
  ASSERT_GT(ba.size(), 0u);
  for (const auto& item : ba) {
    EXPECT_TRUE(at::equal(item.value(), bb[item.key()])) << item.key() << " differs";
  }
}

}  // namespace

TEST(CheckpointBuffers, BatchNorm2dStatisticsEqualThePlainRunBitForBit) {
  torch::manual_seed(0);
  auto plain = torch::nn::Sequential(ConvBNReLU(3, 8), ConvBNReLU(8, 8));
  auto ckpt = copy_of(plain);
  const at::Tensor x = at::randn({4, 3, 10, 10});
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE(step);
    const at::Tensor y_plain = plain->forward(x);
    y_plain.pow(2).mean().backward();
    at::Tensor h = checkpoint::checkpoint(ckpt->ptr<ConvBNReLUImpl>(0), x);
    const at::Tensor y = checkpoint::checkpoint(ckpt->ptr<ConvBNReLUImpl>(1), h);
    EXPECT_TRUE(at::equal(y, y_plain));
    y.pow(2).mean().backward();
    expect_same_buffers(*plain, *ckpt);
    EXPECT_LE(max_diff(grads_of(ckpt->parameters()), grads_of(plain->parameters())), 1e-6);
  }
  // The running statistics really moved, three times.
  const auto nbt = plain->named_buffers()["0.bn.num_batches_tracked"];
  EXPECT_EQ(nbt.item<int64_t>(), 3);
}

TEST(CheckpointBuffers, BatchNorm1dInsideSequentialSegments) {
  torch::manual_seed(1);
  auto plain = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::BatchNorm1d(32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                                     torch::nn::BatchNorm1d(32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  auto ckpt = copy_of(plain);
  const at::Tensor x = at::randn({10, 16});
  for (int step = 0; step < 2; ++step) {
    plain->forward(x).pow(2).mean().backward();
    checkpoint::checkpoint_sequential(torch::nn::Sequential(ckpt), 3, x).pow(2).mean().backward();
    expect_same_buffers(*plain, *ckpt);
    EXPECT_LE(max_diff(grads_of(ckpt->parameters()), grads_of(plain->parameters())), 1e-6);
  }
}

TEST(CheckpointBuffers, WithoutDeclaringThemTheStatisticsAreUpdatedTwice) {
  // The negative control: a generic region that does not declare its buffers.
  torch::manual_seed(2);
  torch::nn::BatchNorm1d bn(8);
  torch::nn::Linear lin(8, 8);
  const at::Tensor x = at::randn({6, 8});
  checkpoint::checkpoint([&](const at::Tensor& in) { return bn(lin(in)); }, x, lin->parameters()).sum().backward();
  EXPECT_EQ(bn->num_batches_tracked.item<int64_t>(), 2);
}

TEST(CheckpointChecks, ShapeChangeInTheRecomputeIsCaughtByDefault) {
  at::Tensor w = at::randn({4, 4}).requires_grad_();
  int calls = 0;
  auto y = checkpoint::checkpoint(
      [&](const at::Tensor& in) {
        ++calls;
        return calls == 1 ? in.mm(w) : in.mm(w).sum(0);
      },
      at::randn({3, 4}), {w}, CheckpointOptions().name("shifty"));
  try {
    y.sum().backward();
    FAIL() << "the changed shape was not caught";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("'shifty' output 0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[3, 4]"), std::string::npos) << msg;
  }
}

TEST(CheckpointChecks, StrictModeCatchesANonDeterministicRegion) {
  at::Tensor w = at::randn({4, 4}).requires_grad_();
  // Random numbers without a preserved RNG state: the recompute draws different ones.
  auto region = [&](const at::Tensor& in) { return in.mm(w) * at::rand({4}); };
  const at::Tensor x = at::randn({3, 4});
  // Not strict: the shapes match, the mistake goes through.
  checkpoint::checkpoint(region, x, {w}, CheckpointOptions().preserve_rng_state(false)).sum().backward();
  // Strict: caught, naming the region and the output.
  auto y = checkpoint::checkpoint(region, x, {w}, CheckpointOptions().preserve_rng_state(false).strict(true).name("noisy block"));
  try {
    y.sum().backward();
    FAIL() << "strict mode let a different recompute through";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("'noisy block' output 0 has different values"), std::string::npos) << msg;
  }
  // Strict with the RNG preserved: the recompute is identical and passes.
  checkpoint::checkpoint(region, x, {w}, CheckpointOptions().strict(true)).sum().backward();
}

TEST(CheckpointSequential, MatchesThePlainRunAndRunsTheLastSegmentOnce) {
  torch::manual_seed(3);
  int calls_first = 0, calls_last = 0;
  auto plain = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh(),
                                     torch::nn::Linear(8, 2));
  auto ckpt = copy_of(plain);
  // Count calls of the first and last module through functional wrappers.
  torch::nn::Sequential counted;
  counted->push_back(CountedLinear(torch::nn::Linear(ckpt->ptr<torch::nn::LinearImpl>(0)), &calls_first));
  for (int i = 1; i <= 3; ++i) counted->push_back(*(ckpt->begin() + i));
  counted->push_back(CountedLinear(torch::nn::Linear(ckpt->ptr<torch::nn::LinearImpl>(4)), &calls_last));
  const at::Tensor x = at::randn({5, 8}).requires_grad_();
  const at::Tensor y_plain = plain->forward(x);
  y_plain.sum().backward();
  const at::Tensor gx = x.grad().clone();
  x.mutable_grad().reset();

  // 5 modules in 2 segments: modules 0-1 checkpointed, 2-4 plain.
  const at::Tensor y = checkpoint::checkpoint_sequential(counted, 2, x);
  EXPECT_TRUE(at::equal(y, y_plain));
  y.sum().backward();
  EXPECT_EQ(calls_first, 2);
  EXPECT_EQ(calls_last, 1);
  EXPECT_LE((x.grad() - gx).abs().max().item<double>(), 1e-6);
  EXPECT_LE(max_diff(grads_of(ckpt->parameters()), grads_of(plain->parameters())), 1e-6);
  EXPECT_THROW(checkpoint::checkpoint_sequential(counted, 0, x), c10::Error);
  EXPECT_THROW(checkpoint::checkpoint_sequential(counted, 6, x), c10::Error);
}

TEST(CheckpointNesting, ARegionInsideARegion) {
  torch::manual_seed(4);
  at::Tensor w1 = at::randn({6, 6}).requires_grad_(), w2 = at::randn({6, 6}).requires_grad_();
  const at::Tensor x = at::randn({2, 6}).requires_grad_();
  auto inner = [&](const at::Tensor& h) { return at::tanh(h.mm(w2)); };
  auto outer = [&](const at::Tensor& h) { return checkpoint::checkpoint(inner, at::sin(h.mm(w1)), {w2}); };
  at::tanh(at::sin(x.mm(w1)).mm(w2)).pow(2).sum().backward();
  const auto plain = grads_of({x, w1, w2});
  clear_grads({x, w1, w2});
  checkpoint::checkpoint(outer, x, {w1, w2}).pow(2).sum().backward();
  EXPECT_LE(max_diff(grads_of({x, w1, w2}), plain), 1e-6);
}

TEST(CheckpointEdges, NonTensorArgumentsAndOutputsThatDoNotRequireGrad) {
  torch::manual_seed(5);
  at::Tensor w = at::randn({5, 5}).requires_grad_();
  const double scale = 0.5;  // non-tensor arguments travel in the closure
  const std::string mode = "tanh";
  auto fn = [&, scale, mode](const std::vector<at::Tensor>& in) {
    at::Tensor h = in[0].mm(w) * scale;
    h = mode == "tanh" ? at::tanh(h) : h;
    return std::vector<at::Tensor>{h, h.argmax(1), h.detach() * 2};
  };
  const at::Tensor x = at::randn({3, 5});
  auto plain = fn({x});
  plain[0].sum().backward();
  const auto gw = grads_of({w});
  clear_grads({w});
  auto outs = checkpoint::checkpoint(fn, {x}, {w});
  ASSERT_EQ(outs.size(), 3u);
  EXPECT_TRUE(outs[0].requires_grad());
  EXPECT_FALSE(outs[1].requires_grad());  // integer output: non-differentiable
  EXPECT_EQ(outs[1].scalar_type(), at::kLong);
  EXPECT_TRUE(at::equal(outs[1], plain[1]));
  EXPECT_TRUE(at::equal(outs[2], plain[2]));
  outs[0].sum().backward();
  EXPECT_LE(max_diff(grads_of({w}), gw), 1e-6);
}

TEST(CheckpointEdges, SecondBackwardWithoutRetainGraphIsAClearError) {
  at::Tensor w = at::randn({4, 4}).requires_grad_();
  at::Tensor loss = checkpoint::checkpoint([&](const at::Tensor& in) { return in.mm(w); }, at::randn({2, 4}).requires_grad_(), {w}).sum();
  loss.backward();
  try {
    loss.backward();
    FAIL() << "a second backward went through";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("second time"), std::string::npos) << e.what_without_backtrace();
  }
}

TEST(CheckpointEdges, RecurrentModelOverTimeSegments) {
  // An LSTM over a long sequence, checkpointed in chunks of time steps; (h, c) flow between chunks.
  torch::manual_seed(6);
  torch::nn::LSTM lstm(torch::nn::LSTMOptions(8, 16));
  torch::nn::Linear head(16, 1);
  const at::Tensor seq = at::randn({40, 3, 8});  // (T, B, F)
  auto params = lstm->parameters();
  for (auto& p : head->parameters()) params.push_back(p);

  auto out_plain = std::get<0>(lstm->forward(seq));
  head(out_plain).pow(2).mean().backward();
  const auto plain = grads_of(params);
  clear_grads(params);

  at::Tensor h = at::zeros({1, 3, 16}), c = at::zeros({1, 3, 16});
  std::vector<at::Tensor> outputs;
  for (int64_t t0 = 0; t0 < 40; t0 += 10) {
    auto chunk_out = checkpoint::checkpoint(
        [&, t0](const std::vector<at::Tensor>& in) {
          auto r = lstm->forward(seq.slice(0, t0, t0 + 10), std::make_tuple(in[0], in[1]));
          return std::vector<at::Tensor>{std::get<0>(r), std::get<0>(std::get<1>(r)), std::get<1>(std::get<1>(r))};
        },
        {h, c}, lstm->parameters(), CheckpointOptions().name("time steps " + std::to_string(t0)));
    outputs.push_back(chunk_out[0]);
    h = chunk_out[1];
    c = chunk_out[2];
  }
  const at::Tensor out = at::cat(outputs, 0);
  EXPECT_LE((out - out_plain).abs().max().item<double>(), 1e-6);
  head(out).pow(2).mean().backward();
  EXPECT_LE(max_diff(grads_of(params), plain), 1e-6);
}
