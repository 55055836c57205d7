#include "frugal/optim/optimizer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/io/numbers.h"
#include "frugal/io/tensor_values.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace optim {

const char* mode_name(Mode m) { return m == Mode::standard ? "standard" : "in_backward"; }

const char* clip_name(Clip c) {
  switch (c) {
    case Clip::none: return "none";
    case Clip::global_norm: return "global_norm";
    case Clip::global_norm_two_pass: return "global_norm_two_pass";
    case Clip::per_param_norm: return "per_param_norm";
  }
  return "none";
}

std::optional<Clip> parse_clip(const std::string& name) {
  for (Clip c : kAllClips) {
    if (name == clip_name(c)) return c;
  }
  return std::nullopt;
}

namespace {

enum class Pass { step, measure_norm };

// The clip coefficient min(1, max_norm / (norm + 1e-6)) as a tensor (no device sync).
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) { return (max_norm / (norm + 1e-6)).clamp_max(1.0); }

}  // namespace

namespace {

// loss.backward() under two-pass clipping: the first gradient arrives before any norm was measured.
// A plain std::logic_error (autograd hands it to the caller as it is), so the sentence comes
// without a backtrace; no parameter has changed yet.
[[noreturn]] void throw_two_pass_needs_backward() {
  throw std::logic_error(
      "optimizer: two-pass global-norm clipping measures the gradient norm in a first backward pass, so call "
      "optimizer.backward(loss) instead of loss.backward()");
}

}  // namespace

struct Optimizer::Impl {
  OptimizerOptions options;
  struct Param {
    std::string name;
    at::Tensor tensor;
    size_t group;
    ParamState state;
    // The flattened elements [begin, end) this rank updates: all of them in one process; with an
    // Exchange the owned range (nothing, all, or a slice).
    int64_t begin = 0, end = 0;
  };
  std::vector<Param> params;

  static bool whole(const Param& p) { return p.begin == 0 && p.end == p.tensor.numel(); }
  // Whether params is split over the ranks (each holds a slice): its norm is a sum over them.
  static bool split(const Param& p) { return p.begin < p.end && !whole(p); }
  // The part of a parameter-shaped tensor (the parameter, its gradient) this rank updates.
  static at::Tensor own(const Param& p, const at::Tensor& t) { return whole(p) ? t : t.view({-1}).narrow(0, p.begin, p.end - p.begin); }
  std::vector<double> group_lr, group_base_lr, group_weight_decay;
  int64_t micro_steps = 0;
  int64_t steps_taken = 0;
  double last_grad_norm = NAN;
  // in-backward
  struct Hook {
    // kept alive so the hook stays on it: a shared_ptr in LibTorch 1.13, an intrusive_ptr in 2.x
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
    uintptr_t key;
  };
  std::vector<Hook> hooks;
  std::vector<std::shared_ptr<const void>> code_tables;  // quantized state's shared tables, built up front
  Pass pass = Pass::step;
  bool norm_ready = false;
  at::Tensor norm_sq;      // sum of squared gradient norms in the measuring pass (double)
  at::Tensor global_coef;  // the clip coefficient for the stepping pass
  // data parallel (exchange.h)
  std::shared_ptr<Exchange> exchange;
  struct Pending {
    size_t index;
    at::Tensor grad;  // being averaged; the parameter's .grad is already reset
    Exchange::Wait wait;
  };
  std::deque<Pending> pending;  // in-backward: gradients being averaged, oldest first
  int64_t pending_bytes = 0;
  int64_t bytes_in_flight = kDefaultBytesInFlight;
  std::vector<Exchange::Wait> shares;  // owners' updated parameters on their way to the other ranks

  bool owns(size_t i) const { return !exchange || exchange->owns(i); }
  bool owns(const Param& p) const { return owns(static_cast<size_t>(&p - params.data())); }

  // The averaged gradient of params[i] has arrived (in-backward): the owner clips and updates, then
  // sends the new values; the gradient is dropped either way.
  void use_averaged(size_t i, const at::Tensor& grad) {
    Param& p = params[i];
    if (owns(i)) {
      clip_and_update(p, grad);
    }
    shares.push_back(exchange->share_parameter(i, p.tensor));
  }
  void clip_and_update(Param& p, const at::Tensor& grad) {
    const at::Tensor g = own(p, grad);
    if (options.clip() == Clip::global_norm_two_pass) {
      g.mul_(global_coef.to(g.scalar_type()));
    } else if (options.clip() == Clip::per_param_norm) {
      clip_per_param(p, g);
    }
    update(p, grad);
  }
  // g: this rank's part of p's gradient; a split parameter's norm is summed over the ranks' slices.
  void clip_per_param(const Param& p, const at::Tensor& g) {
    at::Tensor norm = g.norm();
    if (split(p)) {
      const double n = norm.item<double>();
      norm = at::scalar_tensor(std::sqrt(exchange->sum(n * n)), g.options());
    }
    g.mul_(clip_coefficient(norm, options.max_grad_norm()));
  }
  // Waits for the oldest averages until no more than `limit` bytes are in flight.
  void drain(int64_t limit) {
    at::NoGradGuard no_grad;
    while (!pending.empty() && pending_bytes > limit) {
      Pending next = std::move(pending.front());
      pending.pop_front();
      pending_bytes -= next.grad.numel() * static_cast<int64_t>(next.grad.element_size());
      next.wait();
      use_averaged(next.index, next.grad);
      next = Pending{};
      exchange->release(/*wait=*/false);
    }
  }
  // Every average used and every owner's values received: the parameters are the same everywhere.
  void settle() {
    drain(-1);
    {
      std::vector<Exchange::Wait> waits;
      waits.swap(shares);
      for (auto& w : waits) w();
    }
    exchange->release(/*wait=*/true);
  }

