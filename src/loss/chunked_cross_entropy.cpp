#include "frugal/loss/chunked_cross_entropy.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <optional>

#include "frugal/precision/autocast.h"
#include "frugal/loss/cross_entropy_rows.h"

namespace frugal {
namespace loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

// The sum of a forward's token losses: a double on the CPU; elsewhere a tensor, so that no chunk
// waits for the device.
class LossSum {
 public:
  void add(double x) { cpu_ += x; }
  void add(const at::Tensor& x) { device_ = device_.defined() ? device_ + x : x; }
  double value() const { return device_.defined() ? cpu_ + device_.item<double>() : cpu_; }

 private:
  double cpu_ = 0;
  at::Tensor device_;
};

// One chunk's fp32 logits into out (n, V), contiguous: h (n, H) and w (V, H) in the compute dtype,
// bias (V) in its own. A product that is not fp32 is made in low (n, V, compute dtype) and then
// widened, and the bias is added in fp32 after it.
void logits_into(at::Tensor out, at::Tensor low, const at::Tensor& h, const at::Tensor& w, const at::Tensor& bias) {
  if (low.defined()) {
    at::mm_out(low, h, w.t());
    out.copy_(low);
    if (bias.defined()) out.add_(bias);
  } else if (bias.defined() && bias.scalar_type() == at::kFloat) {
    at::addmm_out(out, bias, h, w.t());
  } else {
    at::mm_out(out, h, w.t());
    if (bias.defined()) out.add_(bias);
  }
}

// A chunk's forward on its fp32 logits (n, V): each row's log-sum-exp into lse (n) and the
// summed loss of its counted rows into sum. On the CPU in one fused kernel (cross_entropy_rows.h).
void forward_rows(const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, at::Tensor lse, LossSum& sum) {
  if (logits.is_cpu()) {
    sum.add(cross_entropy_rows_forward(logits.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0),
                                       targets.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>()));
    return;
  }
  const at::Tensor valid = targets != ignore_index;        // (n) bool
  const at::Tensor safe = targets.masked_fill(~valid, 0);  // (n) in [0, V)
  const at::Tensor row_lse = at::logsumexp(logits, 1);     // (n)
  lse.copy_(row_lse);
  const at::Tensor picked = logits.gather(1, safe.unsqueeze(1)).squeeze(1);
  sum.add(((row_lse - picked) * valid).sum(at::kDouble));
}

// A chunk's d loss / d logits into grad (n, V; it may be logits itself): (softmax - onehot(target))
// * scale, zeros for ignored tokens. scale: a 0-dim fp32 tensor on the logits' device, and its
// value when that is the CPU.
void backward_rows(const at::Tensor& logits, at::Tensor grad, const at::Tensor& targets, int64_t ignore_index, const at::Tensor& lse,
                   const at::Tensor& scale, float cpu_scale) {
  if (logits.is_cpu()) {
    cross_entropy_rows_backward(logits.data_ptr<float>(), grad.data_ptr<float>(), logits.size(0), logits.size(1), logits.stride(0),
                                targets.data_ptr<int64_t>(), ignore_index, lse.data_ptr<float>(), cpu_scale);
    return;
  }
  const at::Tensor valid = targets != ignore_index;
  const at::Tensor v = valid.to(at::kFloat).unsqueeze(1);  // (n, 1)
  if (!grad.is_same(logits)) grad.copy_(logits);
  grad.sub_(lse.unsqueeze(1)).exp_();                                      // softmax
  grad.scatter_add_(1, targets.masked_fill(~valid, 0).unsqueeze(1), -v);   // - onehot
  grad.mul_(at::where(valid, scale, at::zeros_like(scale)).unsqueeze(1));  // 0, not 0 * inf, where ignored
}

class ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
 public:
  // hidden: (N, H), targets: (N) contiguous, `count` of them not ignored. The products run in
  // `compute` (the weight's dtype, or autocast's for an fp32 weight), the softmax, its log-sum-exp
  // and the loss in fp32. keep_logits (with chunk >= N): the (N, V) logits are kept for backward
  // instead of being made again there.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& maybe_bias, const at::Tensor& targets, int64_t chunk, int64_t ignore_index,
                               bool mean, int64_t count, bool keep_logits) {
    const at::Tensor bias = maybe_bias.has_value() ? *maybe_bias : at::Tensor();
    const at::ScalarType compute = precision::compute_dtype_for(weight);
    // The products' dtype is fixed here and in backward, whatever autocast state either runs under.
    precision::AutocastGuard explicit_dtypes(precision::AutocastState::off());
    const at::Tensor w = in_dtype(weight, compute);  // one cast for every chunk
    const int64_t N = hidden.size(0), V = weight.size(0), rows = std::min(chunk, N);
    // One chunk's logits, reused by every chunk (and the product before it is widened to fp32).
    at::Tensor logits = at::empty({rows, V}, hidden.options().dtype(at::kFloat));
    at::Tensor low = compute == at::kFloat ? at::Tensor() : at::empty({rows, V}, hidden.options().dtype(compute));
    at::Tensor lse = at::empty({N}, hidden.options().dtype(at::kFloat));  // (N), kept for backward
    LossSum total;
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk), n = end - begin;
      const at::Tensor l = logits.narrow(0, 0, n);
      logits_into(l, low.defined() ? low.narrow(0, 0, n) : low, in_dtype(hidden.slice(0, begin, end), compute), w, bias);
      forward_rows(l, targets.slice(0, begin, end), ignore_index, lse.slice(0, begin, end), total);
    }
    low.reset();
    ctx->save_for_backward({hidden, weight, bias.defined() ? bias : at::Tensor(), targets, lse, keep_logits ? logits : at::Tensor()});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["kept_logits"] = keep_logits;
    ctx->saved_data["compute"] = static_cast<int64_t>(compute);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["count"] = count;
    const double sum = total.value();
    // mean over no counted token: 0 / 0, NaN, as cross_entropy gives
    const double loss = mean ? sum / static_cast<double>(count) : sum;
    return {at::scalar_tensor(loss, hidden.options().dtype(at::kFloat))};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &targets = saved[3], &lse = saved[4];
    const at::Tensor bias = ctx->saved_data["has_bias"].toBool() ? saved[2] : at::Tensor();
    const at::Tensor kept = ctx->saved_data["kept_logits"].toBool() ? saved[5] : at::Tensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt(), ignore_index = ctx->saved_data["ignore_index"].toInt();
    const int64_t count = ctx->saved_data["count"].toInt();
    const auto compute = static_cast<at::ScalarType>(ctx->saved_data["compute"].toInt());
    precision::AutocastGuard explicit_dtypes(precision::AutocastState::off());
    // d loss / d logit = (softmax - onehot(target)) * scale, zero for ignored tokens. With no
    // counted token the mean's scale is infinite, and every row is ignored: the gradients are 0.
    at::Tensor scale = grads[0].to(at::kFloat);
    if (ctx->saved_data["mean"].toBool()) scale = scale / static_cast<double>(count);
    const float cpu_scale = scale.is_cpu() ? scale.item<float>() : 0.0f;
    const int64_t N = hidden.size(0), V = weight.size(0), rows = std::min(chunk, N);
    const at::Tensor w = in_dtype(weight, compute);  // the forward's products again
    at::Tensor grad_hidden = ctx->needs_input_grad(0) ? at::empty_like(hidden) : at::Tensor();
    // Over several chunks the weight's gradient is summed in fp32; with one chunk it is made in the
    // compute dtype directly (for bf16 weights, no fp32 copy of a (V, H) matrix).
    const bool one_chunk = N <= chunk;
    const bool grad_w = ctx->needs_input_grad(1);
    at::Tensor grad_weight;
    if (grad_w && !one_chunk) {
      const auto f32 = weight.options().dtype(at::kFloat);
      grad_weight = compute == at::kFloat ? at::empty(weight.sizes(), f32) : at::zeros(weight.sizes(), f32);
    }
    at::Tensor grad_bias =
        (bias.defined() && ctx->needs_input_grad(2)) ? at::zeros(bias.sizes(), bias.options().dtype(at::kFloat)) : at::Tensor();
    // One chunk's d loss / d logits in fp32 (the logits themselves when they are made here), and in
    // the compute dtype for the products; both reused by every chunk.
    at::Tensor p_buffer = at::empty({rows, V}, hidden.options().dtype(at::kFloat));
    at::Tensor low_buffer = compute == at::kFloat ? at::Tensor() : at::empty({rows, V}, hidden.options().dtype(compute));
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk), n = end - begin;
      const at::Tensor h = in_dtype(hidden.slice(0, begin, end), compute);  // (n, H)
      at::Tensor p = p_buffer.narrow(0, 0, n);                              // (n, V)
      const at::Tensor low = low_buffer.defined() ? low_buffer.narrow(0, 0, n) : low_buffer;
      const at::Tensor t = targets.slice(0, begin, end);
      const at::Tensor chunk_lse = lse.slice(0, begin, end);
      if (kept.defined()) {
        backward_rows(kept, p, t, ignore_index, chunk_lse, scale, cpu_scale);
      } else {
        logits_into(p, low, h, w, bias);
        backward_rows(p, p, t, ignore_index, chunk_lse, scale, cpu_scale);
      }
      const at::Tensor p_c = low.defined() ? low.copy_(p) : p;  // (n, V) in the compute dtype
      if (grad_bias.defined()) grad_bias.add_(p.sum(0));
      if (one_chunk && low.defined()) {  // not read again: freed before the products and what they allocate
        p = at::Tensor();
        p_buffer = at::Tensor();
      }
      if (grad_hidden.defined()) {
        at::Tensor g = grad_hidden.slice(0, begin, end);  // (n, H)
        if (g.scalar_type() == compute) {
          at::mm_out(g, p_c, w);
        } else {
          g.copy_(p_c.mm(w));
        }
      }
      if (grad_w) {
        if (one_chunk) {
          grad_weight = p_c.t().mm(h);  // (V, H)
        } else if (compute == at::kFloat) {
          if (begin == 0) {
            at::mm_out(grad_weight, p.t(), h);
          } else {
            grad_weight.addmm_(p.t(), h);
          }
        } else {
          grad_weight.add_(p_c.t().mm(h).to(at::kFloat));  // summed in fp32
        }
      }
    }
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    if (grad_bias.defined()) grad_bias = grad_bias.to(bias.scalar_type());
    return {grad_hidden, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Checks the arguments and runs the Function: chunk tokens at a time, or all of them with their
// logits kept.
at::Tensor run(const char* name, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
               const ChunkedCrossEntropyOptions& options, bool keep_logits) {
  TORCH_CHECK(options.chunk_size() >= 1, name, ": chunk_size must be >= 1, got ", options.chunk_size());
  TORCH_CHECK(weight.dim() == 2, name, ": weight must be (vocabulary, hidden), got ", weight.sizes());
  TORCH_CHECK(hidden.size(-1) == weight.size(1), name, ": hidden size ", hidden.size(-1), " differs from the weight's ", weight.size(1));
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)), name, ": bias must be (", weight.size(0), ")");
  TORCH_CHECK(targets.scalar_type() == at::kLong, name, ": targets must be int64, got ", targets.scalar_type());
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)});  // (N, H)
  const at::Tensor t = targets.reshape({-1}).contiguous();     // (N)
  TORCH_CHECK(h.size(0) == t.size(0), name, ": ", h.size(0), " hidden rows but ", t.size(0), " targets");
  const int64_t V = weight.size(0), N = t.size(0), ignore = options.ignore_index();
  bool in_range = true;
  int64_t count = 0;
  if (t.is_cpu()) {
    const int64_t* p = t.data_ptr<int64_t>();
    for (int64_t i = 0; i < N; ++i) {
      const bool counted = p[i] != ignore;
      count += counted;
      in_range = in_range && (!counted || (p[i] >= 0 && p[i] < V));
    }
  } else {
    const at::Tensor valid = t != ignore;
    in_range = (((t >= 0) & (t < V)) | ~valid).all().item<bool>();
    count = valid.sum().item<int64_t>();
  }
  TORCH_CHECK(in_range, name, ": targets must be in [0, ", V, ") or equal ignore_index ", ignore);
  const c10::optional<at::Tensor> maybe_bias = bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  const int64_t chunk = keep_logits ? std::max<int64_t>(N, 1) : options.chunk_size();
  return ChunkedCrossEntropy::apply(h, weight, maybe_bias, t, chunk, ignore, options.reduction() == Reduction::mean, count, keep_logits)[0];
}

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                                 const ChunkedCrossEntropyOptions& options) {
  return run("chunked_cross_entropy", hidden, weight, bias, targets, options, false);
}

