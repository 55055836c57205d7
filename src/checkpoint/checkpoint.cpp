#include "frugal/checkpoint/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <sstream>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/selective.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace checkpoint {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the recompute must reproduce about one forward output.
struct OutputSignature {
  bool defined = false;
  std::vector<int64_t> sizes;
  at::ScalarType dtype = at::kFloat;
  c10::Device device = c10::Device(c10::kCPU);
  double sum = 0, abs_sum = 0;  // strict mode only
};

// The generators' states at forward time, for the devices the region touches.
struct RngSnapshot {
  std::vector<std::pair<c10::Device, at::Tensor>> states;

  static RngSnapshot capture(const std::vector<at::Tensor>& tensors) {
    RngSnapshot snap;
    snap.states.emplace_back(c10::Device(c10::kCPU), at::detail::getDefaultCPUGenerator().get_state());
    std::vector<c10::Device> cuda;
    for (const at::Tensor& t : tensors) {
      if (t.defined() && t.is_cuda() && std::find(cuda.begin(), cuda.end(), t.device()) == cuda.end()) {
        cuda.push_back(t.device());
      }
    }
    for (const c10::Device& d : cuda) snap.states.emplace_back(d, generator(d).get_state());
    return snap;
  }
  static at::Generator generator(c10::Device d) { return at::globalContext().defaultGenerator(d); }
};

// Sets the generators to a snapshot for the recompute; puts the current states back on exit, so
// the rest of training draws the same numbers as without checkpointing.
class RngFork {
 public:
  explicit RngFork(const RngSnapshot& snapshot) {
    for (const auto& [device, state] : snapshot.states) {
      at::Generator gen = RngSnapshot::generator(device);
      saved_.emplace_back(device, gen.get_state());
      gen.set_state(state);
    }
  }
  ~RngFork() {
    for (const auto& [device, state] : saved_) RngSnapshot::generator(device).set_state(state);
  }

 private:
  std::vector<std::pair<c10::Device, at::Tensor>> saved_;
};

// What backward needs besides the saved inputs: the function, its parameters, the options, the
// forward-time RNG and buffer states, the output signatures and (selective) the kept Linear
// outputs. Held by the autograd node, freed with it.
struct Region : torch::CustomClassHolder {
  RegionFn fn;
  std::vector<at::Tensor> params;
  CheckpointOptions options;
  size_t n_inputs = 0;
  detail::LinearCache kept;
  int64_t tail_calls = 0;  // checkpoint::tail_linear calls in the forward
  RngSnapshot rng;
  precision::AutocastState autocast;       // the forward's mixed-precision state, re-entered for the recompute
  std::vector<at::Tensor> buffers_before;  // buffer values when the forward started
  std::vector<OutputSignature> outputs;
};

std::string describe(const OutputSignature& s) {
  std::ostringstream out;
  if (!s.defined) return "undefined";
  out << "shape " << c10::IntArrayRef(s.sizes) << ", " << c10::toString(s.dtype) << ", " << s.device;
  return out.str();
}

OutputSignature signature_of(const at::Tensor& t, bool strict) {
  OutputSignature s;
  if (!t.defined()) return s;
  s.defined = true;
  s.sizes = t.sizes().vec();
  s.dtype = t.scalar_type();
  s.device = t.device();
  if (strict && (t.is_floating_point() || t.is_complex() || t.numel() > 0)) {
    at::NoGradGuard no_grad;
    const at::Tensor d = t.detach().to(at::kDouble);
    s.sum = d.sum().item<double>();
    s.abs_sum = d.abs().sum().item<double>();
  }
  return s;
}

