#include "frugal/models/decoder.h"

#include <c10/core/DefaultDtype.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/selective.h"
#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/models/attention.h"
#include "fused_ops.h"

namespace frugal {
namespace models {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::string DecoderConfig::validate() const {
  auto positive = [](const char* name, int64_t v) {
    return v >= 1 ? std::string() : std::string(name) + " must be a positive integer, got " + std::to_string(v);
  };
  for (const auto& m :
       {positive("vocab_size", vocab_size), positive("dim", dim), positive("n_layers", n_layers), positive("n_heads", n_heads),
        positive("n_kv_heads", n_kv_heads), positive("ffn_dim", ffn_dim), positive("max_seq_len", max_seq_len)}) {
    if (!m.empty()) return m;
  }
  if (arch != "llama" && arch != "gpt2") return "arch must be llama or gpt2, got '" + arch + "'";
  if (explicit_head_dim < 0) return "head_dim must be positive, got " + std::to_string(explicit_head_dim);
  if (explicit_head_dim == 0 && dim % n_heads != 0) {
    return "dim " + std::to_string(dim) + " must be divisible by n_heads " + std::to_string(n_heads);
  }
  if (n_heads % n_kv_heads != 0) {
    return "n_heads " + std::to_string(n_heads) + " must be divisible by n_kv_heads " + std::to_string(n_kv_heads);
  }
  if (arch == "llama" && head_dim() % 2 != 0) {
    return "the head size (head_dim " + std::to_string(head_dim()) + ") must be even for rotary embeddings";
  }
  if (arch == "gpt2") {
    if (n_kv_heads != n_heads) return "gpt2 has no grouped-query attention: n_kv_heads must equal n_heads";
    if (explicit_head_dim != 0 && explicit_head_dim * n_heads != dim) return "gpt2 has no head_dim of its own: it is dim / n_heads";
    if (attention_bias || mlp_bias) return "gpt2 always has biases: attention_bias and mlp_bias are llama's";
    if (rope_scaling.type != "default") return "gpt2 has no rotary embeddings: rope_scaling must be default";
  }
  const std::string act = resolved_activation();
  if (act != "silu" && act != "gelu" && act != "gelu_tanh") {
    return "activation must be silu, gelu or gelu_tanh, got '" + activation + "'";
  }
  if (!(norm_eps > 0)) return "norm_eps must be > 0";
  if (!(rope_theta > 0)) return "rope_theta must be > 0";
  if (!(dropout >= 0 && dropout < 1)) return "dropout must be in [0, 1)";
  const RopeScaling& r = rope_scaling;
  if (r.type != "default" && r.type != "linear" && r.type != "llama3" && r.type != "dynamic") {
    return "rope_type '" + r.type + "' is not supported (allowed: default, linear, llama3, dynamic)";
  }
  if (r.type != "default" && !(r.factor >= 1)) return "rope factor must be >= 1, got " + std::to_string(r.factor);
  if (r.type == "llama3") {
    if (r.original_max_position_embeddings < 1) return "rope_type llama3 needs original_max_position_embeddings";
    if (!(r.low_freq_factor > 0) || !(r.high_freq_factor > r.low_freq_factor)) {
      return "rope_type llama3 needs 0 < low_freq_factor < high_freq_factor";
    }
  }
  const std::string no_kernel = attention_kernel_unavailable(attention);
  if (!no_kernel.empty()) return std::string("attention ") + attention_kernel_name(attention) + " " + no_kernel;
  return "";
}

int64_t DecoderConfig::param_count() const {
  int64_t total = 0;
  for (const int64_t n : parameter_numels(*this)) total += n;
  return total;
}

// ---- RMSNorm: a Function that keeps only its input and 1/rms for backward ----

namespace {

class RMSNormFn : public torch::autograd::Function<RMSNormFn> {
 public:
  // x: (..., d), weight: (d)
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    // Under autocast the output goes straight to the products' dtype (normalised and scaled in
    // fp32, rounded once): the only copy the next matrix products read and keep.
    const at::ScalarType out = precision::compute_dtype_for(x);
    if (fused::rms_norm_takes(x, weight, out)) {
      auto [y, r] = fused::rms_norm_forward(x, weight, eps, out);
      ctx->save_for_backward({x, weight, r});
      return {y};
    }
    const at::Tensor xf = x.to(at::kFloat);
    const at::Tensor r = (xf.pow(2).mean(-1, /*keepdim=*/true) + eps).rsqrt();  // (..., 1)
    ctx->save_for_backward({x, weight, r});
    if (out != x.scalar_type()) return {(xf * r * weight.to(at::kFloat)).to(out)};
    return {(xf * r).to(x.scalar_type()) * weight};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    if (fused::rms_norm_takes(s[0], s[1], at::kFloat) && grads[0].device().is_cpu() &&
        (grads[0].scalar_type() == at::kFloat || grads[0].scalar_type() == at::kBFloat16)) {
      auto [gx, gw] = fused::rms_norm_backward(s[0], s[1], s[2], grads[0], ctx->needs_input_grad(0), ctx->needs_input_grad(1));
      return {gx, gw, at::Tensor()};
    }
    const at::Tensor xf = s[0].to(at::kFloat), wf = s[1].to(at::kFloat), &r = s[2];
    const at::Tensor g = grads[0].to(at::kFloat);
    const at::Tensor xhat = xf * r;
    at::Tensor gw;
    if (ctx->needs_input_grad(1)) gw = (g * xhat).reshape({-1, xf.size(-1)}).sum(0).to(s[1].scalar_type());
    at::Tensor gx;
    if (ctx->needs_input_grad(0)) {
      const at::Tensor gxhat = g * wf;  // (..., d)
      gx = (r * (gxhat - xhat * (gxhat * xhat).mean(-1, true))).to(s[0].scalar_type());
    }
    return {gx, gw, at::Tensor()};
  }
};

at::Tensor rotate_half(const at::Tensor& x) {  // x: (..., hd) -> (-x2, x1)
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// cos, sin: (T, hd) for positions offset..offset+T-1
std::pair<at::Tensor, at::Tensor> rotary_tables(int64_t offset, int64_t T, int64_t hd, const DecoderConfig& c,
                                                const at::TensorOptions& opts) {
  const auto f32 = opts.dtype(at::kFloat);
  const at::Tensor inv_freq = rotary_inv_freq(hd, c.rope_theta, c.rope_scaling, c.max_seq_len, offset + T, f32);
  const at::Tensor freqs = at::outer(at::arange(offset, offset + T, f32), inv_freq);  // (T, hd/2)
  const at::Tensor emb = at::cat({freqs, freqs}, -1);                                 // (T, hd)
  return {emb.cos(), emb.sin()};
}

// cos, sin: (B, T, hd) at each token's position (B, T) int64, all below T (dynamic scaling is
// checked for T): a packed forward's tables, made once and read by every block.
std::pair<at::Tensor, at::Tensor> rotary_tables_at(const at::Tensor& positions, int64_t hd, const DecoderConfig& c) {
  const auto f32 = positions.options().dtype(at::kFloat);
  const at::Tensor inv_freq = rotary_inv_freq(hd, c.rope_theta, c.rope_scaling, c.max_seq_len, positions.size(1), f32);
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // (B, T, hd/2)
  const at::Tensor emb = at::cat({freqs, freqs}, -1);                          // (B, T, hd)
  return {emb.cos(), emb.sin()};
}

// Rotary embedding as a Function that keeps nothing but the tables: x: (B, T, H, hd) and cos, sin
// (T, hd), or (B, T, hd) per token -> (B, H, T, hd), a transposed view laid out (B, T, H, hd).
// sdpa's output follows its query's layout, so merging the heads after it is then a view too, not
// a copy kept by o_proj beside the output sdpa keeps.
class RotaryFn : public torch::autograd::Function<RotaryFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    if (fused::rotary_takes(x, cos)) return {fused::rotary_forward(x, cos, sin).transpose(1, 2)};
    const at::Tensor c = cos.unsqueeze(-2).to(x.scalar_type()), s = sin.unsqueeze(-2).to(x.scalar_type());  // ([B,] T, 1, hd)
    return {(x * c + rotate_half(x) * s).transpose(1, 2)};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grads[0].transpose(1, 2);  // (B, T, H, hd)
    if (fused::rotary_takes(g, saved[0])) return {fused::rotary_backward(g, saved[0], saved[1]), at::Tensor(), at::Tensor()};
    const at::Tensor c = saved[0].unsqueeze(-2).to(g.scalar_type()), s = saved[1].unsqueeze(-2).to(g.scalar_type());
    // y = x c + R(x) s with R(x) = (-x2, x1); R^T(u) = (u2, -u1) = -R(u)
    return {g * c - rotate_half(g * s), at::Tensor(), at::Tensor()};
  }
};

// SwiGLU's silu(gate) * up as one Function that keeps only gate and up (autograd would also keep
// silu(gate)) and recomputes silu(gate) in backward. On the CPU in fp32 or bf16 it is one fused pass
// forward and one backward (fused_ops.h); elsewhere (CUDA, fp16) the transcendental parts go
// through fp32, rounded once per result, a slice of rows at a time so the fp32 copies stay a small
// fraction of the tensors.
class SwiGLUFn : public torch::autograd::Function<SwiGLUFn> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    ctx->save_for_backward({gate, up});
    if (fused::swiglu_takes(gate, up)) return {fused::swiglu_forward(gate, up)};
    at::Tensor out = at::empty_like(gate);
    for_each_slice(gate, [&](int64_t b, int64_t n) {
      // out of place: for fp32 rows the cast is the saved gate itself
      rows(out, b, n).copy_(at::silu(rows(gate, b, n).to(at::kFloat)).mul_(rows(up, b, n)));
    });
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &gate = saved[0], &up = saved[1], &g = grads[0];
    if (fused::swiglu_takes(gate, up) && g.scalar_type() == gate.scalar_type() && g.device().is_cpu()) {
      auto [d_gate, d_up] = fused::swiglu_backward(gate, up, g, ctx->needs_input_grad(0), ctx->needs_input_grad(1));
      return {d_gate, d_up};
    }
    at::Tensor d_gate, d_up;
    if (ctx->needs_input_grad(0)) d_gate = at::empty_like(gate);
    if (ctx->needs_input_grad(1)) d_up = at::empty_like(up);
    for_each_slice(gate, [&](int64_t b, int64_t n) {
      at::Tensor x = rows(gate, b, n).to(at::kFloat), gs = rows(g, b, n);
      if (d_gate.defined()) {
        at::Tensor gu = (gs * rows(up, b, n)).to(at::kFloat);
        at::silu_backward_out(gu, gu, x);
        rows(d_gate, b, n).copy_(gu);
      }
      if (d_up.defined()) rows(d_up, b, n).copy_(at::silu(x).mul_(gs));
    });
    return {d_gate, d_up};
  }

 private:
  // rows [b, b + n) of x seen as (rows, last dim)
  static at::Tensor rows(const at::Tensor& x, int64_t b, int64_t n) { return x.reshape({-1, x.size(-1)}).narrow(0, b, n); }
  template <typename F>
  static void for_each_slice(const at::Tensor& x, F&& f) {
    const int64_t width = std::max<int64_t>(1, x.size(-1)), total = x.numel() / width;
    const int64_t step = std::max<int64_t>(1, kSwiGLUSliceElements / width);
    for (int64_t b = 0; b < total; b += step) f(b, std::min(step, total - b));
  }
};