  Hyper hyper(size_t group) const {
    Hyper h;
    h.algorithm = options.algorithm();
    h.lr = group_lr[group];
    h.weight_decay = group_weight_decay[group];
    h.momentum = options.momentum();
    h.dampening = options.dampening();
    h.nesterov = options.nesterov();
    h.beta1 = options.beta1();
    h.beta2 = options.beta2();
    h.eps = options.eps();
    h.state = options.state();
    h.stochastic_rounding = options.stochastic_rounding();
    return h;
  }

  void update(Param& p, const at::Tensor& grad) {
    memory::CategoryScope scope(memory::Category::optimizer_state);
    const auto t0 = std::chrono::steady_clock::now();
    auto moved = [&p] { return (p.state.m ? p.state.m->transfer_seconds() : 0.0) + (p.state.v ? p.state.v->transfer_seconds() : 0.0); };
    const double moved_before = moved();
    at::Tensor target = own(p, p.tensor);
    apply_update(hyper(p.group), p.state, target, own(p, grad));
    if (p.state.m && p.state.m->windowed()) read_ahead_after(static_cast<size_t>(&p - params.data()));
    update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state_transfer_seconds += moved() - moved_before;
  }
  double update_seconds = 0;
  double state_transfer_seconds = 0;

  // File placement: params[i] was just updated; the first chunk of the state of the parameter that
  // followed it last time (in in-backward mode, the order gradients complete) is read ahead while
  // the next gradients are computed. The last of a step is followed by the first of the next.
  std::vector<int64_t> updated_after;  // -1: not seen yet
  int64_t last_updated = -1;
  void read_ahead_after(size_t i) {
    if (updated_after.size() != params.size()) updated_after.assign(params.size(), -1);
    if (last_updated >= 0) updated_after[static_cast<size_t>(last_updated)] = static_cast<int64_t>(i);
    last_updated = static_cast<int64_t>(i);
    const int64_t next = updated_after[i];
    if (next < 0) return;
    const ParamState& s = params[static_cast<size_t>(next)].state;
    if (s.m && s.v) {
      s.m->prefetch(0, s.m->chunk());
      s.v->prefetch(0, s.v->chunk());
    }
  }

  // The gradient of params[i] is complete (autograd accumulated it): it is a gradient from its
  // allocation on, for the tracker; in in-backward mode it is used and freed now.
  void on_gradient(size_t i) {
    Param& p = params[i];
    at::Tensor grad = p.tensor.grad();
    if (!grad.defined()) return;
    memory::tag(grad, memory::Category::gradient);
    if (options.mode() != Mode::in_backward) return;
    at::NoGradGuard no_grad;
    if (exchange) {
      p.tensor.mutable_grad().reset();  // the average below holds it until it is used
      if (pass == Pass::measure_norm) {
        exchange->average_gradient(i, grad)();
        if (owns(i)) {
          const at::Tensor n = own(p, grad).norm().to(at::kDouble);
          norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
        }
        grad = at::Tensor();
        exchange->release(/*wait=*/false);  // as drain does: the operation's hold on the gradient goes now
        return;
      }
      if (options.clip() == Clip::global_norm_two_pass && !norm_ready) throw_two_pass_needs_backward();
      pending.push_back({i, grad, exchange->average_gradient(i, grad)});
      pending_bytes += grad.numel() * static_cast<int64_t>(grad.element_size());
      drain(bytes_in_flight);  // backward goes on while the newest are on their way
      return;
    }
    if (pass == Pass::measure_norm) {
      const at::Tensor n = grad.norm().to(at::kDouble);
      norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
    } else {
      if (options.clip() == Clip::global_norm_two_pass && !norm_ready) throw_two_pass_needs_backward();
      clip_and_update(p, grad);
    }
    p.tensor.mutable_grad().reset();  // the whole point: the gradient is gone as soon as it is used
  }
};

namespace {

class GradientReady : public torch::autograd::FunctionPostHook {
 public:
  GradientReady(std::weak_ptr<Optimizer::Impl> impl, size_t index) : impl_(std::move(impl)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto impl = impl_.lock()) impl->on_gradient(index_);
    return outputs;
  }

 private:
  std::weak_ptr<Optimizer::Impl> impl_;
  size_t index_;
};

