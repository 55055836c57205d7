#include "frugal/optim/optimizer.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/archive.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
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
#include "adam_kernel.h"
#include "frugal/memory/tracker.h"
#include "optimizer_impl.h"

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
  if (o.update_threads() < 0) bad("update_threads must be >= 0, got " + std::to_string(o.update_threads()));
  if (o.update_threads() > 0 && o.mode() != Mode::in_backward) {
    bad("update_threads runs in-backward updates on a thread of their own, so it needs mode in_backward (standard mode "
        "updates after backward, with every core)");
  }
  if (o.bytes_in_flight() < 0) bad("bytes_in_flight must be >= 0, got " + std::to_string(o.bytes_in_flight()));
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

// Adam's and AdamW's fields (the same in AdamOptions and AdamWOptions) on top of the memory choices.
template <typename Options>
OptimizerOptions adam_options(const Options& o, OptimizerOptions memory, Algorithm algorithm, const char* name) {
  refuse_amsgrad(o.amsgrad(), name);
  return memory.algorithm(algorithm)
      .lr(o.lr())
      .beta1(std::get<0>(o.betas()))
      .beta2(std::get<1>(o.betas()))
      .eps(o.eps())
      .weight_decay(o.weight_decay());
}

}  // namespace

AdamWOptions::operator OptimizerOptions() const { return adam_options(*this, memory_options(), Algorithm::adamw, "AdamWOptions"); }

AdamOptions::operator OptimizerOptions() const { return adam_options(*this, memory_options(), Algorithm::adam, "AdamOptions"); }

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
      // Field by field: GCC 12 takes a braced {} ParamState for maybe-uninitialized tensors.
      Impl::Param param;
      param.name = group.names[i];
      param.tensor = group.params[i];
      param.group = g;
      param.end = group.params[i].numel();
      impl_->params.push_back(std::move(param));
    }
  }
  // Quantized state shares code tables per device: build them now rather than in the first step.
  const StatePrecision precision = options.state().precision();
  if (options.algorithm() != Algorithm::sgd && is_quantized(precision)) {
    std::vector<std::string> devices;
    for (const auto& p : impl_->params) {
      if (effective_precision(p.tensor.numel(), options.state()) != precision) continue;
      const at::Device d = options.state().placement() == StatePlacement::device ? p.tensor.device() : at::Device(at::kCPU);
      if (std::find(devices.begin(), devices.end(), d.str()) != devices.end()) continue;
      devices.push_back(d.str());
      for (bool is_signed : {true, false}) {
        impl_->code_tables.push_back(retain_code_tables(is_signed, state_bits(precision), d));
      }
    }
  }
  if (options.update_threads() > 0) {
    for (const auto& p : impl_->params) {
      if (!p.tensor.device().is_cpu()) {
        throw std::invalid_argument("optimizer: update_threads runs the updates on a CPU thread beside backward, but parameter '" + p.name +
                                    "' is on " + p.tensor.device().str() +
                                    " (there the updates are kernels queued beside backward's already); set update_threads 0");
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
  try {
    impl_->finish_updates();
  } catch (...) {  // an update failed after the last call that could say so; nothing is left to tell
  }
}

namespace {
constexpr int kUpdateThreadNice = 10;  // how much lower the update thread's priority is than the process's
}  // namespace

void Optimizer::Impl::run_updates() {
  use_intra_op_threads_on_this_thread(static_cast<int>(options.update_threads()));
  // Below the training thread: backward is the step's critical path, and the updates are to take
  // the core it leaves idle rather than share its own evenly (the 7B 8-bit step: 58.3-60.4 s
  // against 59.4-64.7 s at equal priority). Linux keeps a nice value per thread; where it cannot
  // be lowered the thread runs at the process's.
  errno = 0;
  const int nice = ::getpriority(PRIO_PROCESS, 0);
  if (errno == 0) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), std::min(nice + kUpdateThreadNice, 19));
  Worker& w = *worker;
  for (;;) {
    Worker::Job job;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(w.mutex);
      w.changed.wait(lock, [&] { return w.stop || !w.jobs.empty(); });
      if (w.jobs.empty()) return;
      job = std::move(w.jobs.front());
      w.jobs.pop_front();
      skip = w.error || w.stop;  // after a failure the rest are dropped, as a failed backward drops them
    }
    const int64_t bytes = job.grad.numel() * static_cast<int64_t>(job.grad.element_size());
    std::exception_ptr error;
    {
      // The posting thread's tracker scope and phase: the update's allocations, and the gradient's
      // free below, are seen as if the hook had made them.
      at::ThreadLocalStateGuard state(*job.state);
      if (!skip) {
        try {
          at::NoGradGuard no_grad;
          clip_and_update(params[job.index], job.grad, *job.hyper);
        } catch (...) {
          error = std::current_exception();
        }
      }
      job.grad = at::Tensor();
    }
    {
      std::lock_guard<std::mutex> lock(w.mutex);
      if (error && !w.error) w.error = error;
      w.bytes -= bytes;
      --w.held;
    }
    w.changed.notify_all();
  }
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
      s.finish_updates();
    } catch (...) {
      s.finish_updates_quietly();
      s.norm_ready = false;
      throw;
    }
    s.norm_ready = false;
    return;
  }
  try {
    loss.backward();
  } catch (...) {
    s.finish_updates_quietly();  // nothing updates behind the caller's back once backward has failed
    throw;
  }
  s.finish_updates();
  if (s.exchange && s.options.mode() == Mode::in_backward) s.settle();
}

bool Optimizer::step() {
  Impl& s = *impl_;
  if (++s.micro_steps % s.options.accumulation_steps() != 0) return false;
  memory::ImplicitPhase phase(memory::Phase::optimizer);
  if (s.options.mode() == Mode::in_backward) {
    s.finish_updates();          // loss.backward() was called directly
    if (s.exchange) s.settle();  // likewise
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
  impl_->finish_updates();
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
  if (exchange && impl_->options.update_threads() > 0) {
    throw std::invalid_argument(
        "optimizer: update_threads cannot be used with data parallel (its hooks average each gradient before the update); "
        "set update_threads 0");
  }
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
  impl_->finish_updates();
  impl_->options.bytes_in_flight(bytes);
}
double Optimizer::last_grad_norm() const { return impl_->last_grad_norm; }
double Optimizer::update_seconds() const { return impl_->update_seconds; }
double Optimizer::state_transfer_seconds() const { return impl_->state_transfer_seconds; }
double Optimizer::update_wait_seconds() const { return impl_->worker ? impl_->worker->wait_seconds : 0.0; }
int64_t Optimizer::steps_taken() const { return impl_->steps_taken; }

StatePrecision Optimizer::state_precision(size_t i) const {
  const Impl::Param& p = impl_->params.at(i);
  return effective_precision(p.end - p.begin, impl_->options.state());
}

int64_t Optimizer::state_bytes() const {
  impl_->finish_updates();
  int64_t total = 0;
  for (const auto& p : impl_->params) {
    for (const at::Tensor* t : {&p.state.exp_avg, &p.state.exp_avg_sq, &p.state.momentum_buffer}) {
      if (t->defined()) total += t->numel() * static_cast<int64_t>(t->element_size());
    }
    if (p.state.m) total += p.state.m->bytes() + p.state.v->bytes();
  }
  return total;
}

}  // namespace optim
}  // namespace frugal