// (B, KV, T, hd) -> (B, H, T, hd), each kv head serving H/KV query heads
at::Tensor repeat_kv(const at::Tensor& x, int64_t rep) {
  if (rep == 1) return x;
  const int64_t B = x.size(0), KV = x.size(1), T = x.size(2), hd = x.size(3);
  return x.unsqueeze(2).expand({B, KV, rep, T, hd}).reshape({B, KV * rep, T, hd});
}

at::Tensor lin(const torch::nn::Linear& l, const at::Tensor& x) { return checkpoint::linear(x, l->weight, l->bias); }

// x -> act(x) for the resolved activation names (DecoderConfig::resolved_activation)
at::Tensor activate(const at::Tensor& x, const std::string& act) {
  if (act == "silu") return at::silu(x);
  if (act == "gelu") return at::gelu(x);  // erf
  return at::gelu(x, "tanh");             // gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
}

// Appends new (B, KV, T, hd) to a cached (B, KV, S, hd) (undefined before the first call) and returns it.
at::Tensor append(at::Tensor& cached, const at::Tensor& fresh) {
  cached = cached.defined() ? at::cat({cached, fresh}, 2) : fresh.contiguous();
  return cached;
}

// ---- Llama ----

struct LlamaAttentionImpl : torch::nn::Module {
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  DecoderConfig c;
  int64_t H, KV, hd;
  explicit LlamaAttentionImpl(const DecoderConfig& config) : c(config), H(config.n_heads), KV(config.n_kv_heads), hd(config.head_dim()) {
    auto opt = [&](int64_t i, int64_t o) { return torch::nn::LinearOptions(i, o).bias(c.attention_bias); };
    q_proj = register_module("q_proj", torch::nn::Linear(opt(c.dim, H * hd)));
    k_proj = register_module("k_proj", torch::nn::Linear(opt(c.dim, KV * hd)));
    v_proj = register_module("v_proj", torch::nn::Linear(opt(c.dim, KV * hd)));
    o_proj = register_module("o_proj", torch::nn::Linear(opt(H * hd, c.dim)));
  }
  // x: (B, T, d) at positions offset.. -> (B, T, d); with keys/values given, the new positions'
  // are appended to them (B, KV, S, hd) and attention runs over all of them.
  at::Tensor forward(const at::Tensor& x, int64_t offset = 0, at::Tensor* keys = nullptr, at::Tensor* values = nullptr) {
    const auto [cos, sin] = rotary_tables(offset, x.size(1), hd, c, x.options());
    return attend(x, cos, sin, at::Tensor(), keys, values);
  }
  // x: (B, T, d) with rotary tables cos, sin ((T, hd) or (B, T, hd)) and an optional attention mask
  // (attention.h) -> (B, T, d); keys and values as forward's
  at::Tensor attend(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask, at::Tensor* keys = nullptr,
                    at::Tensor* values = nullptr) {
    const int64_t B = x.size(0), T = x.size(1);
    const at::Tensor q = RotaryFn::apply(lin(q_proj, x).view({B, T, H, hd}), cos, sin)[0];  // (B, H, T, hd)
    at::Tensor k = RotaryFn::apply(lin(k_proj, x).view({B, T, KV, hd}), cos, sin)[0];       // (B, KV, T, hd)
    at::Tensor v = lin(v_proj, x).view({B, T, KV, hd}).transpose(1, 2);                     // (B, KV, T, hd)
    if (keys) {
      k = append(*keys, k);  // (B, KV, S, hd)
      v = append(*values, v);
    }
    const at::Tensor att = causal_attention(q, repeat_kv(k, H / KV), repeat_kv(v, H / KV), c.attention, mask);  // (B, H, T, hd)
    return lin(o_proj, att.transpose(1, 2).reshape({B, T, H * hd}));
  }
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
  std::string act;
  explicit LlamaMLPImpl(const DecoderConfig& c) : act(c.resolved_activation()) {
    auto opt = [&](int64_t i, int64_t o) { return torch::nn::LinearOptions(i, o).bias(c.mlp_bias); };
    gate_proj = register_module("gate_proj", torch::nn::Linear(opt(c.dim, c.ffn_dim)));
    up_proj = register_module("up_proj", torch::nn::Linear(opt(c.dim, c.ffn_dim)));
    down_proj = register_module("down_proj", torch::nn::Linear(opt(c.ffn_dim, c.dim)));
  }
  // x: (B, T, d) -> (B, T, d): down(act(gate(x)) * up(x)), SwiGLU for silu
  at::Tensor forward(const at::Tensor& x) {
    const at::Tensor gate = lin(gate_proj, x), up = lin(up_proj, x);
    // down_proj closes the block's residual branch: a checkpointed region that ends with this
    // block does not multiply it again in its recompute (checkpoint::tail_linear).
    const at::Tensor z = act != "silu" ? activate(gate, act) * up : SwiGLUFn::apply(gate, up)[0];
    return checkpoint::tail_linear(z, down_proj->weight, down_proj->bias);
  }
};
TORCH_MODULE(LlamaMLP);

