#include "frugal/optim/optimizer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "frugal/checkpoint/checkpoint.h"
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
at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) {
  return (max_norm / (norm + 1e-6)).clamp_max(1.0);
}

}  // namespace

struct Optimizer::Impl {
  OptimizerOptions options;
  struct Param {
    std::string name;
    at::Tensor tensor;
    size_t group;
    ParamState state;
  };
  std::vector<Param> params;
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
  at::Tensor norm_sq;       // sum of squared gradient norms in the measuring pass (double)
  at::Tensor global_coef;   // the clip coefficient for the stepping pass

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
    auto moved = [&p] {
      return (p.state.m ? p.state.m->transfer_seconds() : 0.0) + (p.state.v ? p.state.v->transfer_seconds() : 0.0);
    };
    const double moved_before = moved();
    apply_update(hyper(p.group), p.state, p.tensor, grad);
    update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state_transfer_seconds += moved() - moved_before;
  }
  double update_seconds = 0;
  double state_transfer_seconds = 0;

  // The gradient of params[i] is complete (autograd accumulated it): it is a gradient from its
  // allocation on, for the tracker; in in-backward mode it is used and freed now.
  void on_gradient(size_t i) {
    Param& p = params[i];
    at::Tensor grad = p.tensor.grad();
    if (!grad.defined()) return;
    memory::tag(grad, memory::Category::gradient);
    if (options.mode() != Mode::in_backward) return;
    at::NoGradGuard no_grad;
    if (pass == Pass::measure_norm) {
      const at::Tensor n = grad.norm().to(at::kDouble);
      norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
    } else {
      TORCH_CHECK(options.clip() != Clip::global_norm_two_pass || norm_ready,
                  "optimizer: two-pass global-norm clipping needs optimizer.backward(loss) instead of "
                  "loss.backward(), so that the norm is measured first");
      if (options.clip() == Clip::global_norm_two_pass) {
        grad.mul_(global_coef.to(grad.scalar_type()));
      } else if (options.clip() == Clip::per_param_norm) {
        grad.mul_(clip_coefficient(grad.norm(), options.max_grad_norm()));
      }
      update(p, grad);
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
        "accumulated over " + std::to_string(o.accumulation_steps()) +
        " micro-batches; use standard mode to accumulate, or a larger batch");
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

}  // namespace

Optimizer::Optimizer(const torch::OrderedDict<std::string, at::Tensor>& named_parameters,
                     const OptimizerOptions& options)
    : Optimizer(one_group(named_parameters), options) {}

