// frugal/optim/optimizer.h — one optimizer, two modes: step after backward, or inside it.
//
// Standard mode is the usual loop. In-backward mode registers a post hook on each parameter's
// AccumulateGrad node: the moment a parameter's gradient is complete it is clipped, the parameter
// is updated and the gradient is freed, so gradients never all exist together (gradient memory
// falls from the model's size to what one backward node hands over). The same training loop runs
// in both modes; LR schedules, clipping and state dicts work in both.
//
//   frugal::optim::Optimizer opt(model->parameters(),
//       frugal::optim::AdamWOptions(3e-4).betas({0.9, 0.95}).weight_decay(0.1)
//           .state_precision(frugal::optim::StatePrecision::int8).mode(frugal::optim::Mode::in_backward));
//   for (...) { opt.backward(loss_fn()); opt.step(); opt.zero_grad(); scheduler.step(); }
//   torch::save(opt, "optimizer.pt");  torch::load(opt, "optimizer.pt");
//
// Parameters come as torch::optim takes them (parameters(), or ParamGroups with their own lr and
// weight decay) or by name (named_parameters(): the state dict then says whose state is whose;
// unnamed parameters are named by position, "0", "1", ...). AdamWOptions, AdamOptions and
// SGDOptions have torch::optim's fields and defaults; OptimizerOptions is the one struct they
// convert to (frugal's recipes fill it directly).
//
// With a memory tracker installed (memory/tracker.h) and no phase scopes of the program's own,
// backward() and step() mark the backward and optimizer phases, and step() marks a step after
// each update, so the plain loop gets a per-category breakdown without scopes.
//
// Clipping. Standard mode: global-norm or per-parameter clipping before the update. In-backward
// mode cannot see the global norm before the first update, so it offers per-parameter clipping and
// exact two-pass global-norm clipping: backward() runs one backward that only measures the norm
// (gradients are freed as they come; the graph is retained), then a second that updates with it.
// Cost: one more backward pass per step (and one more recompute of checkpointed regions); memory
// is unchanged. Asking for single-pass global-norm clipping in in-backward mode fails at
// construction.
//
// Gradient accumulation over micro-batches: in standard mode set accumulation_steps(N), call
// backward() on each micro-batch and step()/zero_grad() after each; step() updates on every N-th
// call only (it returns whether it did). In-backward mode frees each gradient as soon as it is
// used, so accumulation is refused at construction.
//
// Updates on a thread of their own (in-backward mode, one process): with update_threads(N) each
// completed gradient is handed to an update thread (using N of ATen's intra-op threads) and
// backward goes on at once, so the updates of one block overlap the backward of the next. Up to
// bytes_in_flight of gradients wait for their update (one gradient is always allowed; backward
// waits for the oldest beyond that); backward() returns, and step(), zero_grad(), state_dict()
// and load_state() begin, only once every update is done, and an update's exception comes out of
// the backward that posted it (or the next of those calls). Order and results are the same as
// with updates inside the hook. Worth it where backward leaves cores idle (a CPU whose products
// run on one thread); refused with data parallel and off the CPU. The update thread runs at a
// lower priority than the process (nice +10; the state window's I/O threads, started from it,
// inherit that), so backward, the step's critical path, keeps its core.
//
// Data parallel (exchange.h): with an Exchange set, each gradient is averaged over the ranks before
// it is used — in in-backward mode inside its hook, several in flight while backward goes on — and
// only the parameters this rank owns keep state and are updated; their owners then send the new
// values to the other ranks. Clipping uses the averaged gradients (the global norm is summed over
// the ranks' owned parameters), and the state dict holds the owned parameters' state only.
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/ordered_dict.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "frugal/optim/exchange.h"
#include "frugal/optim/update.h"

namespace torch {
namespace serialize {
class OutputArchive;
class InputArchive;
}  // namespace serialize
}  // namespace torch

