#include "frugal/loss/chunked_cross_entropy.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

namespace frugal {
namespace loss {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// logits of one chunk in fp32: h: (n, H), weight: (V, H), bias: (V) -> (n, V)
at::Tensor chunk_logits(const at::Tensor& h, const at::Tensor& weight, const at::Tensor& bias) {
  at::Tensor logits = bias.defined() ? at::addmm(bias, h, weight.t()) : at::mm(h, weight.t());
  return logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat);
}

class ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
 public:
  // hidden: (N, H), targets: (N)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& maybe_bias, const at::Tensor& targets, int64_t chunk,
                               int64_t ignore_index, bool mean) {
    const at::Tensor bias = maybe_bias.has_value() ? *maybe_bias : at::Tensor();
    const int64_t N = hidden.size(0);
    const at::Tensor valid = targets != ignore_index;          // (N) bool
    const at::Tensor safe_targets = targets.masked_fill(~valid, 0);  // (N) in [0, V)
    at::Tensor lse = at::empty({N}, hidden.options().dtype(at::kFloat));  // (N), kept for backward
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kDouble));
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk);
      const at::Tensor logits = chunk_logits(hidden.slice(0, begin, end), weight, bias);  // (n, V)
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
    // d loss / d logit = (softmax - onehot(target)) * scale, zero for ignored tokens
    at::Tensor scale = grads[0].to(at::kFloat);
    if (ctx->saved_data["mean"].toBool()) scale = scale / count;
    const int64_t N = hidden.size(0);
    at::Tensor grad_hidden = ctx->needs_input_grad(0) ? at::empty_like(hidden) : at::Tensor();
    // Over several chunks the weight's gradient is summed in fp32; with one chunk it is made in the
    // weight's dtype directly (for bf16 weights, no fp32 copy of a (V, H) matrix).
    const bool one_chunk = N <= chunk;
    at::Tensor grad_weight = ctx->needs_input_grad(1) && !one_chunk
                                 ? at::zeros(weight.sizes(), weight.options().dtype(at::kFloat))
                                 : at::Tensor();
    at::Tensor grad_bias = (bias.defined() && ctx->needs_input_grad(2))
                               ? at::zeros(bias.sizes(), bias.options().dtype(at::kFloat))
                               : at::Tensor();
    for (int64_t begin = 0; begin < N; begin += chunk) {
      const int64_t end = std::min(N, begin + chunk);
      const at::Tensor h = hidden.slice(0, begin, end);                          // (n, H)
      at::Tensor p = chunk_logits(h, weight, bias);                              // (n, V) logits
      p.sub_(lse.slice(0, begin, end).unsqueeze(1)).exp_();                      // softmax
      const at::Tensor v = valid.slice(0, begin, end).to(at::kFloat).unsqueeze(1);  // (n, 1)
      p.scatter_add_(1, safe_targets.slice(0, begin, end).unsqueeze(1), -v);     // - onehot
      p.mul_(v * scale);                                                         // (n, V)
      // The products in the weight's dtype: no fp32 copy of a bf16 (V, H) weight.
      const at::Tensor p_w = p.scalar_type() == weight.scalar_type() ? p : p.to(weight.scalar_type());  // (n, V)
      if (grad_hidden.defined()) grad_hidden.slice(0, begin, end).copy_(p_w.mm(weight));  // (n, H)
      if (ctx->needs_input_grad(1)) {
        if (one_chunk) {
          grad_weight = p_w.t().mm(h);                                             // (V, H)
        } else {
          grad_weight.addmm_(p.t(), h.to(at::kFloat));                           // (V, H)
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
                                                     at::ScalarType dtype) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t n = std::min(chunk_size, N);
  const int64_t low_precision_logits = dtype == at::kFloat ? 0 : n * V * e;  // chunk_logits before .to(fp32)
  ChunkedCrossEntropyBytes b;
  b.kept = N * (4 + 8 + 1);                                  // lse (fp32), safe_targets (int64), valid (bool)
  b.forward_temporary = 2 * n * V * 4 + low_precision_logits;  // logits and logsumexp's exp(logits - max)
  // p (fp32) and its copy in the weight's dtype, grad_hidden, one chunk's product p @ weight
  b.backward_temporary = n * V * 4 + low_precision_logits + N * H * e + n * H * e;
  if (N <= chunk_size) {
    b.weight_gradient = V * H * e;  // made in the weight's dtype from one chunk
  } else {
    b.weight_gradient = V * H * 4;  // summed in fp32 over the chunks (then rounded to the weight's dtype)
  }
  return b;
}

}  // namespace loss
}  // namespace frugal