void check_options(const OptimizerOptions& o) {
  auto bad = [](const std::string& msg) { throw std::invalid_argument("optimizer: " + msg); };
  if (!(o.lr() >= 0)) bad("lr must be >= 0, got " + std::to_string(o.lr()));
  if (!(o.weight_decay() >= 0)) bad("weight_decay must be >= 0, got " + std::to_string(o.weight_decay()));
  if (!(o.beta1() >= 0 && o.beta1() < 1)) bad("beta1 must be in [0, 1), got " + std::to_string(o.beta1()));
  if (!(o.beta2() >= 0 && o.beta2() < 1)) bad("beta2 must be in [0, 1), got " + std::to_string(o.beta2()));
  if (!(o.eps() > 0)) bad("eps must be > 0, got " + std::to_string(o.eps()));
  if (!(o.momentum() >= 0)) bad("momentum must be >= 0, got " + std::to_string(o.momentum()));
  if (o.nesterov() && (o.momentum() <= 0 || o.dampening() != 0)) bad("nesterov needs momentum > 0 and dampening 0");
  if (o.clip() != Clip::none && !(o.max_grad_norm() > 0)) {
    bad("max_grad_norm must be > 0 when clipping, got " + std::to_string(o.max_grad_norm()));
  }
  if (o.accumulation_steps() < 1) bad("accumulation_steps must be >= 1, got " + std::to_string(o.accumulation_steps()));
  if (o.mode() == Mode::in_backward && o.clip() == Clip::global_norm) {
    bad("global-norm clipping needs every gradient before the first parameter is updated, which one in-backward "
        "pass cannot give; use clip global_norm_two_pass (exact, one more backward per step) or per_param_norm");
  }
  if (o.mode() == Mode::in_backward && o.accumulation_steps() > 1) {
    bad("in-backward mode updates each parameter during backward and frees its gradient, so gradients cannot be "
        "accumulated over " +
        std::to_string(o.accumulation_steps()) + " micro-batches; use standard mode to accumulate, or a larger batch");
  }
}

std::vector<ParamGroup> one_group(const torch::OrderedDict<std::string, at::Tensor>& named) {
  ParamGroup g;
  for (const auto& item : named) {
    g.names.push_back(item.key());
    g.params.push_back(item.value());
  }
  return {g};
}

void refuse_amsgrad(bool amsgrad, const char* options) {
  if (amsgrad) {
    throw std::invalid_argument(std::string("optimizer: ") + options +
                                ".amsgrad(true) is not supported (frugal's Adam and AdamW keep no maximum of the second moment)");
  }
}

}  // namespace

AdamWOptions::operator OptimizerOptions() const {
  refuse_amsgrad(amsgrad(), "AdamWOptions");
  return memory_options()
      .algorithm(Algorithm::adamw)
      .lr(lr())
      .beta1(std::get<0>(betas()))
      .beta2(std::get<1>(betas()))
      .eps(eps())
      .weight_decay(weight_decay());
}

AdamOptions::operator OptimizerOptions() const {
  refuse_amsgrad(amsgrad(), "AdamOptions");
  return memory_options()
      .algorithm(Algorithm::adam)
      .lr(lr())
      .beta1(std::get<0>(betas()))
      .beta2(std::get<1>(betas()))
      .eps(eps())
      .weight_decay(weight_decay());
}

SGDOptions::operator OptimizerOptions() const {
  return memory_options()
      .algorithm(Algorithm::sgd)
      .lr(lr())
      .momentum(momentum())
      .dampening(dampening())
      .weight_decay(weight_decay())
      .nesterov(nesterov());
}

Optimizer::Optimizer(const std::vector<at::Tensor>& parameters, const OptimizerOptions& options)
    : Optimizer(std::vector<ParamGroup>{ParamGroup(parameters)}, options) {}

Optimizer::Optimizer(const torch::OrderedDict<std::string, at::Tensor>& named_parameters, const OptimizerOptions& options)
    : Optimizer(one_group(named_parameters), options) {}

Optimizer::Optimizer(std::vector<ParamGroup> groups, const OptimizerOptions& options) : impl_(std::make_shared<Impl>()) {
  check_options(options);
  impl_->options = options;
  std::map<std::string, int> seen;
  size_t position = 0;  // of the parameter among all groups', for unnamed ones
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup& group = groups[g];
    if (group.names.empty()) {
      for (size_t i = 0; i < group.params.size(); ++i) group.names.push_back(std::to_string(position + i));
    }
    position += group.params.size();
    if (group.names.size() != group.params.size()) {
      throw std::invalid_argument("optimizer: group " + std::to_string(g) + " has " + std::to_string(group.names.size()) + " names for " +
                                  std::to_string(group.params.size()) + " parameters");
    }
    const double lr = group.lr.value_or(options.lr());
    const double wd = group.weight_decay.value_or(options.weight_decay());
    if (!(lr >= 0) || !(wd >= 0)) {
      throw std::invalid_argument("optimizer: group " + std::to_string(g) + " needs lr >= 0 and weight_decay >= 0");
    }
    impl_->group_lr.push_back(lr);
    impl_->group_base_lr.push_back(lr);
    impl_->group_weight_decay.push_back(wd);
    for (size_t i = 0; i < group.params.size(); ++i) {
      if (seen[group.names[i]]++) throw std::invalid_argument("optimizer: parameter '" + group.names[i] + "' appears twice");
      if (!group.params[i].requires_grad()) continue;  // frozen: nothing to optimize
      impl_->params.push_back({group.names[i], group.params[i], g, {}, 0, group.params[i].numel()});
    }
  }
  // Quantized state shares code tables per device: build them now rather than in the first step.
  const StatePrecision precision = options.state().precision();
  if (options.algorithm() != Algorithm::sgd && (precision == StatePrecision::int8 || precision == StatePrecision::int4)) {
    std::vector<std::string> devices;
    for (const auto& p : impl_->params) {
      if (effective_precision(p.tensor.numel(), options.state()) != precision) continue;
      const at::Device d = options.state().placement() == StatePlacement::device ? p.tensor.device() : at::Device(at::kCPU);
      if (std::find(devices.begin(), devices.end(), d.str()) != devices.end()) continue;
      devices.push_back(d.str());
      for (bool is_signed : {true, false}) {
        impl_->code_tables.push_back(retain_code_tables(is_signed, precision == StatePrecision::int8 ? 8 : 4, d));
      }
    }
  }
  // Both modes hook each parameter's AccumulateGrad node: standard mode only to tag the gradient
  // for the memory tracker (so .grad, and nothing else backward makes, is 'gradient').
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    const at::Tensor& p = impl_->params[i].tensor;
    if (options.mode() != Mode::in_backward && !p.is_leaf()) continue;
    TORCH_CHECK(p.is_leaf(), "optimizer: parameter '", impl_->params[i].name, "' is not a leaf tensor");
    auto acc = torch::autograd::impl::grad_accumulator(p);
    const uintptr_t key = acc->add_post_hook(std::make_unique<GradientReady>(impl_, i));
    impl_->hooks.push_back({acc, key});
  }
}