at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                                const ChunkedCrossEntropyOptions& options) {
  return run("linear_cross_entropy", hidden, weight, bias, targets, options, true);
}

namespace {

// chunk_size >= N with kept logits: linear_cross_entropy.
ChunkedCrossEntropyBytes loss_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_size, bool keep_logits, at::ScalarType dtype,
                                    std::optional<at::ScalarType> compute_dtype) {
  const at::ScalarType compute = compute_dtype.value_or(dtype);
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t ce = static_cast<int64_t>(c10::elementSize(compute));
  const int64_t n = std::min(chunk_size, N);
  const bool one_chunk = N <= chunk_size;
  const int64_t weight_copy = compute == dtype ? 0 : V * H * ce;         // the weight in the compute dtype
  const int64_t low_precision = compute == at::kFloat ? 0 : n * V * ce;  // a chunk's product, or gradient, in it
  ChunkedCrossEntropyBytes b;
  b.kept = N * 4 + (keep_logits ? N * V * 4 : 0);  // lse (fp32); the targets are the caller's
  // the buffer of one chunk's fp32 logits (kept, with keep_logits) and of its product
  b.forward_temporary = weight_copy + (keep_logits ? 0 : n * V * 4) + low_precision;
  // The hidden-state gradient (the hidden states arrive in the compute dtype, and each chunk's
  // product is written into it) beside the larger of: the buffers of one chunk's gradient (fp32,
  // and in the compute dtype); and, at the weight's product, those buffers (with one chunk in low
  // precision, the second alone) and (several chunks, low precision) p^T @ h and its fp32 copy
  // summed into the fp32 gradient, or (one chunk, a weight not in the compute dtype) the gradient
  // before it takes the weight's dtype.
  int64_t product = 0;
  if (!one_chunk && compute != at::kFloat) product = V * H * (ce + 4);
  if (one_chunk && compute != dtype) product = V * H * ce;
  const int64_t gradient_buffers = n * V * 4 + low_precision;
  const int64_t at_product = (one_chunk && compute != at::kFloat ? low_precision : gradient_buffers) + product;
  b.backward_temporary = weight_copy + N * H * ce + std::max(gradient_buffers, at_product);
  b.weight_gradient = one_chunk ? V * H * e : V * H * 4;  // in the weight's dtype, or summed in fp32
  return b;
}

}  // namespace

ChunkedCrossEntropyBytes chunked_cross_entropy_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_size, at::ScalarType dtype,
                                                     std::optional<at::ScalarType> compute_dtype) {
  return loss_bytes(N, H, V, chunk_size, false, dtype, compute_dtype);
}

ChunkedCrossEntropyBytes linear_cross_entropy_bytes(int64_t N, int64_t H, int64_t V, at::ScalarType dtype,
                                                    std::optional<at::ScalarType> compute_dtype) {
  return loss_bytes(N, H, V, std::max<int64_t>(N, 1), true, dtype, compute_dtype);
}

}  // namespace loss
}  // namespace frugal