namespace frugal {
namespace optim {

enum class Mode { standard, in_backward };
enum class Clip { none, global_norm, global_norm_two_pass, per_param_norm };
constexpr std::array<Clip, 4> kAllClips = {Clip::none, Clip::global_norm, Clip::global_norm_two_pass, Clip::per_param_norm};

const char* mode_name(Mode m);  // "standard", "in_backward"
// "none", "global_norm", "global_norm_two_pass", "per_param_norm"; parse_clip is the inverse
// (nullopt for any other text).
const char* clip_name(Clip c);
std::optional<Clip> parse_clip(const std::string& name);

// OptimizerOptions::bytes_in_flight's default.
constexpr int64_t kDefaultBytesInFlight = 4 << 20;

// Every setting of the optimizer in one struct (what recipes fill in); AdamWOptions, AdamOptions
// and SGDOptions convert to it.
struct OptimizerOptions {
  // What the update computes (the algorithm and its hyper-parameters, the state's precision and
  // place, stochastic rounding) lives in one Hyper (update.h), the struct apply_update reads; these
  // set and get its fields in TORCH_ARG's style. Defaults: Hyper's.
#define FRUGAL_HYPER_ARG(T, name)                        \
  OptimizerOptions& name(const T& value) {               \
    hyper_.name = value;                                 \
    return *this;                                        \
  }                                                      \
  const T& name() const noexcept { return hyper_.name; } \
  T& name() noexcept { return hyper_.name; }
  FRUGAL_HYPER_ARG(Algorithm, algorithm)
  FRUGAL_HYPER_ARG(double, lr)
  FRUGAL_HYPER_ARG(double, weight_decay)  // L2 for sgd and adam, decoupled for adamw
  FRUGAL_HYPER_ARG(double, momentum)      // sgd
  FRUGAL_HYPER_ARG(double, dampening)     // sgd
  FRUGAL_HYPER_ARG(bool, nesterov)        // sgd
  FRUGAL_HYPER_ARG(double, beta1)
  FRUGAL_HYPER_ARG(double, beta2)
  FRUGAL_HYPER_ARG(double, eps)
  // Adam(W) state precision and place (state_buffer.h): fp32, bf16, 8-bit, 4-bit; on the
  // parameters' device, in host memory, or in memory-mapped files.
  FRUGAL_HYPER_ARG(StateOptions, state)
  // bf16 parameters updated with stochastic rounding.
  FRUGAL_HYPER_ARG(bool, stochastic_rounding)
#undef FRUGAL_HYPER_ARG
  // The update's settings as apply_update takes them (a group's lr and weight decay replace these).
  const Hyper& hyper() const noexcept { return hyper_; }

  TORCH_ARG(Mode, mode) = Mode::standard;
  TORCH_ARG(Clip, clip) = Clip::none;
  TORCH_ARG(double, max_grad_norm) = 1.0;
  TORCH_ARG(int64_t, accumulation_steps) = 1;
  // In-backward mode: 0 updates inside autograd's hook; N > 0 on an update thread of their own
  // with N intra-op threads, overlapping backward (see the top of this file).
  TORCH_ARG(int64_t, update_threads) = 0;
  // In-backward mode, gradients waiting at once for their average (data parallel) or their update
  // (update_threads), in bytes, before backward waits for the oldest; one is always allowed.
  TORCH_ARG(int64_t, bytes_in_flight) = kDefaultBytesInFlight;

 private:
  Hyper hyper_;
};

// Parameters sharing a learning rate and weight decay (unset: the optimizer's). names may be left
// empty: the parameters are then named by their position among all groups' ("0", "1", ...).
struct ParamGroup {
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  std::optional<double> lr;
  std::optional<double> weight_decay;

  ParamGroup() = default;
  // Named parameters (the state dict uses the names), with what differs from the optimizer's options.
  ParamGroup(std::vector<std::string> names, std::vector<at::Tensor> params, std::optional<double> lr = std::nullopt,
             std::optional<double> weight_decay = std::nullopt)
      : names(std::move(names)), params(std::move(params)), lr(lr), weight_decay(weight_decay) {}
  // torch::optim::OptimizerParamGroup's habit: the tensors (model->parameters()), and what differs.
  explicit ParamGroup(std::vector<at::Tensor> params, std::optional<double> lr = std::nullopt,
                      std::optional<double> weight_decay = std::nullopt)
      : params(std::move(params)), lr(lr), weight_decay(weight_decay) {}
};

// frugal's memory choices, shared by the LibTorch-style options below (each setter returns the
// options it was called on, as TORCH_ARG's do).
template <typename Derived>
class MemoryOptions {
 public:
#define FRUGAL_MEMORY_ARG(T, name, init)             \
  Derived& name(const T& value) {                    \
    name##_ = value;                                 \
    return static_cast<Derived&>(*this);             \
  }                                                  \
  const T& name() const noexcept { return name##_; } \
                                                     \
 private:                                            \
  T name##_ = init;                                  \
                                                     \
 public:
  FRUGAL_MEMORY_ARG(Mode, mode, Mode::standard)
  FRUGAL_MEMORY_ARG(Clip, clip, Clip::none)
  FRUGAL_MEMORY_ARG(double, max_grad_norm, 1.0)
  FRUGAL_MEMORY_ARG(int64_t, accumulation_steps, 1)
  FRUGAL_MEMORY_ARG(int64_t, update_threads, 0)
  FRUGAL_MEMORY_ARG(int64_t, bytes_in_flight, kDefaultBytesInFlight)
  FRUGAL_MEMORY_ARG(StateOptions, state, StateOptions())
  FRUGAL_MEMORY_ARG(bool, stochastic_rounding, false)
#undef FRUGAL_MEMORY_ARG
  // The state's precision (state().precision(p)): fp32, bf16, int8 or int4.
  Derived& state_precision(StatePrecision p) {
    state_.precision(p);
    return static_cast<Derived&>(*this);
  }
  // Where the state lives: with the parameter, in host memory, or in mapped files.
  Derived& state_placement(StatePlacement p) {
    state_.placement(p);
    return static_cast<Derived&>(*this);
  }

 protected:
  // These settings in an OptimizerOptions, for the derived options to add theirs.
  OptimizerOptions memory_options() const {
    return OptimizerOptions()
        .mode(mode_)
        .clip(clip_)
        .max_grad_norm(max_grad_norm_)
        .accumulation_steps(accumulation_steps_)
        .update_threads(update_threads_)
        .bytes_in_flight(bytes_in_flight_)
        .state(state_)
        .stochastic_rounding(stochastic_rounding_);
  }
};

// torch::optim::AdamWOptions's fields and defaults (weight decay 1e-2, decoupled). amsgrad is
// refused: frugal has no AMSGrad.
struct AdamWOptions : MemoryOptions<AdamWOptions> {
  // Learning rate lr, the rest torch::optim::AdamWOptions' defaults.
  AdamWOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT: implicit, as torch::optim's
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 1e-2;
  TORCH_ARG(bool, amsgrad) = false;