struct LlamaDecoderLayerImpl : torch::nn::Module {
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  explicit LlamaDecoderLayerImpl(const DecoderConfig& c) {
    self_attn = register_module("self_attn", LlamaAttention(c));
    mlp = register_module("mlp", LlamaMLP(c));
    input_layernorm = register_module("input_layernorm", RMSNorm(c.dim, c.norm_eps));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.dim, c.norm_eps));
  }
  // x: (B, T, d) -> (B, T, d); the cache arguments as LlamaAttention's
  at::Tensor forward(const at::Tensor& x, int64_t offset = 0, at::Tensor* keys = nullptr, at::Tensor* values = nullptr) {
    const at::Tensor h = x + self_attn->forward(input_layernorm->forward(x), offset, keys, values);
    return h + mlp->forward(post_attention_layernorm->forward(h));
  }
  // x: (B, T, d) packed -> (B, T, d): the forward's shared rotary tables (B, T, hd) and mask
  at::Tensor forward_packed(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& mask) {
    const at::Tensor h = x + self_attn->attend(input_layernorm->forward(x), cos, sin, mask);
    return h + mlp->forward(post_attention_layernorm->forward(h));
  }
};
TORCH_MODULE(LlamaDecoderLayer);

struct LlamaModelImpl : torch::nn::Module {
  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers;
  RMSNorm norm{nullptr};
  std::vector<LlamaDecoderLayer> blocks;
  LlamaModelImpl(const DecoderConfig& c, c10::Device device) {
    embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.dim));
    embed_tokens->to(device);  // each piece goes to the device as it is made: the host holds one at most
    layers = register_module("layers", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layers; ++i) {
      blocks.emplace_back(c);
      blocks.back()->to(device);
      layers->push_back(blocks.back());
    }
    norm = register_module("norm", RMSNorm(c.dim, c.norm_eps));
    norm->to(device);
  }
};
TORCH_MODULE(LlamaModel);

