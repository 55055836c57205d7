#include "frugal/optim/update.h"

#include <ATen/CPUGeneratorImpl.h>

#include "adam_kernel.h"

#include <cmath>
#include <mutex>

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

std::optional<Algorithm> parse_algorithm(const std::string& name) {
  for (Algorithm a : kAllAlgorithms) {
    if (name == algorithm_name(a)) return a;
  }
  return std::nullopt;
}

std::optional<uint64_t> rounding_seed(const Hyper& h, const at::Tensor& param) {
  if (!h.stochastic_rounding || param.scalar_type() != at::kBFloat16) return std::nullopt;
  if (h.rounding_seed) return h.rounding_seed;
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get<at::CPUGeneratorImpl>()->random64();
}

at::Tensor stochastic_round_bf16(const at::Tensor& x, const c10::optional<at::Generator>& gen) {
  // bf16 is the top 16 bits of fp32: add a uniform 16-bit integer to the bit pattern and drop the
  // low 16 bits; values round up with probability equal to their distance from the lower one.
  const at::Tensor bits = x.to(at::kFloat).contiguous().view(at::kInt);
  const at::Tensor noise = at::randint(0, 1 << 16, x.sizes(), gen, at::TensorOptions().dtype(at::kInt).device(x.device()));
  const at::Tensor rounded = (bits + noise).bitwise_and(static_cast<int32_t>(0xFFFF0000u));
  const at::Tensor finite = at::isfinite(x);
  return at::where(finite, rounded.view(at::kFloat), x.to(at::kFloat)).to(at::kBFloat16);
}

const char* dense_cpu_kernel() { return dense_kernel_name(dense_kernel_chosen()); }

bool adam_takes_dense_kernel() {
  const AtenRounding& r = aten_rounding();
  return r.add_fused && r.addcmul_fused;
}

bool adam_kernel_gives_aten_bits() { return adam_takes_dense_kernel() && aten_rounding().sqrt_exact; }

bool sgd_takes_dense_kernel() { return aten_rounding().add_fused; }

