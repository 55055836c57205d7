#include "frugal/bench/memory_account.h"

#include <torch/cuda.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "block_stack.h"
#include "frugal/checkpoint/policy.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"
#include "frugal/memory/trace.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/transformer_block.h"

namespace frugal {
namespace bench {
namespace {

using memory::Category;
using memory::Phase;

int64_t tensor_bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

int64_t category_bytes(const memory::Tracker& tracker, Category c) { return tracker.live_by_category()[static_cast<int>(c)]; }

// How a variant runs the chain: x (B, T, d) -> (B, T, d)
using Runner = std::function<at::Tensor(const at::Tensor&)>;

void set_attention(const BlockStack& stack, models::AttentionKernel kernel) {
  for (models::PreLNBlock b : stack.blocks) b->set_attention(kernel);  // a holder: shares the module
}

void clear_grads(const std::vector<at::Tensor>& params) {
  for (const at::Tensor& p : params) {
    // mutable_grad() hands out a reference to the gradient slot; resetting it frees the buffer.
    const_cast<at::Tensor&>(p).mutable_grad().reset();
  }
}

struct StepMeasure {
  int64_t kept_bytes = 0;       // live between the end of forward and the start of backward
  int64_t activation_peak = 0;  // highest live activation bytes over forward and backward
  std::vector<at::Tensor> grads;
};

// One forward+backward of loss = mean(run(x)^2) under the tracker.
StepMeasure measure_step(memory::Tracker& tracker, const BlockStack& stack, const at::Tensor& x, const Runner& run) {
  clear_grads(stack.params);
  StepMeasure m;
  const size_t first_event = tracker.events().size();
  const int64_t before = tracker.live_bytes();
  at::Tensor loss;
  {
    memory::PhaseScope phase(Phase::forward);
    loss = run(x).pow(2).mean();
  }
  m.kept_bytes = tracker.live_bytes() - before;
  {
    memory::PhaseScope phase(Phase::backward);
    loss.backward();
  }
  loss.reset();
  m.activation_peak = memory::max_by_category(tracker.events(), first_event)[static_cast<int>(Category::activation)];
  for (const auto& p : stack.params) m.grads.push_back(p.grad().clone());
  clear_grads(stack.params);
  return m;
}

double max_abs_diff(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, (a[i] - b[i]).abs().max().item<double>());
  return m;
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
  for (const auto& msg : {positive("layers", c.layers), positive("width", c.width), positive("heads", c.heads), positive("batch", c.batch),
                          positive("seq", c.seq)}) {
    if (!msg.empty()) return msg;
  }
  if (c.width % c.heads != 0) {
    return "width must be divisible by heads, got width " + std::to_string(c.width) + " and heads " + std::to_string(c.heads);
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
  if (c.attentions.empty() || c.attentions.front() != models::AttentionKernel::explicit_softmax) {
    return "the attention kernels must start with explicit (the reference run)";
  }
  for (models::AttentionKernel k : c.attentions) {
    const std::string why = models::attention_kernel_unavailable(k);
    if (!why.empty()) return std::string("attention ") + models::attention_kernel_name(k) + " " + why;
  }
  return "";
}

double AttentionResult::measured_over_predicted() const {
  return predicted_saved_bytes > 0 ? static_cast<double>(saved_bytes) / static_cast<double>(predicted_saved_bytes) : 0;
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

namespace {

// One run of the account: the blocks, their input and the tracker, and every way of running the
// chain measured so far (named; timed at the end without the tracker).
struct Account {
  Account(const AccountConfig& c, std::function<void(const std::string&)> progress, AccountResult& r)
      : config(c), say(std::move(progress)), result(r), tracker(memory::Tracker::create()) {}

  const AccountConfig& config;
  std::function<void(const std::string&)> say;
  AccountResult& result;
  std::shared_ptr<memory::Tracker> tracker;
  std::unique_ptr<BlockStack> stack;  // made by build()
  at::Tensor x;
  std::vector<std::pair<std::string, Runner>> runs;  // the budgets' plans, the variants, then the attention kernels after explicit
  StepMeasure plain;                                 // the reference run: no checkpointing, explicit attention

  // The blocks (parameter) and the input (input), under the tracker.
  void build() {
    {
      memory::CategoryScope scope(Category::parameter);
      stack = std::make_unique<BlockStack>(config.layers, config.width, config.heads, config.seed, config.device);
    }
    memory::CategoryScope scope(Category::input);
    x = at::randn({config.batch, config.seq, config.width}, at::TensorOptions().device(config.device));  // (B, T, d)
  }

  // (a) parameters, gradients and AdamW state: formula, real tensors, tracker, over one AdamW step.
  void measure_parameters_gradients_and_state() {
    tracker->label("set-up");
    result.n_params_formula = models::block_param_count(config.layers, config.width);
    for (const auto& p : stack->params) {
      result.n_params += p.numel();
      result.param_bytes.tensors += tensor_bytes(p);
    }
    result.param_bytes.formula = result.n_params_formula * 4;
    result.param_bytes.tracked = category_bytes(*tracker, Category::parameter);

    say("one AdamW training step");
    torch::optim::AdamW adamw(stack->params, torch::optim::AdamWOptions(1e-3));
    {
      at::Tensor loss;
      {
        memory::PhaseScope phase(Phase::forward);
        loss = checkpoint::run_chain(stack->chain, x, checkpoint::CheckpointPolicy::none()).pow(2).mean();
      }
      memory::PhaseScope phase(Phase::backward);
      loss.backward();
    }
    for (const auto& p : stack->params) memory::tag(p.grad(), Category::gradient);  // torch::optim does not tag
    for (const auto& p : stack->params) result.grad_bytes.tensors += tensor_bytes(p.grad());
    result.grad_bytes.formula = result.n_params_formula * 4;
    result.grad_bytes.tracked = category_bytes(*tracker, Category::gradient);
    {
      memory::PhaseScope phase(Phase::optimizer);
      adamw.step();
    }
    for (const auto& entry : adamw.state()) {
      const auto& st = static_cast<const torch::optim::AdamWParamState&>(*entry.second);
      result.adamw_state_bytes.tensors += tensor_bytes(st.exp_avg()) + tensor_bytes(st.exp_avg_sq());
    }
    result.adamw_state_bytes.formula = 2 * result.n_params_formula * 4;
    result.adamw_state_bytes.tracked = category_bytes(*tracker, Category::optimizer_state);
    clear_grads(stack->params);
  }

  // The plain run: the reference gradients and activation peak.
  void measure_plain() {
    tracker->label("none");
    plain = measure_step(*tracker, *stack, x, [this](const at::Tensor& in) {
      return checkpoint::run_chain(stack->chain, in, checkpoint::CheckpointPolicy::none());
    });
    result.activation_peak_none = plain.activation_peak;
  }

  // (f) budget plans: measure each block once, plan, run each plan and measure it. False when a
  // budget is impossible (nothing after it is meaningful).
  bool measure_budgets() {
    if (config.budget_bytes.empty() && config.budget_fractions.empty()) return true;
    say("measuring each block for the planner");
    tracker->label("planner: measuring each block");
    const auto costs = checkpoint::measure_chain(stack->chain, x);
    result.planner_predicted_none = checkpoint::no_checkpoint_plan(costs).predicted_bytes;
    std::vector<int64_t> budgets = config.budget_bytes;
    for (double f : config.budget_fractions) budgets.push_back(static_cast<int64_t>(f * static_cast<double>(plain.activation_peak)));
    for (int64_t budget : budgets) {
      BudgetResult br;
      br.budget_bytes = budget;
      br.min_achievable_bytes = checkpoint::min_achievable_bytes(costs);
      br.sqrt_n = checkpoint::sqrt_n_plan(costs);
      const auto plan = checkpoint::plan_for_budget(costs, budget);
      br.feasible = plan.has_value();
      if (!br.feasible) {
        result.budgets.push_back(br);
        return false;
      }
      br.plan = *plan;
      say("running the plan for a budget of " + std::to_string(budget) + " bytes: " + plan->describe());
      Runner runner = [this, p = *plan](const at::Tensor& in) { return checkpoint::run_plan(stack->chain, in, p); };
      tracker->label("budget " + io::human_bytes(budget));
      const StepMeasure m = measure_step(*tracker, *stack, x, runner);
      br.measured_bytes = m.activation_peak;
      br.max_grad_diff = max_abs_diff(m.grads, plain.grads);
      runs.emplace_back("budget " + std::to_string(budget), runner);
      result.budgets.push_back(br);
    }
    return true;
  }

  // (b) bytes kept between forward and backward, (d) gradient equality, per variant.
  void measure_variants() {
    for (const std::string& name : config.variants) {
      say("measuring " + name);
      const auto policy = checkpoint::CheckpointPolicy::parse(name);
      Runner runner = [this, policy](const at::Tensor& in) { return checkpoint::run_chain(stack->chain, in, policy); };
      if (name != "none") tracker->label(name);
      const StepMeasure m = name == "none" ? plain : measure_step(*tracker, *stack, x, runner);
      VariantResult v;
      v.name = name;
      v.saved_bytes = m.kept_bytes;
      v.max_grad_diff = max_abs_diff(m.grads, plain.grads);
      result.variants.push_back(v);
      runs.emplace_back(name, runner);
    }
  }

  // (h) each attention kernel without checkpointing: explicit is the plain run; another kernel
  // runs the same blocks, weights and input.
  void measure_attentions() {
    for (models::AttentionKernel kernel : config.attentions) {
      AttentionResult a;
      a.kernel = kernel;
      a.predicted_saved_bytes =
          models::predicted_saved_bytes(config.layers, config.batch, config.seq, config.width, config.heads, 4, kernel);
      if (kernel == models::AttentionKernel::explicit_softmax) {
        a.saved_bytes = plain.kept_bytes;
      } else {
        const std::string name = std::string("attention ") + models::attention_kernel_name(kernel);
        say("measuring " + name);
        // The kernel is read in forward only, so the blocks go back to explicit once it has run.
        Runner runner = [this, kernel](const at::Tensor& in) {
          set_attention(*stack, kernel);
          at::Tensor y = checkpoint::run_chain(stack->chain, in, checkpoint::CheckpointPolicy::none());
          set_attention(*stack, models::AttentionKernel::explicit_softmax);
          return y;
        };
        tracker->label(name);
        const StepMeasure m = measure_step(*tracker, *stack, x, runner);
        a.saved_bytes = m.kept_bytes;
        a.max_grad_diff = max_abs_diff(m.grads, plain.grads);
        runs.emplace_back(name, runner);
      }
      result.attentions.push_back(a);
    }
  }

  // (c) forward+backward time of every run, without the tracker (its bookkeeping would be timed too).
  void time_runs() {
    for (size_t i = 0; i < runs.size(); ++i) {
      say("timing " + runs[i].first);
      std::vector<double> seconds;
      for (int r = 0; r < config.timing_warmup + config.timing_runs; ++r) {
        clear_grads(stack->params);
        const auto t0 = std::chrono::steady_clock::now();
        runs[i].second(x).pow(2).mean().backward();
        if (config.device.is_cuda()) torch::cuda::synchronize(config.device.index());
        const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (r >= config.timing_warmup) seconds.push_back(sec);
      }
      const double t = median(seconds);
      const size_t nb = result.budgets.size(), nv = result.variants.size();
      if (i < nb) {
        result.budgets[i].time_s = t;
      } else if (i < nb + nv) {
        result.variants[i - nb].time_s = t;
      } else {
        result.attentions[i - nb - nv + 1].time_s = t;
      }
    }
    clear_grads(stack->params);
    if (const VariantResult* none = result.find("none")) result.attentions.front().time_s = none->time_s;
  }

  // (g) the optimizer step after backward against inside it, on the same shapes.
  void compare_optimizer_modes() {
    say("comparing the optimizer step after and inside backward");
    OptimInBackwardConfig oc;
    oc.layers = config.layers;
    oc.width = config.width;
    oc.heads = config.heads;
    oc.batch = config.batch;
    oc.seq = config.seq;
    oc.seed = config.seed;
    oc.device = config.device;
    oc.timing_runs = config.timing ? config.timing_runs : 0;
    result.optimizer_modes = run_optim_in_backward_benchmark(oc);
  }
};

}  // namespace

AccountResult run_memory_account(const AccountConfig& config, const std::function<void(const std::string&)>& progress) {
  const std::string invalid = validate(config);
  TORCH_CHECK(invalid.empty(), invalid);
  AccountResult result;
  result.config = config;
  Account account(
      config,
      [&](const std::string& line) {
        if (progress) progress(line);
      },
      result);
  result.tracker = account.tracker;
  {
    memory::TrackingGuard tracking(account.tracker);
    account.build();
    account.measure_parameters_gradients_and_state();
    account.measure_plain();
    if (!account.measure_budgets()) return result;  // an impossible budget
    account.measure_variants();
    account.measure_attentions();
  }
  if (config.timing) account.time_runs();
  if (config.optimizer_modes) account.compare_optimizer_modes();
  // (e) prediction
  result.predicted_saved_bytes_none = models::predicted_saved_bytes(config.layers, config.batch, config.seq, config.width, config.heads);
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

// {"explicit": <value>, "sdpa": <value>} in config.attentions order
template <typename F>
void write_by_attention(io::JsonWriter& w, const std::string& key, const AccountResult& r, F value) {
  w.key(key).begin_object();
  for (const auto& a : r.attentions) {
    w.key(models::attention_kernel_name(a.kernel));
    value(a);
  }
  w.end_object();
}

}  // namespace

void write_account_json(const AccountResult& r, std::ostream& out) {
  if (!r.budgets.empty() && !r.budgets.front().feasible) {
    io::JsonWriter w(out);
    write_budget_json(w, r.budgets.front(), r);
    return;
  }
  const VariantResult* none = r.find("none");
  const double none_bytes = none ? static_cast<double>(none->saved_bytes) : 0.0;
  io::JsonWriter w(out);
  w.begin_object();
  w.key("config")
      .begin_object()
      .key("layers")
      .value(r.config.layers)
      .key("width")
      .value(r.config.width)
      .key("heads")
      .value(r.config.heads)
      .key("batch")
      .value(r.config.batch)
      .key("seq")
      .value(r.config.seq)
      .key("seed")
      .value(static_cast<int64_t>(r.config.seed))
      .key("device")
      .value(r.config.device.str())
      .end_object();
  w.key("n_params").value(r.n_params);
  w.key("param_bytes").value(r.param_bytes.tensors);
  w.key("grad_bytes").value(r.grad_bytes.tensors);
  w.key("adamw_state_bytes").value(r.adamw_state_bytes.tensors);
  write_by_variant(w, "saved_bytes", r, [&](const VariantResult& v) { w.value(v.saved_bytes); });
  write_by_variant(w, "saved_ratio_vs_none", r,
                   [&](const VariantResult& v) { w.value(none_bytes > 0 ? static_cast<double>(v.saved_bytes) / none_bytes : 0.0); });
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
  write_by_attention(w, "saved_bytes_by_attention", r, [&](const AttentionResult& a) { w.value(a.saved_bytes); });
  write_by_attention(w, "predicted_saved_bytes_by_attention", r, [&](const AttentionResult& a) { w.value(a.predicted_saved_bytes); });
  write_by_attention(w, "measured_over_predicted_by_attention", r, [&](const AttentionResult& a) { w.value(a.measured_over_predicted()); });
  write_by_attention(w, "time_s_by_attention", r, [&](const AttentionResult& a) {
    if (a.time_s) {
      w.value(*a.time_s);
    } else {
      w.null();
    }
  });
  write_by_attention(w, "max_grad_diff_by_attention", r, [&](const AttentionResult& a) { w.value(a.max_grad_diff); });
  if (r.optimizer_modes) {
    const auto& o = *r.optimizer_modes;
    w.key("optimizer")
        .begin_object()
        .key("algorithm")
        .value("adamw")
        .key("state_bytes")
        .value(o.state_bytes)
        .key("peak_bytes_standard")
        .value(o.peak_bytes_standard)
        .key("peak_bytes_in_backward")
        .value(o.peak_bytes_in_backward)
        .key("max_live_grad_bytes_standard")
        .value(o.max_live_grad_bytes_standard)
        .key("max_live_grad_bytes_in_backward")
        .value(o.max_live_grad_bytes_in_backward)
        .key("largest_grad_bytes")
        .value(o.largest_grad_bytes);
    if (o.time_s_standard > 0) {
      w.key("time_ratio").value(o.time_s_in_backward / o.time_s_standard);
    } else {
      w.key("time_ratio").null();
    }
    w.key("max_param_diff").value(o.max_param_diff).end_object();
  }
  if (!r.budgets.empty()) {
    w.key("budget_plan");
    write_budget_json(w, r.budgets.front(), r);
  }
  w.end_object();
}

void write_budget_json(io::JsonWriter& w, const BudgetResult& b, const AccountResult& r) {
  const VariantResult* none = r.find("none");
  w.begin_object();
  w.key("budget_bytes").value(b.budget_bytes);
  w.key("feasible").value(b.feasible);
  w.key("min_achievable_bytes").value(b.min_achievable_bytes);
  if (b.feasible) {
    w.key("plan").value(b.plan.describe());
    w.key("checkpointed_blocks").value(b.plan.checkpointed_blocks());
    w.key("predicted_bytes").value(b.plan.predicted_bytes);
    w.key("measured_bytes").value(b.measured_bytes);
    w.key("measured_over_predicted").value(static_cast<double>(b.measured_bytes) / static_cast<double>(b.plan.predicted_bytes));
    w.key("recompute_s").value(b.plan.recompute_s);
    w.key("memory_ratio").value(static_cast<double>(b.measured_bytes) / static_cast<double>(r.activation_peak_none));
    if (b.time_s && none && none->time_s) {
      w.key("time_s").value(*b.time_s);
      w.key("time_ratio").value(*b.time_s / *none->time_s);
    } else {
      w.key("time_s").null();
      w.key("time_ratio").null();
    }
    w.key("max_grad_diff").value(b.max_grad_diff);
  }
  w.key("activation_peak_none").value(r.activation_peak_none);
  w.key("sqrt_n")
      .begin_object()
      .key("plan")
      .value(b.sqrt_n.describe())
      .key("predicted_bytes")
      .value(b.sqrt_n.predicted_bytes)
      .key("recompute_s")
      .value(b.sqrt_n.recompute_s)
      .end_object();
  w.end_object();
}

}  // namespace bench
}  // namespace frugal