Optimizer::~Optimizer() {
  for (auto& h : impl_->hooks) h.accumulator->del_post_hook(h.key);
}

void Optimizer::backward(const at::Tensor& loss) {
  Impl& s = *impl_;
  memory::ImplicitPhase phase(memory::Phase::backward);
  if (s.options.mode() == Mode::in_backward && s.options.clip() == Clip::global_norm_two_pass) {
    // Pass 1: measure the global norm; gradients are freed as they come, the graph is kept.
    s.pass = Pass::measure_norm;
    s.norm_sq = at::Tensor();
    try {
      checkpoint::KeepForAnotherBackward keep;
      loss.backward({}, /*retain_graph=*/true);
    } catch (...) {
      s.pass = Pass::step;
      throw;
    }
    s.pass = Pass::step;
    if (s.exchange) {
      const double local = s.norm_sq.defined() ? s.norm_sq.item<double>() : 0.0;
      s.norm_sq = at::scalar_tensor(s.exchange->sum(local), at::kDouble);  // every rank's owned parameters
      // The first pass's averages are done: what their operations held (the last gradients) is
      // freed now, not in the second pass's backward, where it would add to the loss's peak.
      s.exchange->release(/*wait=*/true);
    }
    const at::Tensor norm = s.norm_sq.defined() ? s.norm_sq.sqrt() : at::zeros({}, at::kDouble);
    s.last_grad_norm = norm.item<double>();
    s.global_coef = clip_coefficient(norm, s.options.max_grad_norm());
    s.norm_ready = true;
    // Pass 2: update with the clipped gradients.
    try {
      loss.backward();
      if (s.exchange) s.settle();
    } catch (...) {
      s.norm_ready = false;
      throw;
    }
    s.norm_ready = false;
    return;
  }
  loss.backward();
  if (s.exchange && s.options.mode() == Mode::in_backward) s.settle();
}

bool Optimizer::step() {
  Impl& s = *impl_;
  if (++s.micro_steps % s.options.accumulation_steps() != 0) return false;
  memory::ImplicitPhase phase(memory::Phase::optimizer);
  if (s.options.mode() == Mode::in_backward) {
    if (s.exchange) s.settle();  // loss.backward() was called directly
    ++s.steps_taken;
    memory::mark_step_if_implicit(s.steps_taken);
    return true;
  }
  at::NoGradGuard no_grad;
  if (s.exchange) {
    // Every gradient on its way to its owner at once; the others' copies are dropped on arrival.
    std::vector<Exchange::Wait> waits;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const at::Tensor g = s.params[i].tensor.grad();
      if (g.defined()) waits.push_back(s.exchange->average_gradient(i, g));
    }
    for (auto& w : waits) w();
    waits.clear();
    for (size_t i = 0; i < s.params.size(); ++i) {
      if (!s.owns(i)) s.params[i].tensor.mutable_grad().reset();
    }
    s.exchange->release(/*wait=*/true);
  }
  if (s.options.clip() == Clip::global_norm || s.options.clip() == Clip::global_norm_two_pass) {
    at::Tensor norm_sq;
    for (auto& p : s.params) {
      const at::Tensor g = p.tensor.grad();
      if (!g.defined()) continue;
      const at::Tensor n = Impl::own(p, g).norm().to(at::kDouble);
      norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
    }
    if (s.exchange) norm_sq = at::scalar_tensor(s.exchange->sum(norm_sq.defined() ? norm_sq.item<double>() : 0.0), at::kDouble);
    const at::Tensor norm = norm_sq.defined() ? norm_sq.sqrt() : at::zeros({}, at::kDouble);
    s.last_grad_norm = norm.item<double>();
    const at::Tensor coef = clip_coefficient(norm, s.options.max_grad_norm());
    for (auto& p : s.params) {
      at::Tensor g = p.tensor.grad();
      if (g.defined()) g.mul_(coef.to(g.scalar_type()));
    }
  }
  for (auto& p : s.params) {
    at::Tensor g = p.tensor.grad();
    if (!g.defined()) continue;
    if (s.options.clip() == Clip::per_param_norm) s.clip_per_param(p, Impl::own(p, g));
    s.update(p, g);
  }
  if (s.exchange) {
    for (size_t i = 0; i < s.params.size(); ++i) s.shares.push_back(s.exchange->share_parameter(i, s.params[i].tensor));
    s.settle();
  }
  ++s.steps_taken;
  memory::mark_step_if_implicit(s.steps_taken);
  return true;
}