// Hugging Face's initialisation (initializer_range 0.02) of every matrix; biases stay at zero.
void init_weights(torch::nn::Module& m) {
  at::NoGradGuard no_grad;
  for (auto& p : m.named_parameters()) {
    if (p.value().dim() >= 2) {
      p.value().normal_(0.0, 0.02);
    } else if (p.key().size() > 5 && p.key().compare(p.key().size() - 5, 5, ".bias") == 0) {
      p.value().zero_();
    }
  }
}

// Sizes the cache for n layers on first use; checks it has them.
void ready_cache(KVCache& cache, size_t n) {
  if (cache.keys.empty()) cache.keys.resize(n), cache.values.resize(n);
  TORCH_CHECK(cache.keys.size() == n && cache.values.size() == n, "KVCache holds ", cache.keys.size(), " layers, the model has ", n);
}

class LlamaForCausalLM : public DecoderImpl {
 public:
  LlamaForCausalLM(const DecoderConfig& c, c10::Device device, WeightInit init) : DecoderImpl(c) {
    model = register_module("model", LlamaModel(c, device));
    if (!c.tie_embeddings) {
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
      lm_head->to(device);
    }
    if (init == WeightInit::random) init_weights(*this);
  }
  at::Tensor embed(const at::Tensor& tokens) override { return model->embed_tokens->forward(tokens); }
  at::Tensor hidden_states(const at::Tensor& tokens, const at::Tensor& segments) override {
    if (!segments.defined()) return model->norm->forward(run_blocks(embed(tokens)));
    check_segments(tokens, segments);
    const at::Tensor x = embed(tokens);  // (B, T, d)
    // The layout every block reads, made once: rotary tables (B, T, hd) at the restarted
    // positions, and the mask in the form the kernel keeps least of (attention.h).
    const auto [cos, sin] = rotary_tables_at(segment_positions(segments), config_.head_dim(), config_);
    const at::Tensor mask = attention_mask_for(config_.attention, segment_attention_mask(segments), precision::compute_dtype_for(x));
    std::vector<checkpoint::UnaryFn> forwards;
    for (LlamaDecoderLayer b : model->blocks) {
      forwards.push_back([b, c = cos, s = sin, mask](const at::Tensor& h) mutable { return b->forward_packed(h, c, s, mask); });
    }
    return model->norm->forward(run_blocks(x, std::move(forwards)));
  }
  at::Tensor head_weight() override { return config_.tie_embeddings ? model->embed_tokens->weight : lm_head->weight; }
  std::vector<checkpoint::ChainBlock> chain() override { return checkpoint::make_chain(model->blocks); }