// Throws, naming the region and the first output whose recompute differs from the forward.
void check_recompute(const Region& region, const std::vector<at::Tensor>& recomputed) {
  const std::string& name = region.options.name();
  TORCH_CHECK(recomputed.size() == region.outputs.size(), "checkpoint: region '", name, "' returned ", recomputed.size(),
              " outputs when recomputed but ", region.outputs.size(), " in the forward; the region must run the same code twice");
  const bool strict = region.options.strict();
  for (size_t i = 0; i < recomputed.size(); ++i) {
    const OutputSignature& want = region.outputs[i];
    const OutputSignature got = signature_of(recomputed[i], strict);
    TORCH_CHECK(got.defined == want.defined && got.sizes == want.sizes && got.dtype == want.dtype && got.device == want.device,
                "checkpoint: region '", name, "' output ", i, " differs between forward (", describe(want), ") and recompute (",
                describe(got), ")");
    if (strict && want.defined) {
      const double tol = region.options.strict_rtol() * std::max(want.abs_sum, 1e-30);
      TORCH_CHECK(std::abs(got.sum - want.sum) <= tol && std::abs(got.abs_sum - want.abs_sum) <= tol, "checkpoint: region '", name,
                  "' output ", i, " has different values in the recompute than in the forward (checksum ", want.sum, " vs ", got.sum,
                  "); the region is not deterministic: random numbers drawn without "
                  "preserve_rng_state, a buffer or global read in forward, or a nondeterministic kernel");
    }
  }
}

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // tensors = inputs followed by params
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Region> region, at::TensorList tensors) {
    std::vector<at::Tensor> inputs(tensors.begin(), tensors.begin() + region->n_inputs);
    const CheckpointOptions& opt = region->options;
    if (opt.preserve_rng_state()) region->rng = RngSnapshot::capture(tensors.vec());
    region->autocast = precision::AutocastState::current();
    for (const at::Tensor& b : opt.buffers()) region->buffers_before.push_back(b.defined() ? b.clone() : b);
    std::vector<at::Tensor> outputs;
    {
      // Autograd runs this with grad mode off: nothing inside the region is kept for backward.
      detail::LinearCacheScope cache_scope(opt.keep_linear_outputs() ? &region->kept : nullptr);
      detail::TailCalls tails;
      detail::TailCallsScope tail_scope(&tails);
      outputs = region->fn(inputs);
      region->tail_calls = tails.calls;
    }
    for (const at::Tensor& out : outputs) region->outputs.push_back(signature_of(out, opt.strict()));
    ctx->save_for_backward(inputs);
    for (const at::Tensor& out : outputs) {
      if (out.defined() && !out.is_floating_point() && !out.is_complex()) ctx->mark_non_differentiable({out});
    }
    ctx->saved_data["region"] = at::IValue::make_capsule(region);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto region = c10::static_intrusive_pointer_cast<Region>(ctx->saved_data["region"].toCapsule());
    const std::vector<at::Tensor> saved = ctx->get_saved_variables();
    const CheckpointOptions& opt = region->options;
    const size_t n_in = region->n_inputs;

    std::vector<at::Tensor> detached;
    detached.reserve(n_in);
    for (const at::Tensor& t : saved) {
      if (!t.defined()) {
        detached.push_back(t);
        continue;
      }
      at::Tensor d = t.detach();
      d.requires_grad_(t.requires_grad());
      detached.push_back(d);
    }

    // Buffers: recompute from their forward-time values; what they hold now is put back once the
    // gradients are computed (the recompute's graph may have saved them), so the forward's update
    // is the only one, bit for bit.
    std::vector<at::Tensor> buffers_now;
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < opt.buffers().size(); ++i) {
        at::Tensor b = opt.buffers()[i];
        buffers_now.push_back(b.defined() ? b.clone() : b);
        if (b.defined()) b.copy_(region->buffers_before[i]);
      }
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_on(true);
      memory::CategoryScope recomputed(memory::Category::activation);
      std::optional<RngFork> rng;
      if (opt.preserve_rng_state()) rng.emplace(region->rng);
      // backward() is usually called outside the autocast scope the forward ran in: a recompute
      // under the caller's state would rebuild the region in another precision (fp32 products for
      // a bf16 forward) and its gradients would not be the forward's.
      precision::AutocastGuard autocast(region->autocast);
      region->kept.mode = detail::LinearCache::Mode::replay;
      region->kept.next = 0;
      detail::LinearCacheScope cache_scope(opt.keep_linear_outputs() ? &region->kept : nullptr);
      // The region's last tail product (its output feeds only the region's output) is not
      // multiplied again: its backward needs its input and weight, which the recompute gives.
      detail::TailCalls tails;
      tails.mode = detail::TailCalls::Mode::recompute;
      tails.skip = opt.skip_final_tail() && !opt.strict() ? region->tail_calls : 0;
      detail::TailCallsScope tail_scope(&tails);
      outputs = region->fn(detached);
    }
    if (!detail::keep_for_another_backward()) region->kept.outputs.clear();
    check_recompute(*region, outputs);

    std::vector<at::Tensor> roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].defined() && outputs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // Differentiate with respect to the inputs and parameters autograd asks about.
    std::vector<at::Tensor> targets;
    std::vector<size_t> target_slot;
    for (size_t i = 0; i < n_in; ++i) {
      if (ctx->needs_input_grad(i) && detached[i].defined() && detached[i].requires_grad()) {
        targets.push_back(detached[i]);
        target_slot.push_back(i);
      }
    }
    for (size_t j = 0; j < region->params.size(); ++j) {
      if (ctx->needs_input_grad(n_in + j) && region->params[j].requires_grad()) {
        targets.push_back(region->params[j]);
        target_slot.push_back(n_in + j);
      }
    }

    // One slot for the region argument, then one per tensor.
    variable_list result(1 + n_in + region->params.size());
    if (!roots.empty() && !targets.empty()) {
      // Backward through the recomputed graph accumulates the parameters' gradients straight into
      // their .grad, each as soon as it is complete (so their accumulate-grad hooks fire one by one,
      // and a step taken in backward frees each gradient before the next is made); the inputs'
      // gradients are read back from the detached copies. As autograd::grad would give them, the
      // Function's outputs for the parameters stay empty.
      const bool create_graph = at::GradMode::is_enabled();
      torch::autograd::backward(roots, root_grads, /*retain_graph=*/create_graph, create_graph, targets);
      for (size_t k = 0; k < targets.size(); ++k) {
        if (target_slot[k] < n_in) result[1 + target_slot[k]] = targets[k].grad();
      }
    }
    outputs.clear();  // drop the recompute's graph before touching the buffers it saved
    roots.clear();
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < buffers_now.size(); ++i) {
        if (buffers_now[i].defined()) opt.buffers()[i].copy_(buffers_now[i]);
      }
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(RegionFn fn, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                                   const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: the region function of '", options.name(), "' is empty");
  const bool any_grad = std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.defined() && t.requires_grad(); }) ||
                        std::any_of(params.begin(), params.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  if (!at::GradMode::is_enabled() || !any_grad) {
    detail::LinearCacheScope plain(nullptr);  // nothing will run backward: just run the function
    detail::TailCallsScope no_tails(nullptr);
    return fn(inputs);
  }
  auto region = c10::make_intrusive<Region>();
  region->fn = std::move(fn);
  region->params = params;
  region->options = options;
  region->n_inputs = inputs.size();
  std::vector<at::Tensor> tensors = inputs;
  tensors.insert(tensors.end(), params.begin(), params.end());
  return CheckpointFunction::apply(region, at::TensorList(tensors));
}

at::Tensor checkpoint(UnaryFn fn, const at::Tensor& input, const std::vector<at::Tensor>& params, const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: the region function of '", options.name(), "' is empty");
  RegionFn wrapped = [f = std::move(fn)](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{f(in[0])}; };
  return checkpoint(std::move(wrapped), std::vector<at::Tensor>{input}, params, options)[0];
}

}  // namespace checkpoint
}  // namespace frugal