void Optimizer::zero_grad() {
  if (impl_->micro_steps % impl_->options.accumulation_steps() != 0) return;  // still accumulating
  for (auto& p : impl_->params) p.tensor.mutable_grad().reset();
}

const OptimizerOptions& Optimizer::options() const { return impl_->options; }
size_t Optimizer::num_groups() const { return impl_->group_lr.size(); }
double Optimizer::lr(size_t group) const { return impl_->group_lr.at(group); }
double Optimizer::base_lr(size_t group) const { return impl_->group_base_lr.at(group); }
void Optimizer::set_lr(size_t group, double lr) {
  TORCH_CHECK(lr >= 0, "optimizer: lr must be >= 0, got ", lr);
  impl_->group_lr.at(group) = lr;
}
void Optimizer::set_exchange(std::shared_ptr<Exchange> exchange) {
  if (impl_->exchange) impl_->settle();
  impl_->exchange = std::move(exchange);
  for (size_t i = 0; i < impl_->params.size(); ++i) {
    Impl::Param& p = impl_->params[i];
    const auto range = impl_->exchange ? impl_->exchange->owned_range(i) : std::make_pair<int64_t, int64_t>(0, p.tensor.numel());
    TORCH_CHECK(range.first >= 0 && range.first <= range.second && range.second <= p.tensor.numel(), "optimizer: the exchange's range of '",
                p.name, "' is outside its ", p.tensor.numel(), " elements");
    TORCH_CHECK((range.first == 0 && range.second == p.tensor.numel()) || p.tensor.is_contiguous(), "optimizer: parameter '", p.name,
                "' must be contiguous to be split over ranks");
    if (range.first != p.begin || range.second != p.end) p.state = ParamState();  // its state lives with its owner
    p.begin = range.first;
    p.end = range.second;
  }
}
std::vector<std::string> Optimizer::parameter_names() const {
  std::vector<std::string> out;
  for (const auto& p : impl_->params) out.push_back(p.name);
  return out;
}
std::vector<int64_t> Optimizer::parameter_numels() const {
  std::vector<int64_t> out;
  for (const auto& p : impl_->params) out.push_back(p.tensor.numel());
  return out;
}
void Optimizer::set_bytes_in_flight(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "optimizer: bytes in flight must be >= 0, got ", bytes);
  impl_->bytes_in_flight = bytes;
}
double Optimizer::last_grad_norm() const { return impl_->last_grad_norm; }
double Optimizer::update_seconds() const { return impl_->update_seconds; }
double Optimizer::state_transfer_seconds() const { return impl_->state_transfer_seconds; }
int64_t Optimizer::steps_taken() const { return impl_->steps_taken; }

TensorDict Optimizer::state_dict() const {
  TensorDict out;
  for (const auto& p : impl_->params) {
    if (p.state.step == 0) continue;
    // A slice of a parameter split over ranks: "<name>@<begin>:<end>.<field>".
    const std::string key = Impl::whole(p) ? p.name : p.name + "@" + std::to_string(p.begin) + ":" + std::to_string(p.end);
    out[key + ".step"] = at::scalar_tensor(p.state.step, at::kLong);
    if (p.state.exp_avg.defined()) out[key + ".exp_avg"] = p.state.exp_avg;
    if (p.state.exp_avg_sq.defined()) out[key + ".exp_avg_sq"] = p.state.exp_avg_sq;
    if (p.state.m) p.state.m->save(out, key + ".exp_avg");
    if (p.state.v) p.state.v->save(out, key + ".exp_avg_sq");
    if (p.state.momentum_buffer.defined()) out[key + ".momentum_buffer"] = p.state.momentum_buffer;
  }
  return out;
}