 protected:
  at::Tensor hidden_states_with_cache(const at::Tensor& tokens, KVCache& cache) override {
    ready_cache(cache, model->blocks.size());
    at::Tensor x = embed(tokens);  // (B, T, d)
    for (size_t i = 0; i < model->blocks.size(); ++i) {
      x = model->blocks[i]->forward(x, cache.length, &cache.keys[i], &cache.values[i]);
    }
    return model->norm->forward(x);
  }

 private:
  LlamaModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};
};

// ---- GPT-2 ----

struct GPT2AttentionImpl : torch::nn::Module {
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
  int64_t H;
  AttentionKernel kernel;
  explicit GPT2AttentionImpl(const DecoderConfig& c) : H(c.n_heads), kernel(c.attention) {
    c_attn = register_module("c_attn", torch::nn::Linear(c.dim, 3 * c.dim));
    c_proj = register_module("c_proj", torch::nn::Linear(c.dim, c.dim));
  }
  // x: (B, T, d) -> (B, T, d); with keys/values given, the new positions' are appended to them; an
  // optional attention mask (attention.h) replaces the causal triangle
  at::Tensor forward(const at::Tensor& x, at::Tensor* keys = nullptr, at::Tensor* values = nullptr, const at::Tensor& mask = {}) {
    const int64_t B = x.size(0), T = x.size(1), d = x.size(2);
    const at::Tensor parts = lin(c_attn, x).view({B, T, 3, H, d / H}).permute({2, 0, 3, 1, 4});  // (3, B, H, T, hd)
    at::Tensor k = parts[1], v = parts[2];
    if (keys) {
      k = append(*keys, k);  // (B, H, S, hd)
      v = append(*values, v);
    }
    const at::Tensor att = causal_attention(parts[0], k, v, kernel, mask);  // (B, H, T, hd)
    return lin(c_proj, att.transpose(1, 2).reshape({B, T, d}));
  }
};
TORCH_MODULE(GPT2Attention);