namespace {

AdamStep adam_step_of(const Hyper& h, int64_t step) {
  const double bias_correction1 = 1 - std::pow(h.beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(h.beta2, static_cast<double>(step));
  return AdamStep{h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, bias_correction1, bias_correction2, h.algorithm == Algorithm::adamw};
}

// Adam(W)'s arithmetic in ATen operations, in torch::optim's order (weight decay, both moments, the
// update), in place on p, m and v: the path of every parameter no fused kernel takes.
void adam_aten(const AdamStep& s, const at::Tensor& p, at::Tensor g, const at::Tensor& m, const at::Tensor& v) {
  if (s.decoupled) {
    if (s.weight_decay != 0) p.mul_(1 - s.lr * s.weight_decay);
  } else if (s.weight_decay != 0) {
    g = g.add(p, s.weight_decay);
  }
  m.mul_(s.beta1).add_(g, 1 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1 - s.beta2);
  const at::Tensor denom = (v.sqrt() / std::sqrt(s.bias_correction2)).add_(s.eps);
  p.addcdiv_(m, denom, -s.lr / s.bias_correction1);
}

// How the fused kernels round a bf16 parameter: stochastically with one seed per update
// (rounding_seed), when asked; to nearest even otherwise.
Bf16Rounding rounding_of(const Hyper& h, const at::Tensor& param) {
  Bf16Rounding rounding;
  const std::optional<uint64_t> seed = rounding_seed(h, param);
  rounding.stochastic = seed.has_value();
  rounding.seed = seed.value_or(0);
  return rounding;
}

// File placement: both moments' chunk [begin, end) in the window for the life of this, the next
// chunk read ahead first. `slots`: in window buffers (the fused CPU kernels' path, m() and v()
// point at the chunk); otherwise mapped in, and unmapped and written back after.
class Window {
 public:
  Window(ParamState& state, int64_t begin, int64_t end, bool slots) : state_(state), begin_(begin), end_(end), slots_(slots) {
    if (!state.m->windowed()) return;
    for (StateBuffer* s : {state.m.get(), state.v.get()}) s->prefetch(end, end + (end - begin), /*urgent=*/true);
    if (!slots) {
      for (StateBuffer* s : {state.m.get(), state.v.get()}) s->acquire(begin, end);
      return;
    }
    m_ = state.m->acquire_slot(begin, end);
    try {
      v_ = state.v->acquire_slot(begin, end);
    } catch (...) {
      state.m->release_slot(begin, end);
      throw;
    }
  }
  ~Window() {
    if (!state_.m->windowed()) return;
    for (StateBuffer* s : {state_.m.get(), state_.v.get()}) slots_ ? s->release_slot(begin_, end_) : s->release(begin_, end_);
  }
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;
  uint8_t* m() const { return m_; }
  uint8_t* v() const { return v_; }

 private:
  ParamState& state_;
  int64_t begin_, end_;
  bool slots_;
  uint8_t *m_ = nullptr, *v_ = nullptr;
};

// Adam(W) over chunks of blocks: load each chunk of the moments as fp32, update, store back.
void apply_buffered_adam(const Hyper& h, ParamState& state, at::Tensor& param, const at::Tensor& grad) {
  if (!state.m) {
    state.m = std::make_shared<StateBuffer>(param, /*is_signed=*/true, h.state);
    state.v = std::make_shared<StateBuffer>(param, /*is_signed=*/false, h.state);
  }
  const int64_t n = param.numel(), chunk = state.m->chunk();
  TORCH_CHECK(param.is_contiguous(), "optimizer: parameters must be contiguous");
  at::Tensor p_flat = param.view({-1});
  const at::Tensor g_flat = grad.reshape({-1});
  const bool fp32_param = param.scalar_type() == at::kFloat;
  // 8- and 4-bit moments of a parameter in fp32 or bf16 on the CPU, or on a GPU in a CUDA build:
  // the fused kernel (one pass per block, no fp32 temporaries; bf16 is widened and rounded back
  // inside it). On a GPU the state may live in host memory or a mapped file: the CUDA kernel copies
  // each chunk's codes and scales over and back.
  QuantizedBuffer *qm = state.m->quantized(), *qv = state.v->quantized();
  const bool cpu = param.device().is_cpu();
  if (qm && qv && uses_fused_kernel(param.scalar_type(), param.device()) && (!cpu || qm->codes().device().is_cpu())) {
    const AdamStep step = adam_step_of(h, state.step);
    const Bf16Rounding rounding = rounding_of(h, param);
    const bool kernel_dtype = g_flat.scalar_type() == at::kFloat || g_flat.scalar_type() == at::kBFloat16;
    for (int64_t b = 0; b < n; b += chunk) {
      const int64_t e = std::min(n, b + chunk);
      const Window window(state, b, e, /*slots=*/cpu);
      const at::Tensor g = g_flat.narrow(0, b, e - b);
      const at::Tensor g_chunk = kernel_dtype ? g.contiguous() : g.to(at::kFloat).contiguous();
      if (cpu) {
        adam_step_quantized_cpu(step, p_flat.narrow(0, b, e - b), g_chunk, *qm, *qv, b, e, rounding, QuantKernel::automatic, window.m(),
                                window.v());
      } else {
        state.m->add_transfer_seconds(adam_step_quantized_cuda(step, p_flat.narrow(0, b, e - b), g_chunk, *qm, *qv, b, e, rounding));
      }
    }
    return;
  }
  // fp32 or bf16 moments of a CPU parameter: one fused pass over the whole parameter, in place
  // (where ATen's multiply-adds are fused as the kernel's: update.h); a chunk at a time through
  // file placement's window, with the whole pass's rounding noise.
  const at::Tensor &dm = state.m->dense(), &dv = state.v->dense();
  if (cpu && dm.defined() && dv.defined() && adam_dense_kernel_applies(p_flat, g_flat, dm, dv) && adam_takes_dense_kernel()) {
    const AdamStep step = adam_step_of(h, state.step);
    Bf16Rounding rounding = rounding_of(h, param);
    const int64_t span = state.m->windowed() ? chunk : n;
    for (int64_t b = 0; b < n; b += span) {
      const int64_t e = std::min(n, b + span);
      const Window window(state, b, e, /*slots=*/true);
      rounding.first_index = b;
      // Through the window the moments are the chunk in its buffers; in memory, views of the state.
      const at::Tensor m = window.m() ? at::from_blob(window.m(), {e - b}, dm.options()) : dm.narrow(0, b, e - b);
      const at::Tensor v = window.v() ? at::from_blob(window.v(), {e - b}, dv.options()) : dv.narrow(0, b, e - b);
      adam_step_dense_cpu(step, p_flat.narrow(0, b, e - b), g_flat.narrow(0, b, e - b), m, v, rounding);
    }
    return;
  }
  // Stochastic rounding's noise on the CPU from the update's one seed (so no other thread's use of
  // the default generator comes between its chunks); on a GPU from the device's default generator.
  c10::optional<at::Generator> noise;
  if (cpu && !fp32_param && h.stochastic_rounding && param.scalar_type() == at::kBFloat16) {
    noise = at::make_generator<at::CPUGeneratorImpl>(rounding_of(h, param).seed);
  }
  for (int64_t b = 0; b < n; b += chunk) {
    const int64_t e = std::min(n, b + chunk);
    const Window window(state, b, e, /*slots=*/false);
    at::Tensor p_view = p_flat.narrow(0, b, e - b);
    at::Tensor p = fp32_param ? p_view : p_view.to(at::kFloat);  // (e - b)
    const at::Tensor m = state.m->load(b, e, param.device()), v = state.v->load(b, e, param.device());
    adam_aten(adam_step_of(h, state.step), p, g_flat.narrow(0, b, e - b).to(at::kFloat), m, v);
    state.m->store(b, e, m);
    state.v->store(b, e, v);
    if (!fp32_param)
      p_view.copy_(h.stochastic_rounding && param.scalar_type() == at::kBFloat16 ? stochastic_round_bf16(p, noise)
                                                                                 : p.to(param.scalar_type()));
  }
}

}  // namespace

void apply_update(const Hyper& h, ParamState& state, at::Tensor& param, const at::Tensor& grad) {
  at::NoGradGuard no_grad;
  state.step += 1;
  if (h.algorithm == Algorithm::sgd) {
    if (param.device().is_cpu() && sgd_dense_kernel_applies(param, grad, state.momentum_buffer) && sgd_takes_dense_kernel()) {
      const bool first = h.momentum != 0 && !state.momentum_buffer.defined();
      if (first) state.momentum_buffer = at::empty_like(param, at::MemoryFormat::Contiguous);
      sgd_step_dense_cpu(SgdStep{h.lr, h.weight_decay, h.momentum, h.dampening, h.nesterov}, param, grad,
                         h.momentum != 0 ? state.momentum_buffer : at::Tensor(), first);
      return;
    }
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
  if (h.buffered(param)) {
    apply_buffered_adam(h, state, param, grad);
    return;
  }
  // Adam and AdamW
  if (!state.exp_avg.defined()) {
    state.exp_avg = at::zeros_like(param, at::MemoryFormat::Preserve);
    state.exp_avg_sq = at::zeros_like(param, at::MemoryFormat::Preserve);
  }
  // fp32 parameter and moments on the CPU: one fused pass (bf16 parameters keep bf16 moments here,
  // each ATen operation rounding to bf16, which a fused fp32 pass would not reproduce).
  if (param.scalar_type() == at::kFloat && state.exp_avg.scalar_type() == at::kFloat &&
      adam_dense_kernel_applies(param, grad, state.exp_avg, state.exp_avg_sq) && adam_takes_dense_kernel()) {
    adam_step_dense_cpu(adam_step_of(h, state.step), param, grad, state.exp_avg, state.exp_avg_sq, Bf16Rounding{});
    return;
  }
  adam_aten(adam_step_of(h, state.step), param, grad, state.exp_avg, state.exp_avg_sq);
}

}  // namespace optim
}  // namespace frugal