namespace {

// The fields a parameter's state can have, as suffixes of its entries' names.
const char* const kStateFields[] = {"step",          "exp_avg",        "exp_avg_sq",       "momentum_buffer",
                                    "exp_avg.codes", "exp_avg.absmax", "exp_avg_sq.codes", "exp_avg_sq.absmax"};

struct SourceEntry {
  std::string name;  // in the source
  at::IntArrayRef shape;
  std::string field;  // which of kStateFields
};

// A loaded entry's values checked against what its field can hold, before anything is restored
// from it: a moment of the wrong type (an integer tensor converts silently), a non-finite value or
// a negative second moment would turn the next update of the parameter into NaN.
void check_state_values(const SourceEntry& entry, const at::Tensor& t) {
  const std::string& f = entry.field;
  auto refuse = [&](const std::string& why) { throw std::invalid_argument("optimizer: state entry " + entry.name + " " + why); };
  const at::ScalarType dtype = t.scalar_type();
  const std::string type = c10::toString(dtype);
  if (f == "step") {
    if (!at::isIntegralType(dtype, /*includeBool=*/false)) refuse("is " + type + "; a step count must be an integer");
    const int64_t step = t.reshape({-1})[0].item<int64_t>();
    // A saved state has taken at least one step (state_dict leaves out parameters that have none).
    if (step < 1 || step > (int64_t{1} << 53)) refuse("is " + std::to_string(step) + "; a step count must be from 1 to 2^53");
    return;
  }
  if (f == "exp_avg.codes" || f == "exp_avg_sq.codes") {
    if (dtype != at::kByte) refuse("is " + type + "; quantized codes must be U8");
    return;
  }
  const bool scales = f == "exp_avg.absmax" || f == "exp_avg_sq.absmax";
  if (scales && dtype != at::kFloat) refuse("is " + type + "; block scales must be F32");
  if (!scales && !at::isFloatingType(dtype)) refuse("is " + type + "; a moment must be floating point, like its parameter");
  if (!io::all_finite(t)) refuse("holds a value that is not finite (NaN or infinity)");
  if ((scales || f == "exp_avg_sq") && io::any_negative(t)) {
    refuse(std::string("holds a negative value; ") + (scales ? "block scales" : "a second moment") + " cannot be negative");
  }
}

// The saved state of a parameter's flattened elements [begin, end): all of them (a name without
// "@"), or the slice one rank of a data-parallel run kept ("<name>@<begin>:<end>").
struct SavedSlice {
  int64_t begin = 0, end = 0;
  bool whole = true;
  std::map<std::string, SourceEntry> fields;  // field -> entry
};

int64_t numel_of(at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// "B:E" -> (B, E); false when it is not two decimal numbers.
bool parse_range(const std::string& text, int64_t& begin, int64_t& end) {
  const size_t colon = text.find(':');
  auto number = [](const std::string& t, int64_t& v) {
    const std::optional<int64_t> n = t.empty() || t[0] == '-' ? std::nullopt : io::to_int(t);
    if (n) v = *n;
    return n.has_value();
  };
  return colon != std::string::npos && number(text.substr(0, colon), begin) && number(text.substr(colon + 1), end);
}

}  // namespace

void Optimizer::load_state(const StateDictSource& source) {
  std::map<std::string, Impl::Param*> by_name;
  for (auto& p : impl_->params) by_name[p.name] = &p;
  // 1. Everything that can be checked from names and shapes, before a byte of data is loaded.
  std::vector<std::string> unknown, repeated, bad_shape, missing;
  std::map<std::string, std::map<std::pair<int64_t, int64_t>, SavedSlice>> parsed;  // parameter -> range -> slice
  for (const auto& [key, shape_vec] : source.entries) {
    const at::IntArrayRef shape(shape_vec);
    bool matched = false;
    for (const char* field : kStateFields) {
      const std::string suffix = std::string(".") + field;
      if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      const std::string base = key.substr(0, key.size() - suffix.size());
      const size_t at = base.rfind('@');
      const std::string name = at == std::string::npos ? base : base.substr(0, at);
      auto it = by_name.find(name);
      int64_t begin = 0, end = 0;
      if (it == by_name.end() || (at != std::string::npos && !parse_range(base.substr(at + 1), begin, end))) break;
      matched = true;
      const int64_t n = it->second->tensor.numel();
      const bool whole = at == std::string::npos;
      if (whole) {
        end = n;
      } else if (!(begin < end && end <= n)) {
        bad_shape.push_back(key + ": elements " + std::to_string(begin) + ":" + std::to_string(end) + " of a parameter of " +
                            std::to_string(n));
        break;
      }
      const std::string f(field);
      const at::IntArrayRef param_shape = it->second->tensor.sizes();
      if (f == "step" && numel_of(shape) != 1) {
        std::ostringstream m;
        m << key << " " << shape << " vs a single count";
        bad_shape.push_back(m.str());
      } else if (f != "step" && f.find('.') == std::string::npos &&
                 (whole ? !shape.equals(param_shape) : !(shape.size() == 1 && shape[0] == end - begin))) {
        std::ostringstream m;
        m << key << " " << shape << " vs " << (whole ? "parameter " : "a slice of ");
        if (whole)
          m << param_shape;
        else
          m << "[" << end - begin << "]";
        bad_shape.push_back(m.str());
      }
      SavedSlice& slice = parsed[name][{begin, end}];
      slice.begin = begin;
      slice.end = end;
      slice.whole = whole;
      if (!slice.fields.emplace(f, SourceEntry{key, shape, f}).second) repeated.push_back(key);
      break;
    }
    if (!matched) unknown.push_back(key);
  }
  const bool adam = impl_->options.algorithm() != Algorithm::sgd;
  for (const auto& [name, slices] : parsed) {
    const int64_t n = by_name.at(name)->tensor.numel();
    int64_t covered = 0;  // the slices must tile the parameter: 0:a, a:b, ..., z:n
    for (const auto& [range, slice] : slices) {
      const std::string label = slice.whole ? name : name + "@" + std::to_string(range.first) + ":" + std::to_string(range.second);
      const auto& fields = slice.fields;
      if (!fields.count("step")) missing.push_back(label + ".step");
      auto has = [&](const std::string& m) { return fields.count(m) || (fields.count(m + ".codes") && fields.count(m + ".absmax")); };
      if (adam && (!has("exp_avg") || !has("exp_avg_sq"))) missing.push_back(label + ".exp_avg/exp_avg_sq");
      for (const std::string m : {"exp_avg", "exp_avg_sq"}) {
        const auto codes = fields.find(m + ".codes"), absmax = fields.find(m + ".absmax");
        if (codes == fields.end() || absmax == fields.end()) continue;
        const int64_t len = range.second - range.first, c = numel_of(codes->second.shape), a = numel_of(absmax->second.shape);
        if (!quantized_bits_of(len, c, a)) {
          bad_shape.push_back(label + "." + m + ": " + std::to_string(c) + " codes and " + std::to_string(a) +
                              " scales fit no 8- or 4-bit blocks of " + std::to_string(len) + " values");
        }
      }
      if (range.first != covered) {
        bad_shape.push_back(name + ": the saved slices leave a gap or overlap at element " +
                            std::to_string(std::min(covered, range.first)));
      }
      covered = std::max(covered, range.second);
    }
    if (covered != n)
      bad_shape.push_back(name + ": the saved slices end at element " + std::to_string(covered) + " of " + std::to_string(n));
  }
  if (!source.entries.empty()) {
    for (const auto& p : impl_->params) {
      if (!parsed.count(p.name) && impl_->owns(p)) missing.push_back(p.name);
    }
  }
  if (!unknown.empty() || !repeated.empty() || !bad_shape.empty() || !missing.empty()) {
    std::ostringstream m;
    m << "optimizer: the state does not match the parameters.";
    auto list = [&](const char* what, const std::vector<std::string>& items) {
      if (items.empty()) return;
      m << " " << what << ":";
      for (size_t i = 0; i < items.size() && i < 10; ++i) m << (i ? ", " : " ") << items[i];
      if (items.size() > 10) m << " (and " << items.size() - 10 << " more)";
      m << ".";
    };
    list("Unknown entries", unknown);
    list("Repeated entries", repeated);
    list("Wrong shapes", bad_shape);
    list("Missing", missing);
    throw std::invalid_argument(m.str());
  }
  // 2. Parameter by parameter: load its entries, restore its state, drop them. The old state goes
  // first, so old and new never exist together.
  at::NoGradGuard no_grad;
  memory::CategoryScope scope(memory::Category::optimizer_state);
  for (auto& p : impl_->params) p.state = ParamState();
  auto load_entry = [&source](const SourceEntry& entry) {
    at::Tensor t = source.load(entry.name);
    if (!t.defined() || !t.sizes().equals(entry.shape)) {
      std::ostringstream m;
      m << "optimizer: state entry " << entry.name << " was listed as " << entry.shape << " but loaded as ";
      if (t.defined())
        m << t.sizes();
      else
        m << "no tensor";
      throw std::invalid_argument(m.str());
    }
    check_state_values(entry, t);
    return t;
  };
  // One saved moment of a slice as fp32 values, decoded when it was saved as codes and scales.
  auto decoded = [&](const SavedSlice& slice, const std::string& m, bool is_signed) {
    if (slice.fields.count(m)) return load_entry(slice.fields.at(m)).reshape({-1}).to(at::kFloat);
    TensorDict q{{m + ".codes", load_entry(slice.fields.at(m + ".codes"))}, {m + ".absmax", load_entry(slice.fields.at(m + ".absmax"))}};
    const int64_t len = slice.end - slice.begin;
    StateBuffer buffer(at::empty({len}, at::kFloat), is_signed, StateOptions().precision(StatePrecision::fp32));
    buffer.restore(q, m);
    return buffer.load(0, len, at::Device(at::kCPU)).reshape({-1});
  };
  try {
    for (auto& p : impl_->params) {
      auto it = parsed.find(p.name);
      if (it == parsed.end() || !impl_->owns(p)) continue;  // another rank's: it loads its own
      const at::Tensor target = Impl::own(p, p.tensor);     // what this rank updates
      TensorDict f;                                         // field -> tensor, this parameter's (this range's) only
      const auto exact = it->second.find({p.begin, p.end});
      if (exact != it->second.end()) {
        for (const auto& [field, entry] : exact->second.fields) f[field] = load_entry(entry);
      } else {
        // Saved at another world size: this range's values gathered from the slices it overlaps.
        for (const std::string m : {"exp_avg", "exp_avg_sq", "momentum_buffer"}) {
          std::vector<at::Tensor> pieces;
          for (const auto& [range, slice] : it->second) {
            const int64_t from = std::max(range.first, p.begin), to = std::min(range.second, p.end);
            if (from >= to) continue;
            if (f.count("step") == 0) f["step"] = load_entry(slice.fields.at("step"));
            if (!slice.fields.count(m) && !slice.fields.count(m + ".codes")) continue;
            pieces.push_back(decoded(slice, m, m != "exp_avg_sq").narrow(0, from - range.first, to - from));
          }
          if (!pieces.empty()) f[m] = at::cat(pieces).view(target.sizes());
        }
      }
      const auto opts = target.options();
      p.state.step = f.at("step").item<int64_t>();
      const Hyper h = impl_->hyper(p.group);
      if (adam && h.buffered(target)) {
        p.state.m = std::make_shared<StateBuffer>(target, true, h.state);
        p.state.v = std::make_shared<StateBuffer>(target, false, h.state);
        try {
          p.state.m->restore(f, "exp_avg");
          p.state.v->restore(f, "exp_avg_sq");
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument("optimizer: parameter '" + p.name + "': " + e.what());
        }
        continue;
      }
      auto dense = [&](const std::string& m) {
        if (f.count(m)) return f.at(m).view(target.sizes()).to(opts, /*non_blocking=*/false, /*copy=*/true);
        // codes and scales from a quantized optimizer: decode them
        StateBuffer decoded_state(target, m == "exp_avg", StateOptions().precision(StatePrecision::fp32));
        decoded_state.restore(f, m);
        return decoded_state.load(0, target.numel(), target.device()).view(target.sizes()).to(opts, false, true);
      };
      if (adam) {
        p.state.exp_avg = dense("exp_avg");
        p.state.exp_avg_sq = dense("exp_avg_sq");
      }
      if (f.count("momentum_buffer")) p.state.momentum_buffer = f.at("momentum_buffer").view(target.sizes()).to(opts, false, true);
    }
  } catch (...) {
    for (auto& p : impl_->params) p.state = ParamState();  // no half-restored state
    throw;
  }
}

void Optimizer::load_state_dict(const TensorDict& state) {
  StateDictSource source;
  for (const auto& [name, tensor] : state) source.entries.emplace_back(name, tensor.sizes().vec());
  source.load = [&state](const std::string& name) { return state.at(name); };
  load_state(source);
}

namespace {
constexpr const char* kArchiveKey = "frugal_optimizer_state";
}  // namespace

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const Optimizer& optimizer) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : optimizer.state_dict()) dict.insert(name, tensor);
  archive.write(kArchiveKey, c10::IValue(dict));
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Optimizer& optimizer) {
  c10::IValue value;
  if (!archive.try_read(kArchiveKey, value) || !value.isGenericDict()) {
    throw std::invalid_argument(std::string("optimizer: the archive holds no '") + kArchiveKey +
                                "' entry (it was not written by torch::save of a frugal optimizer)");
  }
  TensorDict state;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw std::invalid_argument(std::string("optimizer: the archive's '") + kArchiveKey +
                                  "' holds an entry that is not a name and a tensor");
    }
    state.emplace(item.key().toStringRef(), item.value().toTensor());
  }
  optimizer.load_state_dict(state);
  return archive;
}