struct GPT2MLPImpl : torch::nn::Module {
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
  std::string act;
  explicit GPT2MLPImpl(const DecoderConfig& c) : act(c.resolved_activation()) {
    c_fc = register_module("c_fc", torch::nn::Linear(c.dim, c.ffn_dim));
    c_proj = register_module("c_proj", torch::nn::Linear(c.ffn_dim, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) {  // c_proj closes the residual branch (checkpoint::tail_linear)
    return checkpoint::tail_linear(activate(lin(c_fc, x), act), c_proj->weight, c_proj->bias);
  }
};
TORCH_MODULE(GPT2MLP);

struct GPT2BlockImpl : torch::nn::Module {
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  GPT2Attention attn{nullptr};
  GPT2MLP mlp{nullptr};
  explicit GPT2BlockImpl(const DecoderConfig& c) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim}).eps(c.norm_eps)));
    attn = register_module("attn", GPT2Attention(c));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim}).eps(c.norm_eps)));
    mlp = register_module("mlp", GPT2MLP(c));
  }
  at::Tensor forward(const at::Tensor& x, at::Tensor* keys = nullptr, at::Tensor* values = nullptr) {  // (B, T, d)
    const at::Tensor h = x + attn->forward(ln_1->forward(x), keys, values);
    return h + mlp->forward(ln_2->forward(h));
  }
  at::Tensor forward_packed(const at::Tensor& x, const at::Tensor& mask) {  // (B, T, d), the forward's shared mask
    const at::Tensor h = x + attn->forward(ln_1->forward(x), nullptr, nullptr, mask);
    return h + mlp->forward(ln_2->forward(h));
  }
};
TORCH_MODULE(GPT2Block);

struct GPT2ModelImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  torch::nn::ModuleList h;
  torch::nn::LayerNorm ln_f{nullptr};
  std::vector<GPT2Block> blocks;
  GPT2ModelImpl(const DecoderConfig& c, c10::Device device) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab_size, c.dim));
    wte->to(device);
    wpe = register_module("wpe", torch::nn::Embedding(c.max_seq_len, c.dim));
    wpe->to(device);
    h = register_module("h", torch::nn::ModuleList());
    for (int64_t i = 0; i < c.n_layers; ++i) {
      blocks.emplace_back(c);
      blocks.back()->to(device);
      h->push_back(blocks.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim}).eps(c.norm_eps)));
    ln_f->to(device);
  }
};
TORCH_MODULE(GPT2Model);

class GPT2LMHead : public DecoderImpl {
 public:
  GPT2LMHead(const DecoderConfig& c, c10::Device device, WeightInit init) : DecoderImpl(c) {
    transformer = register_module("transformer", GPT2Model(c, device));
    if (!c.tie_embeddings) {
      lm_head = register_module("lm_head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
      lm_head->to(device);
    }
    if (init == WeightInit::random) init_weights(*this);
  }
  at::Tensor embed(const at::Tensor& tokens) override { return embed_at(tokens, 0); }
  at::Tensor hidden_states(const at::Tensor& tokens, const at::Tensor& segments) override {
    if (!segments.defined()) return transformer->ln_f->forward(run_blocks(embed(tokens)));
    check_segments(tokens, segments);
    check_positions(tokens.size(1));
    // wpe at each token's restarted position (its (B, T) indices kept for wpe's backward); the
    // mask made once, in the form the kernel keeps least of (attention.h)
    const at::Tensor x = transformer->wte->forward(tokens) + transformer->wpe->forward(segment_positions(segments));
    const at::Tensor mask = attention_mask_for(config_.attention, segment_attention_mask(segments), precision::compute_dtype_for(x));
    std::vector<checkpoint::UnaryFn> forwards;
    for (GPT2Block b : transformer->blocks) {
      forwards.push_back([b, mask](const at::Tensor& h) mutable { return b->forward_packed(h, mask); });
    }
    return transformer->ln_f->forward(run_blocks(x, std::move(forwards)));
  }
  at::Tensor head_weight() override { return config_.tie_embeddings ? transformer->wte->weight : lm_head->weight; }
  std::vector<checkpoint::ChainBlock> chain() override { return checkpoint::make_chain(transformer->blocks); }

 protected:
  at::Tensor hidden_states_with_cache(const at::Tensor& tokens, KVCache& cache) override {
    ready_cache(cache, transformer->blocks.size());
    at::Tensor x = embed_at(tokens, cache.length);  // (B, T, d)
    for (size_t i = 0; i < transformer->blocks.size(); ++i) x = transformer->blocks[i]->forward(x, &cache.keys[i], &cache.values[i]);
    return transformer->ln_f->forward(x);
  }

 private:
  // positions up to end - 1 exist (wpe has max_seq_len rows)
  void check_positions(int64_t end) const {
    TORCH_CHECK(end <= config_.max_seq_len, "gpt2: position ", end - 1, " is past max_seq_len ", config_.max_seq_len, " (n_positions)");
  }
  // tokens: (B, T) at positions offset.. -> (B, T, d)
  at::Tensor embed_at(const at::Tensor& tokens, int64_t offset) {
    const int64_t T = tokens.size(1);
    check_positions(offset + T);
    const at::Tensor pos = at::arange(offset, offset + T, tokens.options());
    return transformer->wte->forward(tokens) + transformer->wpe->forward(pos);
  }
  GPT2Model transformer{nullptr};
  torch::nn::Linear lm_head{nullptr};
};

}  // namespace

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) { weight = register_parameter("weight", at::ones({dim})); }

