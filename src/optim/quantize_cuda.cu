// The fused 8- and 4-bit Adam(W) step on CUDA (quantize.h: adam_step_quantized_cuda), in
// libfrugal_cuda.so (memory/cuda_runtime.h); quantize_cuda_forward.cpp calls it with the code tables.
//
// One thread block per quantization block, one thread per value: decode m and v (map value times
// the block's scale), update them and the parameter, take the block's new scales (max |m|, max |v|
// over the block, a shared-memory reduction), normalise, encode with the CPU kernel's table and
// tie-breaking, write codes and parameter. The arithmetic is update_block_portable's in
// quantize.cpp, operation for operation; this file is compiled with --fmad=false and uses the
// IEEE-rounded division and square root intrinsics, so the results are the CPU kernel's bits.
#include "frugal/optim/quantize.h"

#include "adam_scalars.h"
#include "rounding_noise.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <chrono>
#include <cmath>
#include <cstring>

namespace frugal {
namespace optim {
namespace {

// The step's constants, in fp32 as the CPU kernel takes them.
struct StepConstants {
  float b1, b2, one_b1, one_b2, eps, wd, decay, sqrt_bc2, step;
  bool decoupled, stochastic;
  uint32_t seed_lo, seed_hi;
};

// One moment's codes and scales for the blocks of the launch (codes of its first block at codes[0]).
struct MomentView {
  uint8_t* codes;
  float* absmax;
  const float* map;
  const uint8_t* lut;
  const float* boundaries;  // the midpoints, then +inf
};

__device__ __forceinline__ float load_value(const float* x, int64_t i) { return x[i]; }
__device__ __forceinline__ float load_value(const uint16_t* x, int64_t i) { return __uint_as_float(static_cast<uint32_t>(x[i]) << 16); }

// quantize.cpp's narrow_bf16_body for one value at parameter index `index`.
__device__ __forceinline__ uint16_t narrow_bf16(float x, bool stochastic, uint32_t s0, uint32_t s1, uint64_t index) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t noise = stochastic ? rounding_noise(s0, s1, index) : 0x7FFFu + ((bits >> 16) & 1u);
  const bool special = (bits & 0x7F800000u) == 0x7F800000u;
  const uint32_t quiet = (bits & 0x007FFFFFu) != 0 ? 0x40u : 0u;
  return static_cast<uint16_t>(special ? (bits >> 16) | quiet : (bits + noise) >> 16);
}

__device__ __forceinline__ void store_value(float* p, int64_t i, float x, const StepConstants&, uint64_t) { p[i] = x; }
__device__ __forceinline__ void store_value(uint16_t* p, int64_t i, float x, const StepConstants& s, uint64_t index) {
  p[i] = narrow_bf16(x, s.stochastic, s.seed_lo, s.seed_hi, index);
}

// The largest of every thread's x in the block (x >= 0; a NaN x never wins, as on the CPU).
__device__ __forceinline__ float block_max(float x, float* scratch) {
  for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  const int warp = threadIdx.x / 32, warps = blockDim.x / 32;
  if (threadIdx.x % 32 == 0) scratch[warp] = x;
  __syncthreads();
  float m = 0.0f;
  for (int w = 0; w < warps; ++w) m = fmaxf(m, scratch[w]);
  __syncthreads();  // scratch is reused by the next reduction
  return m;
}

__device__ __forceinline__ uint8_t nearest_code(float x, const uint8_t* lut, const float* boundaries) {
  const int code = lut[__float_as_uint(x) >> 15];
  return static_cast<uint8_t>(code + (boundaries[code] < x));
}

template <int Bits>
__device__ __forceinline__ int read_code(const uint8_t* codes, int j) {
  if (Bits == 8) return codes[j];
  const uint8_t packed = codes[j / 2];
  return j % 2 == 0 ? packed & 15 : packed >> 4;
}

// Writes thread j's code; for 4 bits the even thread of each pair writes both nibbles.
template <int Bits>
__device__ __forceinline__ void write_code(uint8_t* codes, int j, uint8_t code) {
  if (Bits == 8) {
    codes[j] = code;
    return;
  }
  const uint8_t next = static_cast<uint8_t>(__shfl_down_sync(0xffffffffu, code, 1));
  if (j % 2 == 0) codes[j / 2] = static_cast<uint8_t>(code | (next << 4));
}

// Grid: one block per quantization block of the range; blockDim.x = the block's length.
//   p, g: the range's elements (element 0 is the parameter's element `begin`)
//   first_block: the range's first block in the parameter; end: the range's end in the parameter
template <int Bits, typename P, typename G>
__global__ void adam_quantized_kernel(StepConstants s, P* p, const G* g, MomentView mv, MomentView vv, int64_t begin, int64_t end,
                                      int64_t first_block) {
  __shared__ float scratch[8];
  const int block = blockDim.x, j = threadIdx.x;
  const int64_t local_block = blockIdx.x, b = first_block + local_block;
  const int64_t index = b * block + j;  // in the parameter
  const bool live = index < end;        // else the short last block's padding
  const int64_t code_offset = Bits == 8 ? local_block * block : local_block * block / 2;
  uint8_t* mcodes = mv.codes + code_offset;
  uint8_t* vcodes = vv.codes + code_offset;
  float mj = 0.0f, vj = 0.0f;
  if (live) {
    const float am = mv.absmax[local_block], av = vv.absmax[local_block];
    const float m0 = mv.map[read_code<Bits>(mcodes, j)], v0 = vv.map[read_code<Bits>(vcodes, j)];
    const int64_t i = index - begin;
    const float pi = load_value(p, i), gi = load_value(g, i);
    // AdamW multiplies the parameter by its decay; Adam adds wd * p to the gradient
    const float pj = s.decoupled ? __fmul_rn(pi, s.decay) : pi;
    const float gj = s.decoupled || s.wd == 0 ? gi : __fadd_rn(gi, __fmul_rn(s.wd, pi));
    mj = __fadd_rn(__fmul_rn(__fmul_rn(m0, am), s.b1), __fmul_rn(s.one_b1, gj));
    vj = __fadd_rn(__fmul_rn(__fmul_rn(v0, av), s.b2), __fmul_rn(__fmul_rn(s.one_b2, gj), gj));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vj), s.sqrt_bc2), s.eps);
    store_value(p, i, __fadd_rn(pj, __fmul_rn(s.step, __fdiv_rn(mj, denom))), s, static_cast<uint64_t>(index));
  }
  __syncthreads();  // every thread has read the old scales
  const float max_m = block_max(fabsf(mj), scratch), max_v = block_max(fabsf(vj), scratch);
  if (j == 0) {
    mv.absmax[local_block] = max_m;
    vv.absmax[local_block] = max_v;
  }
  const float inv_m = __fdiv_rn(1.0f, fmaxf(max_m, 1e-30f)), inv_v = __fdiv_rn(1.0f, fmaxf(max_v, 1e-30f));
  // a NaN (from a NaN gradient) becomes the lower bound, as on the CPU
  const float xm = __fmul_rn(mj, inv_m), xv = __fmul_rn(vj, inv_v);
  const float cm = xm > -1.0f ? xm : -1.0f, cv = xv > 0.0f ? xv : 0.0f;
  const float nm = cm < 1.0f ? cm : 1.0f, nv = cv < 1.0f ? cv : 1.0f;
  __syncthreads();  // every thread has read its old codes (4 bits: a byte holds two threads' codes)
  write_code<Bits>(mcodes, j, nearest_code(nm, mv.lut, mv.boundaries));
  write_code<Bits>(vcodes, j, nearest_code(nv, vv.lut, vv.boundaries));
}