StatePrecision Optimizer::state_precision(size_t i) const {
  const Impl::Param& p = impl_->params.at(i);
  return effective_precision(p.end - p.begin, impl_->options.state());
}

int64_t Optimizer::state_bytes() const {
  int64_t total = 0;
  for (const auto& p : impl_->params) {
    for (const at::Tensor* t : {&p.state.exp_avg, &p.state.exp_avg_sq, &p.state.momentum_buffer}) {
      if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
    }
    if (p.state.m) total += p.state.m->bytes() + p.state.v->bytes();
  }
  return total;
}

StateBufferBytes state_bytes_for_parameter(int64_t numel, at::ScalarType dtype, const OptimizerOptions& o) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  StateBufferBytes b;
  if (o.algorithm() == Algorithm::sgd) {
    b.total = o.momentum() > 0 ? numel * e : 0;  // the momentum buffer, a clone of the gradient
    return b;
  }
  const bool buffered = uses_buffered_state(dtype, o.state(), o.stochastic_rounding());
  if (!buffered) {
    b.total = 2 * numel * e;  // exp_avg and exp_avg_sq like the parameter, as torch::optim keeps them
    return b;
  }
  const StateBufferBytes one = state_buffer_bytes(numel, o.state());
  b.total = 2 * one.total;
  b.in_files = 2 * one.in_files;
  b.window = 2 * one.window;
  return b;
}