at::Tensor RMSNormImpl::forward(const at::Tensor& x) { return RMSNormFn::apply(x, weight, eps_)[0]; }

at::Tensor rotary_inv_freq(int64_t hd, double theta, const RopeScaling& r, int64_t max_seq_len, int64_t end,
                           const at::TensorOptions& options) {
  const auto f32 = options.dtype(at::kFloat);
  const at::Tensor inv_freq = at::pow(theta, at::arange(0, hd, 2, f32) / static_cast<double>(hd)).reciprocal();  // (hd/2)
  if (r.type == "default") return inv_freq;
  if (r.type == "linear") return inv_freq / r.factor;
  if (r.type == "dynamic") {
    const int64_t limit = r.original_max_position_embeddings > 0 ? r.original_max_position_embeddings : max_seq_len;
    if (end > limit) {
      throw std::invalid_argument("rope_type dynamic: position " + std::to_string(end - 1) + " is past max_position_embeddings " +
                                  std::to_string(limit) + "; frugal runs dynamic NTK scaling only within it");
    }
    return inv_freq;
  }
  TORCH_CHECK(r.type == "llama3", "rotary_inv_freq: unknown rope type ", r.type);
  // Wavelengths (2 pi / inv_freq) longer than orig / low_freq_factor are slowed by factor, shorter
  // than orig / high_freq_factor kept; between them a blend s * inv + (1 - s) * inv / factor with
  // s = (orig / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor).
  const double orig = static_cast<double>(r.original_max_position_embeddings);
  const at::Tensor wavelength = (2 * M_PI) / inv_freq;
  const at::Tensor s = (orig / wavelength - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor blended = (1 - s) * inv_freq / r.factor + s * inv_freq;
  const at::Tensor low = wavelength > orig / r.low_freq_factor, high = wavelength < orig / r.high_freq_factor;
  return at::where(low, inv_freq / r.factor, at::where(high, inv_freq, blended));
}

std::pair<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, double theta) {
  DecoderConfig c;
  c.rope_theta = theta;
  const auto [cos, sin] = rotary_tables(0, q.size(2), q.size(3), c, q.options());
  return {RotaryFn::apply(q.transpose(1, 2), cos, sin)[0], RotaryFn::apply(k.transpose(1, 2), cos, sin)[0]};
}

void DecoderImpl::set_checkpointing(const checkpoint::CheckpointPolicy& policy) {
  policy_ = policy;
  plan_.reset();
}

void DecoderImpl::set_plan(const checkpoint::ActivationPlan& plan) { plan_ = plan; }

at::Tensor DecoderImpl::run_blocks(const at::Tensor& x) {
  if (chain_.empty()) chain_ = chain();
  return plan_ ? checkpoint::run_plan(chain_, x, *plan_) : checkpoint::run_chain(chain_, x, policy_);
}

at::Tensor DecoderImpl::run_blocks(const at::Tensor& x, std::vector<checkpoint::UnaryFn> forwards) {
  if (chain_.empty()) chain_ = chain();
  TORCH_CHECK(forwards.size() == chain_.size(), "run_blocks: ", forwards.size(), " forwards for ", chain_.size(), " blocks");
  // This call's chain: the closures go into the checkpointed regions, which keep them until their
  // backward, so a later forward (another layout) cannot change what a recompute reads.
  std::vector<checkpoint::ChainBlock> chain = chain_;
  for (size_t i = 0; i < chain.size(); ++i) chain[i].forward = std::move(forwards[i]);
  return plan_ ? checkpoint::run_plan(chain, x, *plan_) : checkpoint::run_chain(chain, x, policy_);
}