 public:
  operator OptimizerOptions() const;  // NOLINT: implicit, so Optimizer takes these directly
};

// torch::optim::AdamOptions's: weight decay 0 (L2, added to the gradient).
struct AdamOptions : MemoryOptions<AdamOptions> {
  // Learning rate lr, the rest torch::optim::AdamOptions' defaults.
  AdamOptions(double lr = 1e-3) : lr_(lr) {}  // NOLINT
  TORCH_ARG(double, lr) = 1e-3;
  typedef std::tuple<double, double> betas_t;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, amsgrad) = false;

 public:
  operator OptimizerOptions() const;  // NOLINT
};

// torch::optim::SGDOptions's: lr required, momentum, dampening, weight decay 0, no Nesterov.
struct SGDOptions : MemoryOptions<SGDOptions> {
  // Learning rate lr (required, as torch::optim's), the rest torch::optim::SGDOptions' defaults.
  SGDOptions(double lr) : lr_(lr) {}  // NOLINT
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0;
  TORCH_ARG(double, dampening) = 0;
  TORCH_ARG(double, weight_decay) = 0;
  TORCH_ARG(bool, nesterov) = false;

 public:
  operator OptimizerOptions() const;  // NOLINT
};

// Optimizer state by parameter name: "<name>.step", "<name>.exp_avg", "<name>.exp_avg_sq",
// "<name>.momentum_buffer"; quantized moments as "<name>.exp_avg.codes" and "<name>.exp_avg.absmax"
// (likewise exp_avg_sq). Either form loads into an optimizer of any state precision.
using TensorDict = std::map<std::string, at::Tensor>;

// A state dict read lazily: its entries' names and shapes up front, and `load` to read one entry's
// data when it is needed (a file's reader, say). Optimizer::load_state checks the whole list before
// it calls `load`, then calls it only for one parameter's entries at a time, so no more than one
// parameter's saved state is in memory beside the optimizer's own. Any reader will do; this is how
// train::load_optimizer_state reads a checkpoint's file:
//
//   frugal::io::SafetensorsReader file("optimizer.safetensors");
//   frugal::optim::StateDictSource source;
//   for (const auto& t : file.tensors()) source.entries.emplace_back(t.name, t.shape);
//   source.load = [&](const std::string& name) { return file.load(name); };
//   optimizer.load_state(source);
struct StateDictSource {
  std::vector<std::pair<std::string, std::vector<int64_t>>> entries;  // name, shape
  std::function<at::Tensor(const std::string&)> load;                 // the entry's tensor, of that shape
};

// One optimizer (SGD, Adam, AdamW) that steps after backward or inside it; see the top of this file.
class Optimizer {
 public:
  // Throws std::invalid_argument for a combination the mode cannot do (see above) or bad values.
  Optimizer(std::vector<ParamGroup> groups, const OptimizerOptions& options);
  // model->named_parameters(): the state dict names each parameter's state by its name.
  Optimizer(const torch::OrderedDict<std::string, at::Tensor>& named_parameters, const OptimizerOptions& options);
  // torch::optim's habit: model->parameters(), named by position ("0", "1", ...).
  Optimizer(const std::vector<at::Tensor>& parameters, const OptimizerOptions& options);
  ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  // Backward of loss as the mode needs it. loss.backward() does the same in every mode but
  // in-backward two-pass clipping, which needs two passes: there the first gradient throws
  // std::logic_error saying so, before any parameter changed.
  void backward(const at::Tensor& loss);
  // Standard: clips and updates every parameter that has a gradient (every accumulation_steps-th
  // call). In-backward: the updates already happened; finishes the step. Returns whether the
  // parameters were updated.
  bool step();
  // Frees the gradients (after an update, when accumulating).
  void zero_grad();

