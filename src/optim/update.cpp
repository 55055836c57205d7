#include "frugal/optim/update.h"

#include <cmath>

namespace frugal {
namespace optim {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::sgd: return "sgd";
    case Algorithm::adam: return "adam";
    case Algorithm::adamw: return "adamw";
  }
  return "adamw";
}

void apply_update(const Hyper& h, ParamState& state, at::Tensor& param, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  state.step += 1;
  if (h.algorithm == Algorithm::sgd) {
    at::Tensor d_p = h.weight_decay != 0 ? grad.add(param, h.weight_decay) : grad;
    if (h.momentum != 0) {
      if (!state.momentum_buffer.defined()) {
        state.momentum_buffer = d_p.clone();
      } else {
        state.momentum_buffer.mul_(h.momentum).add_(d_p, 1 - h.dampening);
      }
      d_p = h.nesterov ? d_p.add(state.momentum_buffer, h.momentum) : state.momentum_buffer;
    }
    param.add_(d_p, -h.lr);
    return;
  }
  // Adam and AdamW
  if (!state.exp_avg.defined()) {
    state.exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  at::Tensor g = grad;
  if (h.algorithm == Algorithm::adamw) {
    if (h.weight_decay != 0) param.mul_(1 - h.lr * h.weight_decay);
  } else if (h.weight_decay != 0) {
    g = grad.add(param, h.weight_decay);
  }
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(state.step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(state.step));
  state.exp_avg.mul_(h.beta1).add_(g, 1 - h.beta1);
  state.exp_avg_sq.mul_(h.beta2).addcmul_(g, g, 1 - h.beta2);
  const at::Tensor denom = (state.exp_avg_sq.sqrt() / std::sqrt(bias_correction2)).add_(h.eps);
  param.addcdiv_(state.exp_avg, denom, -h.lr / bias_correction1);
}

}  // namespace optim
}  // namespace frugal