void DecoderImpl::check_segments(const at::Tensor& tokens, const at::Tensor& segments) {
  TORCH_CHECK(segments.sizes() == tokens.sizes(), "segments must have the tokens' shape ", tokens.sizes(), ", got ", segments.sizes());
  TORCH_CHECK(segments.scalar_type() == at::kLong, "segments must be int64, got ", segments.scalar_type());
  TORCH_CHECK(segments.device() == tokens.device(), "segments must be on the tokens' device ", tokens.device(), ", got ",
              segments.device());
}

at::Tensor segment_positions(const at::Tensor& segments) {
  TORCH_CHECK(segments.dim() == 2 && !at::isFloatingType(segments.scalar_type()) && segments.scalar_type() != at::kBool,
              "segment_positions: segments must be (B, T) integers, got ", segments.sizes(), " ", segments.scalar_type());
  const int64_t B = segments.size(0), T = segments.size(1);
  const auto i64 = segments.options().dtype(at::kLong);
  // index (B, T): each token's index; a run's first token is where its value differs from the
  // previous one's; the running maximum of those first indices is each token's run start
  const at::Tensor index = at::arange(T, i64).expand({B, T});
  at::Tensor starts = at::ones({B, T}, i64.dtype(at::kBool));
  if (T > 1) {
    at::Tensor later = starts.narrow(1, 1, T - 1);
    at::ne_out(later, segments.narrow(1, 1, T - 1), segments.narrow(1, 0, T - 1));
  }
  const at::Tensor run_start = std::get<0>(at::cummax(at::where(starts, index, 0), 1));
  return index - run_start;  // (B, T)
}

at::Tensor DecoderImpl::logits(const at::Tensor& tokens, const at::Tensor& segments) {
  return at::linear(hidden_states(tokens, segments), head_weight());  // (B, T, V)
}

at::Tensor DecoderImpl::logits_with_cache(const at::Tensor& tokens, KVCache& cache) {
  TORCH_CHECK(tokens.dim() == 2, "logits_with_cache: tokens must be (B, T), got ", tokens.sizes());
  at::NoGradGuard no_grad;
  const at::Tensor h = hidden_states_with_cache(tokens, cache);  // (B, T, d)
  cache.length += tokens.size(1);
  return at::linear(h, head_weight()).to(at::kFloat);  // (B, T, V)
}

at::Tensor DecoderImpl::loss(const at::Tensor& tokens, const at::Tensor& targets, const LossOptions& options, const at::Tensor& segments) {
  const at::Tensor h = hidden_states(tokens, segments);  // (B, T, d)
  const auto loss_options = loss::ChunkedCrossEntropyOptions()
                                .chunk_size(options.chunk_size())
                                .ignore_index(options.ignore_index())
                                .reduction(options.reduction());
  if (options.chunked()) return loss::chunked_cross_entropy(h, head_weight(), at::Tensor(), targets, loss_options);
  return loss::linear_cross_entropy(h, head_weight(), at::Tensor(), targets, loss_options);
}

namespace {

// Makes tensors created without a dtype (every module's parameters) take `dtype` until destroyed.
class DefaultDtypeGuard {
 public:
  explicit DefaultDtypeGuard(at::ScalarType dtype) : previous_(c10::get_default_dtype()) {
    c10::set_default_dtype(c10::scalarTypeToTypeMeta(dtype));
  }
  ~DefaultDtypeGuard() { c10::set_default_dtype(previous_); }
  DefaultDtypeGuard(const DefaultDtypeGuard&) = delete;
  DefaultDtypeGuard& operator=(const DefaultDtypeGuard&) = delete;

 private:
  caffe2::TypeMeta previous_;
};

}  // namespace

Decoder make_decoder(const DecoderConfig& config, const at::TensorOptions& options, WeightInit init) {
  const std::string invalid = config.validate();
  if (!invalid.empty()) throw std::invalid_argument("model config: " + invalid);
  const at::ScalarType dtype = options.has_dtype() ? c10::typeMetaToScalarType(options.dtype()) : at::kFloat;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "make_decoder: parameters must be fp32, bf16 or fp16, got ", dtype);
  // Every parameter is made in its dtype and moved to the device block by block: no fp32 copy of
  // the model, and no host copy of a GPU model, ever exists.
  DefaultDtypeGuard in_dtype(dtype);
  const c10::Device device = options.device();
  if (config.arch == "gpt2") return std::make_shared<GPT2LMHead>(config, device, init);
  return std::make_shared<LlamaForCausalLM>(config, device, init);
}

}  // namespace models
}  // namespace frugal
