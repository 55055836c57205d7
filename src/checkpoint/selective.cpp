#include "frugal/checkpoint/selective.h"

#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/checkpoint.h"

namespace frugal {
namespace checkpoint {
namespace detail {
namespace {
thread_local LinearCache* current_cache = nullptr;
thread_local TailCalls* current_tails = nullptr;
thread_local double* tail_seconds = nullptr;
std::atomic<int> keep_requests{0};
std::atomic<int64_t> tails_skipped{0};
}  // namespace

bool keep_for_another_backward() { return keep_requests.load() > 0; }

LinearCacheScope::LinearCacheScope(LinearCache* cache) : previous_(current_cache) { current_cache = cache; }
LinearCacheScope::~LinearCacheScope() { current_cache = previous_; }

TailCallsScope::TailCallsScope(TailCalls* calls) : previous_(current_tails) { current_tails = calls; }
TailCallsScope::~TailCallsScope() { current_tails = previous_; }

int64_t tail_products_skipped() { return tails_skipped.load(); }

TailTimer::TailTimer(double* seconds) : previous_(tail_seconds) { tail_seconds = seconds; }
TailTimer::~TailTimer() { tail_seconds = previous_; }

}  // namespace detail

KeepForAnotherBackward::KeepForAnotherBackward() { detail::keep_requests.fetch_add(1); }
KeepForAnotherBackward::~KeepForAnotherBackward() { detail::keep_requests.fetch_sub(1); }

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A Linear whose output is already known (kept by the first forward): forward hands the kept
// output back, backward is the Linear's own backward from the saved input and weight.
class KeptLinear : public torch::autograd::Function<KeptLinear> {
 public:
  // x: (..., in), weight: (out, in), bias: (out) or undefined, kept: (..., out)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                               const at::Tensor& kept) {
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    return {kept};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& g = grads[0];  // (..., out)
    const int64_t out = weight.size(0);
    const int64_t in = weight.size(1);
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = at::matmul(g, weight);                             // (..., in)
    if (ctx->needs_input_grad(1)) gw = g.reshape({-1, out}).t().mm(x.reshape({-1, in}));  // (out, in)
    if (ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(2)) gb = g.reshape({-1, out}).sum(0);
    return {gx, gw, gb, at::Tensor()};
  }
};

// A product whose output is known (or never read) with the product's backward. Under autocast
// the recompute's product would have run in the compute dtype: its inputs are cast the same way
// here (the casts' backward brings the gradients back to the weight's dtype), so the backward
// multiplies what the forward's product multiplied. kept: the output, or undefined for zeros of
// its shape and dtype that take no memory (one element, expanded).
at::Tensor known_product(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor kept) {
  const at::ScalarType compute = precision::compute_dtype_for(weight);
  auto cast = [compute](const at::Tensor& t) { return t.defined() && t.scalar_type() != compute ? t.to(compute) : t; };
  if (!kept.defined()) {
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = weight.size(0);
    kept = at::zeros({}, x.options().dtype(compute)).expand(shape);
  }
  const at::Tensor b = cast(bias);
  const c10::optional<at::Tensor> maybe_bias = b.defined() ? c10::optional<at::Tensor>(b) : c10::nullopt;
  return KeptLinear::apply(cast(x), cast(weight), maybe_bias, kept)[0];
}

}  // namespace

at::Tensor tail_linear(const at::Tensor& z, const at::Tensor& weight, const at::Tensor& bias) {
  detail::TailCalls* tails = detail::current_tails;
  if (tails != nullptr) {
    ++tails->calls;
    if (tails->mode == detail::TailCalls::Mode::recompute && tails->calls == tails->skip && at::GradMode::is_enabled()) {
      // Nothing reads this output's values (the sum it feeds is the region's output, which
      // backward only uses as a root): zeros stand in for it.
      detail::tails_skipped.fetch_add(1);
      return known_product(z, weight, bias, at::Tensor());
    }
  }
  if (detail::tail_seconds == nullptr) return at::linear(z, weight, bias);
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor y = at::linear(z, weight, bias);
  *detail::tail_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  detail::LinearCache* cache = detail::current_cache;
  if (cache == nullptr) return at::linear(x, weight, bias);
  if (cache->mode == detail::LinearCache::Mode::record) {
    at::Tensor y = at::linear(x, weight, bias);
    // An alias without history: if y becomes the region's output, autograd gives y the region's
    // node, and the replay must not lead back into it.
    cache->outputs.push_back(y.detach());
    return y;
  }
  TORCH_CHECK(cache->next < cache->outputs.size(), "selective checkpoint: the recompute made more Linear calls (", cache->next + 1,
              ") than the forward (", cache->outputs.size(), "); the region must run the same code twice");
  at::Tensor kept = cache->outputs[cache->next];
  if (!detail::keep_for_another_backward()) cache->outputs[cache->next] = at::Tensor();  // the graph holds it now
  ++cache->next;
  TORCH_CHECK(kept.defined(),
              "selective checkpoint: a kept Linear output was already used by an earlier backward; "
              "hold a checkpoint::KeepForAnotherBackward around backward passes that will be repeated");
  return known_product(x, weight, bias, kept);
}

}  // namespace checkpoint
}  // namespace frugal