Optimizer::Optimizer(std::vector<ParamGroup> groups, const OptimizerOptions& options)
    : impl_(std::make_shared<Impl>()) {
  check_options(options);
  impl_->options = options;
  std::map<std::string, int> seen;
  for (size_t g = 0; g < groups.size(); ++g) {
    ParamGroup& group = groups[g];
    if (group.names.size() != group.params.size()) {
      throw std::invalid_argument("optimizer: group " + std::to_string(g) + " has " +
                                  std::to_string(group.names.size()) + " names for " +
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
      impl_->params.push_back({group.names[i], group.params[i], g, {}});
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
    const at::Tensor norm = s.norm_sq.defined() ? s.norm_sq.sqrt() : at::zeros({}, at::kDouble);
    s.last_grad_norm = norm.item<double>();
    s.global_coef = clip_coefficient(norm, s.options.max_grad_norm());
    s.norm_ready = true;
    // Pass 2: update with the clipped gradients.
    try {
      loss.backward();
    } catch (...) {
      s.norm_ready = false;
      throw;
    }
    s.norm_ready = false;
    return;
  }
  loss.backward();
}

bool Optimizer::step() {
  Impl& s = *impl_;
  if (++s.micro_steps % s.options.accumulation_steps() != 0) return false;
  if (s.options.mode() == Mode::in_backward) {
    ++s.steps_taken;
    return true;
  }
  at::NoGradGuard no_grad;
  if (s.options.clip() == Clip::global_norm || s.options.clip() == Clip::global_norm_two_pass) {
    at::Tensor norm_sq;
    for (auto& p : s.params) {
      const at::Tensor g = p.tensor.grad();
      if (!g.defined()) continue;
      const at::Tensor n = g.norm().to(at::kDouble);
      norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
    }
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
    if (s.options.clip() == Clip::per_param_norm) g.mul_(clip_coefficient(g.norm(), s.options.max_grad_norm()));
    s.update(p, g);
  }
  ++s.steps_taken;
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
double Optimizer::last_grad_norm() const { return impl_->last_grad_norm; }
double Optimizer::update_seconds() const { return impl_->update_seconds; }
double Optimizer::state_transfer_seconds() const { return impl_->state_transfer_seconds; }
int64_t Optimizer::steps_taken() const { return impl_->steps_taken; }

TensorDict Optimizer::state_dict() const {
  TensorDict out;
  for (const auto& p : impl_->params) {
    if (p.state.step == 0) continue;
    out[p.name + ".step"] = at::scalar_tensor(p.state.step, at::kLong);
    if (p.state.exp_avg.defined()) out[p.name + ".exp_avg"] = p.state.exp_avg;
    if (p.state.exp_avg_sq.defined()) out[p.name + ".exp_avg_sq"] = p.state.exp_avg_sq;
    if (p.state.m) p.state.m->save(out, p.name + ".exp_avg");
    if (p.state.v) p.state.v->save(out, p.name + ".exp_avg_sq");
    if (p.state.momentum_buffer.defined()) out[p.name + ".momentum_buffer"] = p.state.momentum_buffer;
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
};

int64_t numel_of(at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

}  // namespace

void Optimizer::load_state(const StateDictSource& source) {
  std::map<std::string, Impl::Param*> by_name;
  for (auto& p : impl_->params) by_name[p.name] = &p;
  // 1. Everything that can be checked from names and shapes, before a byte of data is loaded.
  std::vector<std::string> unknown, repeated, bad_shape, missing;
  std::map<std::string, std::map<std::string, SourceEntry>> parsed;  // parameter -> field -> entry
  for (const auto& [key, shape_vec] : source.entries) {
    const at::IntArrayRef shape(shape_vec);
    bool matched = false;
    for (const char* field : kStateFields) {
      const std::string suffix = std::string(".") + field;
      if (key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0) {
        const std::string name = key.substr(0, key.size() - suffix.size());
        auto it = by_name.find(name);
        if (it == by_name.end()) break;
        matched = true;
        const std::string f(field);
        const at::IntArrayRef param_shape = it->second->tensor.sizes();
        if (f == "step" && numel_of(shape) != 1) {
          std::ostringstream m;
          m << key << " " << shape << " vs a single count";
          bad_shape.push_back(m.str());
        } else if (f != "step" && f.find('.') == std::string::npos && !shape.equals(param_shape)) {
          std::ostringstream m;
          m << key << " " << shape << " vs parameter " << param_shape;
          bad_shape.push_back(m.str());
        }
        if (!parsed[name].emplace(f, SourceEntry{key, shape}).second) repeated.push_back(key);
        break;
      }
    }
    if (!matched) unknown.push_back(key);
  }
  const bool adam = impl_->options.algorithm() != Algorithm::sgd;
  for (const auto& [name, fields] : parsed) {
    if (!fields.count("step")) missing.push_back(name + ".step");
    auto has = [&](const std::string& m) { return fields.count(m) || (fields.count(m + ".codes") && fields.count(m + ".absmax")); };
    if (adam && (!has("exp_avg") || !has("exp_avg_sq"))) missing.push_back(name + ".exp_avg/exp_avg_sq");
    for (const std::string m : {"exp_avg", "exp_avg_sq"}) {
      const auto codes = fields.find(m + ".codes"), absmax = fields.find(m + ".absmax");
      if (codes == fields.end() || absmax == fields.end()) continue;
      const int64_t n = by_name.at(name)->tensor.numel(), c = numel_of(codes->second.shape), a = numel_of(absmax->second.shape);
      if (!quantized_bits_of(n, c, a)) {
        bad_shape.push_back(name + "." + m + ": " + std::to_string(c) + " codes and " + std::to_string(a) +
                            " scales fit no 8- or 4-bit blocks of " + std::to_string(n) + " values");
      }
    }
  }
  if (!source.entries.empty()) {
    for (const auto& p : impl_->params) {
      if (!parsed.count(p.name)) missing.push_back(p.name);
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
  try {
    for (auto& p : impl_->params) {
      auto it = parsed.find(p.name);
      if (it == parsed.end()) continue;
      TensorDict f;  // field -> tensor, this parameter's only
      for (const auto& [field, entry] : it->second) {
        at::Tensor t = source.load(entry.name);
        if (!t.defined() || !t.sizes().equals(entry.shape)) {
          std::ostringstream m;
          m << "optimizer: state entry " << entry.name << " was listed as " << entry.shape << " but loaded as ";
          if (t.defined()) m << t.sizes(); else m << "no tensor";
          throw std::invalid_argument(m.str());
        }
        f[field] = std::move(t);
      }
      const auto opts = p.tensor.options();
      p.state.step = f.at("step").item<int64_t>();
      const Hyper h = impl_->hyper(p.group);
      if (adam && h.buffered(p.tensor)) {
        p.state.m = std::make_shared<StateBuffer>(p.tensor, true, h.state);
        p.state.v = std::make_shared<StateBuffer>(p.tensor, false, h.state);
        try {
          p.state.m->restore(f, "exp_avg");
          p.state.v->restore(f, "exp_avg_sq");
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument("optimizer: parameter '" + p.name + "': " + e.what());
        }
        continue;
      }
      auto dense = [&](const std::string& m) {
        if (f.count(m)) return f.at(m).to(opts, /*non_blocking=*/false, /*copy=*/true);
        // codes and scales from a quantized optimizer: decode them
        StateBuffer decoded(p.tensor, m == "exp_avg", StateOptions().precision(StatePrecision::fp32));
        decoded.restore(f, m);
        return decoded.load(0, p.tensor.numel(), p.tensor.device()).view(p.tensor.sizes()).to(opts, false, true);
      };
      if (adam) {
        p.state.exp_avg = dense("exp_avg");
        p.state.exp_avg_sq = dense("exp_avg_sq");
      }
      if (f.count("momentum_buffer")) p.state.momentum_buffer = f.at("momentum_buffer").to(opts, false, true);
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
  return b;
}

int64_t update_temporary_bytes(int64_t numel, at::ScalarType dtype, at::Device device, const OptimizerOptions& o) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  if (o.algorithm() == Algorithm::sgd) return 0;
  const bool buffered = uses_buffered_state(dtype, o.state(), o.stochastic_rounding());
  if (!buffered) return 2 * numel * e;
  const StatePrecision p = effective_precision(numel, o.state());
  if ((p == StatePrecision::int8 || p == StatePrecision::int4) && uses_fused_kernel(dtype, device)) {
    // On a GPU with the state off it, the CUDA kernel holds one chunk's codes and scales of both
    // moments on the device; otherwise nothing.
    if (device.is_cpu() || o.state().placement() == StatePlacement::device) return 0;
    StateOptions on_device = o.state();
    on_device.placement(StatePlacement::device);
    return 2 * state_buffer_bytes(std::min(numel, o.state().chunk_elements()), on_device).total;
  }
  // fp32 chunks: parameter, gradient, m, v, the update, and the noise of stochastic rounding (measured: 23 B a value)
  return std::min(numel, o.state().chunk_elements()) * 24;
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