  // Data-parallel training: set before the first backward (and before load_state); null: one
  // process. The state of parameters this rank does not own is dropped.
  void set_exchange(std::shared_ptr<Exchange> exchange);
  // The optimized parameters in the order an Exchange indexes them.
  std::vector<std::string> parameter_names() const;
  std::vector<int64_t> parameter_numels() const;  // their element counts, in the same order
  // The precision parameter i's Adam(W) moments are held in (or will be, before its first update):
  // the options' precision, except fp32 where 8- or 4-bit state was asked for a tensor (this
  // rank's part of it) under StateOptions::min_quantized_numel elements (effective_precision).
  // SGD's momentum buffer has the gradient's dtype whatever this says.
  StatePrecision state_precision(size_t i) const;
  // Of the in-backward mode's gradients, how many bytes may be waiting for their average or update
  // at once before backward waits for the oldest (OptimizerOptions::bytes_in_flight, whose
  // default is kDefaultBytesInFlight; one gradient is always allowed).
  void set_bytes_in_flight(int64_t bytes);

  const OptimizerOptions& options() const;  // as constructed
  size_t num_groups() const;                // parameter groups, in construction order
  double lr(size_t group = 0) const;        // a group's current learning rate
  // Sets a group's learning rate for the next updates (schedules call it); lr must be >= 0.
  void set_lr(size_t group, double lr);
  double base_lr(size_t group) const;  // the lr the group was created with
  // The global gradient norm measured by the last step (global-norm clipping only), before clipping.
  double last_grad_norm() const;
  int64_t steps_taken() const;  // completed updates

  // The state by name (see TensorDict). The tensors are the live state, not copies (only the step
  // counters are new): clone them to keep a snapshot past the next step, and use them only while
  // the optimizer lives (mmap placement's live in its mapped files).
  TensorDict state_dict() const;
  // Loads state saved in either mode, from any precision and placement. Throws
  // std::invalid_argument listing unknown or repeated names, missing parameters (owned ones, with
  // an Exchange: the others' entries are checked and skipped) and shape
  // mismatches, found from the names and shapes alone before any data is loaded. Then restores
  // one parameter at a time, loading only that parameter's entries. An empty source resets the
  // state. Should a load fail part-way, every parameter is left with empty state (as a new
  // optimizer's) and the error is rethrown.
  void load_state(const StateDictSource& source);
  // load_state over the tensors of `state`.
  void load_state_dict(const TensorDict& state);
  int64_t state_bytes() const;  // bytes of all state tensors
  // Seconds spent in parameter updates since construction (in either mode; in in-backward mode
  // they run inside backward, or beside it with update_threads), state loads and stores included.
  // Read them after backward() or step(), not while updates may be under way.
  double update_seconds() const;
  // Of those, the seconds spent moving state chunks between their place (host memory, mapped
  // files) and the parameter's device (StateBuffer::transfer_seconds).
  double state_transfer_seconds() const;
  // With update_threads: the seconds backward waited for the update thread since construction
  // (gradients in flight at their bound, and the last updates after backward's own work).
  double update_wait_seconds() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// torch::save(optimizer, file) and torch::load(optimizer, file): state_dict() in a LibTorch
// archive (one entry, "frugal_optimizer_state", a dict of name to tensor); load goes through
// load_state_dict and its checks. Learning rates are the schedule's, not saved.
torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const Optimizer& optimizer);
torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Optimizer& optimizer);

// Bytes of state the optimizer keeps for one parameter of `numel` elements of `dtype`, as update.cpp
// allocates it (with StateBuffer's block and small-tensor rules), and how many of them live in
// mapped files (mmap placement).
StateBufferBytes state_bytes_for_parameter(int64_t numel, at::ScalarType dtype, const OptimizerOptions& options);
// Temporaries one parameter's update holds at its peak: none for the fused CPU kernels (8- and
// 4-bit state; fp32 and bf16 state, update.h's uses_dense_kernel); otherwise the streamed (buffered) update works a chunk of values at a
// time in fp32 (parameter, gradient, both moments, rounding noise), and the plain update makes parameter-sized temporaries (the denominator
// and the step).
int64_t update_temporary_bytes(int64_t numel, at::ScalarType dtype, at::Device device, const OptimizerOptions& options);
// The code tables that quantized state shares (once per process and device), for parameters of
// these sizes: 0 when none of them is quantized.
int64_t shared_code_table_bytes(const std::vector<int64_t>& numels, const OptimizerOptions& options);

}  // namespace optim
}  // namespace frugal
