#include "frugal/train/memory_account.h"

#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iomanip>

#include "frugal/checkpoint/policy.h"
#include "frugal/io/json.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/transformer_block.h"

namespace frugal {
namespace train {
namespace {

using memory::Category;
using memory::Phase;

int64_t tensor_bytes(const at::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

int64_t category_bytes(const memory::Tracker& tracker, Category c) {
  return tracker.live_by_category()[static_cast<int>(c)];
}

struct Stack {
  std::vector<models::PreLNBlock> blocks;
  std::vector<checkpoint::ChainBlock> chain;
  std::vector<at::Tensor> params;
};

void clear_grads(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    // mutable_grad() hands out a reference to the gradient slot; resetting it frees the buffer.
    const_cast<at::Tensor&>(p).mutable_grad().reset();
  }
}

at::Tensor loss_of(const Stack& stack, const at::Tensor& x, const checkpoint::CheckpointPolicy& policy) {
  return checkpoint::run_chain(stack.chain, x, policy).pow(2).mean();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace

std::string validate(const AccountConfig& c) {
  auto positive = [](const char* name, int64_t v) -> std::string {
    return v >= 1 ? "" : std::string(name) + " must be a positive integer, got " + std::to_string(v);
  };
  for (const auto& msg : {positive("layers", c.layers), positive("width", c.width), positive("heads", c.heads),
                          positive("batch", c.batch), positive("seq", c.seq)}) {
    if (!msg.empty()) return msg;
  }
  if (c.width % c.heads != 0) {
    return "width must be divisible by heads, got width " + std::to_string(c.width) + " and heads " +
           std::to_string(c.heads);
  }
  if (std::find(c.variants.begin(), c.variants.end(), "none") == c.variants.end()) {
    return "the variants must include none (the reference run)";
  }
  for (const std::string& v : c.variants) {
    try {
      checkpoint::CheckpointPolicy::parse(v);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
  }
  if (c.device.is_cuda() && !torch::cuda::is_available()) {
    return "device " + c.device.str() + " is not available: this machine or LibTorch build has no CUDA device";
  }
  if (c.timing_runs < 1 || c.timing_warmup < 0) return "timing needs at least one run";
  return "";
}

const VariantResult* AccountResult::find(const std::string& name) const {
  for (const auto& v : variants) {
    if (v.name == name) return &v;
  }
  return nullptr;
}

double AccountResult::max_grad_diff() const {
  double m = 0;
  for (const auto& v : variants) m = std::max(m, v.max_grad_diff);
  return m;
}

double AccountResult::measured_over_predicted() const {
  const VariantResult* none = find("none");
  if (!none || predicted_saved_bytes_none == 0) return 0;
  return static_cast<double>(none->saved_bytes) / static_cast<double>(predicted_saved_bytes_none);
}

AccountResult run_memory_account(const AccountConfig& config,
                                 const std::function<void(const std::string&)>& progress) {
  const std::string invalid = validate(config);
  TORCH_CHECK(invalid.empty(), invalid);
  auto say = [&](const std::string& line) {
    if (progress) progress(line);
  };
  const int64_t L = config.layers, d = config.width, B = config.batch, T = config.seq;

  AccountResult result;
  result.config = config;
  auto tracker = memory::Tracker::create();
  Stack stack;
  at::Tensor x;
  std::vector<std::pair<std::string, checkpoint::CheckpointPolicy>> variants;
  for (const auto& name : config.variants) variants.emplace_back(name, checkpoint::CheckpointPolicy::parse(name));
  std::vector<at::Tensor> reference_grads;
  {
    memory::TrackingGuard tracking(tracker);
    torch::manual_seed(config.seed);
    {
      memory::CategoryScope scope(Category::parameter);
      for (int64_t i = 0; i < L; ++i) {
        stack.blocks.emplace_back(d, config.heads);
        stack.blocks.back()->to(config.device);
      }
    }
    stack.chain = checkpoint::make_chain(stack.blocks);
    for (const auto& b : stack.blocks) {
      for (const auto& p : b->parameters()) stack.params.push_back(p);
    }
    {
      memory::CategoryScope scope(Category::input);
      x = at::randn({B, T, d}, at::TensorOptions().device(config.device));  // (B, T, d)
    }

    // (a) parameters, gradients and AdamW state: formula, real tensors, tracker
    result.n_params_formula = models::block_param_count(L, d);
    for (const auto& p : stack.params) {
      result.n_params += p.numel();
      result.param_bytes.tensors += tensor_bytes(p);
    }
    result.param_bytes.formula = result.n_params_formula * 4;
    result.param_bytes.tracked = category_bytes(*tracker, Category::parameter);

    say("one AdamW training step");
    torch::optim::AdamW adamw(stack.params, torch::optim::AdamWOptions(1e-3));
    {
      at::Tensor loss;
      {
        memory::PhaseScope phase(Phase::forward);
        loss = loss_of(stack, x, checkpoint::CheckpointPolicy::none());
      }
      memory::PhaseScope phase(Phase::backward);
      loss.backward();
    }
    for (const auto& p : stack.params) result.grad_bytes.tensors += tensor_bytes(p.grad());
    result.grad_bytes.formula = result.n_params_formula * 4;
    result.grad_bytes.tracked = category_bytes(*tracker, Category::gradient);
    {
      memory::PhaseScope phase(Phase::optimizer);
      adamw.step();
    }
    for (const auto& entry : adamw.state()) {
      const auto& s = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      result.adamw_state_bytes.tensors += tensor_bytes(s.exp_avg()) + tensor_bytes(s.exp_avg_sq());
    }
    result.adamw_state_bytes.formula = 2 * result.n_params_formula * 4;
    result.adamw_state_bytes.tracked = category_bytes(*tracker, Category::optimizer_state);
    clear_grads(stack.params);

    // (b) bytes kept between forward and backward, (d) gradient equality, per variant.
    // "none" runs first: it is the reference the others are compared with.
    std::vector<size_t> order(variants.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_partition(order.begin(), order.end(), [&](size_t i) { return variants[i].first == "none"; });
    result.variants.resize(variants.size());
    for (size_t i : order) {
      const auto& [name, policy] = variants[i];
      say("measuring " + name);
      VariantResult& v = result.variants[i];
      v.name = name;
      clear_grads(stack.params);
      const int64_t before = tracker->live_bytes();
      at::Tensor loss;
      {
        memory::PhaseScope phase(Phase::forward);
        loss = loss_of(stack, x, policy);
      }
      v.saved_bytes = tracker->live_bytes() - before;
      {
        memory::PhaseScope phase(Phase::backward);
        loss.backward();
      }
      loss.reset();
      if (reference_grads.empty()) {
        for (const auto& p : stack.params) reference_grads.push_back(p.grad().clone());
      }
      for (size_t j = 0; j < stack.params.size(); ++j) {
        const double diff = (stack.params[j].grad() - reference_grads[j]).abs().max().item<double>();
        v.max_grad_diff = std::max(v.max_grad_diff, diff);
      }
    }
    clear_grads(stack.params);
  }

  // (c) forward+backward time, without the tracker (its bookkeeping would be timed too)
  if (config.timing) {
    for (size_t i = 0; i < variants.size(); ++i) {
      say("timing " + variants[i].first);
      std::vector<double> seconds;
      for (int r = 0; r < config.timing_warmup + config.timing_runs; ++r) {
        clear_grads(stack.params);
        const auto t0 = std::chrono::steady_clock::now();
        loss_of(stack, x, variants[i].second).backward();
        if (config.device.is_cuda()) torch::cuda::synchronize(config.device.index());
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r >= config.timing_warmup) seconds.push_back(s);
      }
      result.variants[i].time_s = median(seconds);
    }
    clear_grads(stack.params);
  }

  // (e) prediction
  result.predicted_saved_bytes_none = models::predicted_saved_bytes(L, B, T, d, config.heads);
  return result;
}

namespace {

// {"none": <value>, "full": <value>, ...} in variant order
template <typename F>
void write_by_variant(io::JsonWriter& w, const std::string& key, const AccountResult& r, F value) {
  w.key(key).begin_object();
  for (const auto& v : r.variants) {
    w.key(v.name);
    value(v);
  }
  w.end_object();
}

}  // namespace

void write_account_json(const AccountResult& r, std::ostream& out) {
  const VariantResult* none = r.find("none");
  const double none_bytes = none ? static_cast<double>(none->saved_bytes) : 0.0;
  io::JsonWriter w(out);
  w.begin_object();
  w.key("config").begin_object()
      .key("layers").value(r.config.layers)
      .key("width").value(r.config.width)
      .key("heads").value(r.config.heads)
      .key("batch").value(r.config.batch)
      .key("seq").value(r.config.seq)
      .key("seed").value(static_cast<int64_t>(r.config.seed))
      .key("device").value(r.config.device.str())
      .end_object();
  w.key("n_params").value(r.n_params);
  w.key("param_bytes").value(r.param_bytes.tensors);
  w.key("grad_bytes").value(r.grad_bytes.tensors);
  w.key("adamw_state_bytes").value(r.adamw_state_bytes.tensors);
  write_by_variant(w, "saved_bytes", r, [&](const VariantResult& v) { w.value(v.saved_bytes); });
  write_by_variant(w, "saved_ratio_vs_none", r, [&](const VariantResult& v) {
    w.value(none_bytes > 0 ? static_cast<double>(v.saved_bytes) / none_bytes : 0.0);
  });
  write_by_variant(w, "time_s", r, [&](const VariantResult& v) {
    if (v.time_s) {
      w.value(*v.time_s);
    } else {
      w.null();
    }
  });
  w.key("max_grad_diff").value(r.max_grad_diff());
  w.key("predicted_saved_bytes_none").value(r.predicted_saved_bytes_none);
  w.key("measured_over_predicted").value(r.measured_over_predicted());
  w.end_object();
}

namespace {

std::string human_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (b >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", b / (1024.0 * 1024));
  } else if (b >= 1024.0) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

}  // namespace

void write_account_table(const AccountResult& r, std::ostream& out) {
  const auto& c = r.config;
  out << "frugal account: " << c.layers << " pre-LN blocks, width " << c.width << ", " << c.heads
      << " heads, input (" << c.batch << ", " << c.seq << ", " << c.width << "), fp32 on " << c.device.str()
      << ", " << r.n_params << " parameters\n\n";
  out << std::left << std::setw(20) << "bucket" << std::right << std::setw(14) << "formula" << std::setw(14)
      << "tensors" << std::setw(14) << "tracker" << "\n";
  auto row = [&](const char* name, const BytesCheck& b) {
    out << std::left << std::setw(20) << name << std::right << std::setw(14) << human_bytes(b.formula)
        << std::setw(14) << human_bytes(b.tensors) << std::setw(14) << human_bytes(b.tracked)
        << (b.agree() ? "" : "   MISMATCH") << "\n";
  };
  row("parameters", r.param_bytes);
  row("gradients", r.grad_bytes);
  row("AdamW state", r.adamw_state_bytes);

  const VariantResult* none = r.find("none");
  out << "\n" << std::left << std::setw(20) << "checkpointing" << std::right << std::setw(14) << "kept"
      << std::setw(10) << "vs none" << std::setw(12) << "fwd+bwd" << std::setw(10) << "vs none"
      << std::setw(16) << "max grad diff" << "\n";
  for (const auto& v : r.variants) {
    char ratio[32], time[32], tratio[32], diff[32];
    std::snprintf(ratio, sizeof(ratio), "%.3f",
                  none ? static_cast<double>(v.saved_bytes) / static_cast<double>(none->saved_bytes) : 0.0);
    std::snprintf(time, sizeof(time), v.time_s ? "%.1f ms" : "-", v.time_s ? *v.time_s * 1e3 : 0.0);
    std::snprintf(tratio, sizeof(tratio), (v.time_s && none && none->time_s) ? "%.2fx" : "-",
                  (v.time_s && none && none->time_s) ? *v.time_s / *none->time_s : 0.0);
    std::snprintf(diff, sizeof(diff), "%.2e", v.max_grad_diff);
    out << std::left << std::setw(20) << v.name << std::right << std::setw(14) << human_bytes(v.saved_bytes)
        << std::setw(10) << ratio << std::setw(12) << time << std::setw(10) << tratio << std::setw(16) << diff
        << "\n";
  }
  char mop[64];
  std::snprintf(mop, sizeof(mop), "%.4f", r.measured_over_predicted());
  out << "\npredicted kept bytes without checkpointing: " << human_bytes(r.predicted_saved_bytes_none) << " ("
      << r.predicted_saved_bytes_none << " B); measured / predicted = " << mop << "\n";
}

}  // namespace train
}  // namespace frugal