MomentView view_of(const at::Tensor& codes, const at::Tensor& absmax, const CodeTables& t) {
  return {codes.data_ptr<uint8_t>(), absmax.data_ptr<float>(), t.map.data_ptr<float>(), t.lut.data_ptr<uint8_t>(),
          t.lut_boundaries.data_ptr<float>()};
}

template <int Bits, typename P, typename G>
void launch(const StepConstants& s, P* p, const G* g, const MomentView& m, const MomentView& v, int64_t begin, int64_t end, int64_t block) {
  const int64_t first = begin / block, blocks = (end + block - 1) / block - first;
  if (blocks == 0) return;
  adam_quantized_kernel<Bits, P, G><<<static_cast<unsigned>(blocks), static_cast<unsigned>(block), 0, at::cuda::getCurrentCUDAStream()>>>(
      s, p, g, m, v, begin, end, first);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int Bits>
void launch_typed(const StepConstants& s, const at::Tensor& p, const at::Tensor& g, const MomentView& m, const MomentView& v, int64_t begin,
                  int64_t end, int64_t block) {
  const bool p16 = p.scalar_type() == at::kBFloat16, g16 = g.scalar_type() == at::kBFloat16;
  auto* pf = p16 ? nullptr : p.data_ptr<float>();
  auto* pb = p16 ? reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>()) : nullptr;
  const auto* gf = g16 ? nullptr : g.data_ptr<float>();
  const auto* gb = g16 ? reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>()) : nullptr;
  if (!p16 && !g16) launch<Bits>(s, pf, gf, m, v, begin, end, block);
  if (!p16 && g16) launch<Bits>(s, pf, gb, m, v, begin, end, block);
  if (p16 && !g16) launch<Bits>(s, pb, gf, m, v, begin, end, block);
  if (p16 && g16) launch<Bits>(s, pb, gb, m, v, begin, end, block);
}

