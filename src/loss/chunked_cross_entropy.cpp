#include "frugal/loss/chunked_cross_entropy.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <optional>

#include "frugal/checkpoint/autocast.h"

namespace frugal {
namespace loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// logits of one chunk in fp32: h: (n, H) and weight: (V, H), both in the compute dtype, bias: (V)
// in its own -> (n, V). The bias is added in fp32, after the product.
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias) {
  at::Tensor logits = at::mm(h, weight.t());
  if (logits.scalar_type() != at::kFloat) logits = logits.to(at::kFloat);
  if (bias.defined()) logits.add_(bias);
  return logits;
}

at::Tensor in_dtype(const at::Tensor& t, at::ScalarType dtype) { return t.scalar_type() == dtype ? t : t.to(dtype); }

class ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
 public:
  // hidden: (N, H), targets: (N). The products run in `compute` (the weight's dtype, or autocast's
  // for an fp32 weight), the softmax, its log-sum-exp and the loss in fp32.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& maybe_bias, const at::Tensor& targets, int64_t chunk,
                               int64_t ignore_index, bool mean) {
    const at::Tensor bias = maybe_bias.has_value() ? *maybe_bias : at::Tensor();
    const at::ScalarType compute = checkpoint::compute_dtype_for(weight);
    // The products' dtype is fixed here and in backward, whatever autocast state either runs under.
    checkpoint::AutocastGuard explicit_dtypes(checkpoint::AutocastState::off());
    const at::Tensor w = in_dtype(weight, compute);  // one cast for every chunk
    const int64_t N = hidden.size(0);
    const at::Tensor valid = targets != ignore_index;          // (N) bool
    const at::Tensor safe_targets = targets.masked_fill(~valid, 0);  // (N) in [0, V)
    at::Tensor lse = at::empty({N}, hidden.options().dtype(at::kFloat));  // (N), kept for backward
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kDouble));
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk);
      const at::Tensor logits = chunk_logits(in_dtype(hidden.slice(0, begin, end), compute), w, bias);  // (n, V)
      const at::Tensor lse_c = at::logsumexp(logits, 1);                                  // (n)
      lse.slice(0, begin, end).copy_(lse_c);
      const at::Tensor picked = logits.gather(1, safe_targets.slice(0, begin, end).unsqueeze(1)).squeeze(1);
      total += ((lse_c - picked) * valid.slice(0, begin, end)).sum(at::kDouble);
    }
    const at::Tensor count = valid.sum().to(at::kDouble);
    ctx->save_for_backward({hidden, weight, bias.defined() ? bias : at::Tensor(), safe_targets, valid, lse});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["mean"] = mean;
    ctx->saved_data["has_bias"] = bias.defined();
    ctx->saved_data["compute"] = static_cast<int64_t>(compute);
    const at::Tensor loss = mean ? total / count : total;
    ctx->saved_data["count"] = count.item<double>();
    return {loss.to(at::kFloat)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &weight = saved[1], &safe_targets = saved[3], &valid = saved[4],
                     &lse = saved[5];
    const at::Tensor bias = ctx->saved_data["has_bias"].toBool() ? saved[2] : at::Tensor();
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double count = ctx->saved_data["count"].toDouble();
    const auto compute = static_cast<at::ScalarType>(ctx->saved_data["compute"].toInt());
    checkpoint::AutocastGuard explicit_dtypes(checkpoint::AutocastState::off());
    // d loss / d logit = (softmax - onehot(target)) * scale, zero for ignored tokens
    at::Tensor scale = grads[0].to(at::kFloat);
    if (ctx->saved_data["mean"].toBool()) scale = scale / count;
    const int64_t N = hidden.size(0);
    const at::Tensor w = in_dtype(weight, compute);  // the forward's products again
    at::Tensor grad_hidden = ctx->needs_input_grad(0) ? at::empty_like(hidden) : at::Tensor();
    // Over several chunks the weight's gradient is summed in fp32; with one chunk it is made in the
    // compute dtype directly (for bf16 weights, no fp32 copy of a (V, H) matrix).
    const bool one_chunk = N <= chunk;
    at::Tensor grad_weight = ctx->needs_input_grad(1) && !one_chunk
                                 ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat))
                                 : at::Tensor();
    at::Tensor grad_bias = (bias.defined() && ctx->needs_input_grad(2))
                               ? at::zeros(bias.sizes(), bias.options().dtype(at::kFloat))
                               : at::Tensor();
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk);
      const at::Tensor h = in_dtype(hidden.slice(0, begin, end), compute);         // (n, H)
      at::Tensor p = chunk_logits(h, w, bias);                                    // (n, V) logits
      p.sub_(lse.slice(0, begin, end).unsqueeze(1)).exp_();                      // softmax
      const at::Tensor v = valid.slice(0, begin, end).to(at::kFloat).unsqueeze(1);  // (n, 1)
      p.scatter_add_(1, safe_targets.slice(0, begin, end).unsqueeze(1), -v);     // - onehot
      p.mul_(v * scale);                                                         // (n, V)
      const at::Tensor p_c = in_dtype(p, compute);                               // (n, V)
      if (grad_hidden.defined()) grad_hidden.slice(0, begin, end).copy_(p_c.mm(w));  // (n, H)
      if (ctx->needs_input_grad(1)) {
        if (one_chunk) {
          grad_weight = p_c.t().mm(h);                                             // (V, H)
        } else if (compute == at::kFloat) {
          grad_weight.addmm_(p.t(), h);                                            // (V, H)
        } else {
          grad_weight.add_(p_c.t().mm(h).to(at::kFloat));                         // summed in fp32
        }
      }
      if (grad_bias.defined()) grad_bias.add_(p.sum(0));
    }
    if (grad_weight.defined()) grad_weight = grad_weight.to(weight.scalar_type());
    if (grad_bias.defined()) grad_bias = grad_bias.to(bias.scalar_type());
    return {grad_hidden, grad_weight, grad_bias, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor chunked_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                                 const at::Tensor& targets, const ChunkedCrossEntropyOptions& options) {
  TORCH_CHECK(options.chunk_size() >= 1, "chunked_cross_entropy: chunk_size must be >= 1, got ", options.chunk_size());
  TORCH_CHECK(weight.dim() == 2, "chunked_cross_entropy: weight must be (vocabulary, hidden), got ", weight.sizes());
  TORCH_CHECK(hidden.size(-1) == weight.size(1), "chunked_cross_entropy: hidden size ", hidden.size(-1),
              " differs from the weight's ", weight.size(1));
  TORCH_CHECK(!bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
              "chunked_cross_entropy: bias must be (", weight.size(0), ")");
  TORCH_CHECK(targets.scalar_type() == at::kLong, "chunked_cross_entropy: targets must be int64, got ",
              targets.scalar_type());
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)});  // (N, H)
  const at::Tensor t = targets.reshape({-1});                  // (N)
  TORCH_CHECK(h.size(0) == t.size(0), "chunked_cross_entropy: ", h.size(0), " hidden rows but ", t.size(0), " targets");
  const int64_t V = weight.size(0);
  const bool in_range = (((t >= 0) & (t < V)) | (t == options.ignore_index())).all().item<bool>();
  TORCH_CHECK(in_range, "chunked_cross_entropy: targets must be in [0, ", V, ") or equal ignore_index ",
              options.ignore_index());
  const c10::optional<at::Tensor> maybe_bias = bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  return ChunkedCrossEntropy::apply(h, weight, maybe_bias, t, options.chunk_size(), options.ignore_index(),
                                    options.reduction() == Reduction::mean)[0];
}