int64_t update_temporary_bytes(int64_t numel, at::ScalarType dtype, at::Device device, const OptimizerOptions& o) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  if (o.algorithm() == Algorithm::sgd) return 0;
  const bool buffered = uses_buffered_state(dtype, o.state(), o.stochastic_rounding());
  const StatePrecision p = effective_precision(numel, o.state());
  // File placement: both moments' chunk mapped in and out within the update (the tracker's
  // temporary memory: made and freed in the update's scope).
  const int64_t window = buffered ? 2 * state_buffer_bytes(numel, o.state()).window : 0;
  if (uses_dense_kernel(dtype, device, buffered, p)) return window;  // one fused pass in place
  if (!buffered) return 2 * numel * e;
  if ((p == StatePrecision::int8 || p == StatePrecision::int4) && uses_fused_kernel(dtype, device)) {
    // On a GPU with the state off it, the CUDA kernel holds one chunk's codes and scales of both
    // moments on the device; otherwise nothing.
    if (device.is_cpu() || o.state().placement() == StatePlacement::device) return window;
    StateOptions on_device = o.state();
    on_device.placement(StatePlacement::device);
    return window + 2 * state_buffer_bytes(std::min(numel, o.state().chunk_elements()), on_device).total;
  }
  // fp32 chunks: parameter, gradient, m, v, the update, and the noise of stochastic rounding (measured: 23 B a value)
  return window + std::min(numel, o.state().chunk_elements()) * 24;
}

int64_t shared_code_table_bytes(const std::vector<int64_t>& numels, const OptimizerOptions& o) {
  if (o.algorithm() == Algorithm::sgd) return 0;
  const StatePrecision p = o.state().precision();
  if (p != StatePrecision::int8 && p != StatePrecision::int4) return 0;
  const bool any = std::any_of(numels.begin(), numels.end(), [&](int64_t n) { return effective_precision(n, o.state()) == p; });
  return any ? 2 * code_table_bytes(p == StatePrecision::int8 ? 8 : 4) : 0;  // signed and unsigned maps
}

}  // namespace optim
}  // namespace frugal