double adam_step(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, QuantizedBuffer& m, QuantizedBuffer& v, int64_t begin,
                 int64_t end, const Bf16Rounding& rounding, const CodeTables& mt, const CodeTables& vt) {
  auto check = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.is_cuda() && t.device() == p.device() && t.is_contiguous() && t.numel() == end - begin &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "adam_step_quantized_cuda: the ", what, " must be a contiguous fp32 or bf16 tensor of ", end - begin,
                " elements on the parameter's CUDA device");
  };
  check(p, "parameter");
  check(g, "gradient");
  const int64_t block = m.block();
  TORCH_CHECK(m.bits() == v.bits() && block == v.block() && m.codes().device() == v.codes().device(),
              "adam_step_quantized_cuda: mismatched state");
  TORCH_CHECK(block >= 32 && block <= 256 && block % 32 == 0, "adam_step_quantized_cuda: blocks of 32 to 256 values, a multiple of 32");
  TORCH_CHECK(begin % block == 0 && begin <= end && end <= m.numel() && (end == m.numel() || end % block == 0),
              "adam_step_quantized_cuda: the range must start on a block and end on a block or at the end");
  const c10::cuda::CUDAGuard guard(p.device());
  StepConstants s;
  set_adam_scalars(h, s);
  s.stochastic = rounding.stochastic;
  s.seed_lo = static_cast<uint32_t>(rounding.seed);
  s.seed_hi = static_cast<uint32_t>(rounding.seed >> 32);
  // The range's codes and scales, as views of the state or as copies on the device.
  const int64_t b0 = begin / block, blocks = (end + block - 1) / block - b0;
  const int64_t code_bytes = m.bits() == 8 ? block : block / 2;
  auto codes_of = [&](QuantizedBuffer& q) { return q.codes().narrow(0, b0 * code_bytes, blocks * code_bytes); };
  auto scales_of = [&](QuantizedBuffer& q) { return q.absmax().narrow(0, b0, blocks); };
  const bool on_device = m.codes().device() == p.device();
  double moved = 0;
  at::Tensor mc = codes_of(m), ma = scales_of(m), vc = codes_of(v), va = scales_of(v);
  if (!on_device) {
    const auto t0 = std::chrono::steady_clock::now();
    mc = mc.to(p.device());
    ma = ma.to(p.device());
    vc = vc.to(p.device());
    va = va.to(p.device());
    moved += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  TORCH_CHECK(m.is_signed() && !v.is_signed(), "adam_step_quantized_cuda: m must be signed and v unsigned");
  const MomentView mview = view_of(mc, ma, mt), vview = view_of(vc, va, vt);
  if (m.bits() == 8) {
    launch_typed<8>(s, p, g, mview, vview, begin, end, block);
  } else {
    launch_typed<4>(s, p, g, mview, vview, begin, end, block);
  }
  if (!on_device) {  // back to host memory or the mapped file (copies to pageable memory wait for the kernel)
    const auto t0 = std::chrono::steady_clock::now();
    codes_of(m).copy_(mc);
    scales_of(m).copy_(ma);
    codes_of(v).copy_(vc);
    scales_of(v).copy_(va);
    moved += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return moved;
}

}  // namespace
}  // namespace optim
}  // namespace frugal

extern "C" __attribute__((visibility("default"))) double frugal_cuda_adam_step_quantized(
    const frugal::optim::AdamStep& h, const at::Tensor& p, const at::Tensor& g, frugal::optim::QuantizedBuffer& m,
    frugal::optim::QuantizedBuffer& v, int64_t begin, int64_t end, const frugal::optim::Bf16Rounding& rounding,
    const frugal::optim::CodeTables& mt, const frugal::optim::CodeTables& vt) {
  return frugal::optim::adam_step(h, p, g, m, v, begin, end, rounding, mt, vt);
}