ChunkedCrossEntropyBytes chunked_cross_entropy_bytes(int64_t N, int64_t H, int64_t V, int64_t chunk_size,
                                                     at::ScalarType dtype, std::optional<at::ScalarType> compute_dtype) {
  const at::ScalarType compute = compute_dtype.value_or(dtype);
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t ce = static_cast<int64_t>(c10::elementSize(compute));
  const int64_t n = std::min(chunk_size, N);
  const bool one_chunk = N <= chunk_size;
  const int64_t weight_copy = compute == dtype ? 0 : V * H * ce;           // the weight in the compute dtype
  const int64_t low_precision_logits = compute == at::kFloat ? 0 : n * V * ce;  // a product before .to(fp32)
  ChunkedCrossEntropyBytes b;
  b.kept = N * (4 + 8 + 1);                                  // lse (fp32), safe_targets (int64), valid (bool)
  // one chunk's fp32 logits and logsumexp's exp(logits - max) (a low-precision product is freed
  // once converted, before logsumexp runs)
  b.forward_temporary = weight_copy + 2 * n * V * 4;
  // p (fp32) and its copy in the compute dtype, grad_hidden (the hidden states arrive in the compute
  // dtype), then one chunk's product p @ weight, or (several chunks, low precision) p^T @ h and its
  // fp32 copy summed into the fp32 gradient, or (one chunk, fp32 weight) the gradient before it is fp32
  int64_t product = n * H * ce;
  if (!one_chunk && compute != at::kFloat) product = std::max(product, V * H * (ce + 4));
  if (one_chunk && compute != dtype) product = std::max(product, V * H * ce);
  b.backward_temporary = weight_copy + n * V * 4 + low_precision_logits + N * H * ce + product;
  b.weight_gradient = one_chunk ? V * H * e : V * H * 4;  // in the weight's dtype, or summed in fp32
  return b;
}

}  // namespace loss
}  // namespace frugal
