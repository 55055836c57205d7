#include "frugal/checkpoint/checkpoint.h"

#include <algorithm>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "frugal/checkpoint/selective.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace checkpoint {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What backward needs besides the saved inputs: the function, its parameters, the options, and
// (selective) the kept Linear outputs. Held by the autograd node, freed with it.
struct Region : torch::CustomClassHolder {
  RegionFn fn;
  std::vector<at::Tensor> params;
  CheckpointOptions options;
  size_t n_inputs = 0;
  detail::LinearCache kept;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // tensors = inputs followed by params
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Region> region,
                               at::TensorList tensors) {
    std::vector<at::Tensor> inputs(tensors.begin(), tensors.begin() + region->n_inputs);
    std::vector<at::Tensor> outputs;
    {
      // Autograd runs this with grad mode off: nothing inside the region is kept for backward.
      detail::LinearCache* cache = region->options.keep_linear_outputs() ? &region->kept : nullptr;
      detail::LinearCacheScope cache_scope(cache);
      outputs = region->fn(inputs);
    }
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

    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode grad_on(true);
      memory::CategoryScope recomputed(memory::Category::activation);
      region->kept.mode = detail::LinearCache::Mode::replay;
      region->kept.next = 0;
      detail::LinearCache* cache = region->options.keep_linear_outputs() ? &region->kept : nullptr;
      detail::LinearCacheScope cache_scope(cache);
      outputs = region->fn(detached);
    }
    region->kept.outputs.clear();
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "checkpoint: the recompute returned ", outputs.size(),
                " outputs but the forward returned ", grad_outputs.size());

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
      const bool create_graph = at::GradMode::is_enabled();
      const variable_list grads = torch::autograd::grad(roots, targets, root_grads, /*retain_graph=*/create_graph,
                                                        create_graph, /*allow_unused=*/true);
      for (size_t k = 0; k < targets.size(); ++k) result[1 + target_slot[k]] = grads[k];
    }
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(RegionFn fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params, const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: the region function is empty");
  const bool any_grad = std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) {
    return t.defined() && t.requires_grad();
  }) || std::any_of(params.begin(), params.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  if (!at::GradMode::is_enabled() || !any_grad) {
    detail::LinearCacheScope plain(nullptr);  // nothing will run backward: just run the function
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

at::Tensor checkpoint(UnaryFn fn, const at::Tensor& input, const std::vector<at::Tensor>& params,
                      const CheckpointOptions& options) {
  TORCH_CHECK(fn, "checkpoint: the region function is empty");
  RegionFn wrapped = [f = std::move(fn)](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{f(in[0])};
  };
  return checkpoint(std::move(wrapped), std::vector<at::Tensor>{input}, params, options)[0];
}

}  // namespace checkpoint
}  // namespace frugal
