// frugal/optim/quantize.h — blockwise quantization of optimizer state with dynamic code maps.
//
// A block of `block` values is scaled by its largest magnitude (one fp32 absmax per block) into
// [-1, 1] (signed, first moments) or [0, 1] (unsigned, second moments) and each value becomes the
// index of the nearest entry of a non-linear code map: dense near zero, sparse near one, in the
// spirit of Dettmers et al.'s dynamic quantization. 8-bit codes take a byte each; 4-bit codes
// are packed two to a byte. store() and load() work whole ranges of blocks with ATen operations;
// the AdamW step on quantized state is one fused pass per range on the CPU (portable, AVX2 and
// AVX-512 paths, bit-identical) and a CUDA kernel on the GPU, declared at the end of this file.
//
//   auto map = frugal::optim::dynamic_code_map(/*is_signed=*/true, /*bits=*/8);
//   frugal::optim::QuantizedBuffer q(x.numel(), 8, 256, true);
//   q.store(0, x.numel(), x.flatten());              // quantize
//   at::Tensor back = q.load(0, x.numel());          // dequantize (fp32)
#pragma once

#include <ATen/ATen.h>

#include <functional>

#include <memory>

#include <cstdint>

#include "frugal/optim/cpu_kernel.h"

namespace frugal {
namespace optim {

// 2^bits values, sorted ascending, fp32: signed maps span [-1, 1] and hold 0; unsigned span [0, 1].
at::Tensor dynamic_code_map(bool is_signed, int bits);
// Bytes of the tables one (signedness, bits) code map shares across every buffer on a device: the
// map, its midpoints, the 2^17-entry encode table, the midpoints with +inf, and for 8-bit maps the
// AVX2 path's encode table (tagged 'other').
int64_t code_table_bytes(int bits);
// Makes the tables now (if no buffer holds them yet) and keeps them alive with the handle: an
// optimizer builds them at construction, so no training step pays their transient work.
std::shared_ptr<const void> retain_code_tables(bool is_signed, int bits, at::Device device);
// The tables of one (signedness, bits) code map on one device, as every buffer there shares them:
// the map, its midpoints, the encode table and the midpoints with +inf (see QuantizedBuffer::lut).
struct CodeTables {
  at::Tensor map, boundaries, lut, lut_boundaries;
  at::Tensor encode;  // 8-bit maps: see QuantizedBuffer::encode_table (undefined for 4-bit)
};
std::shared_ptr<const CodeTables> code_tables(bool is_signed, int bits, at::Device device);

// A vector of values stored as blockwise-quantized codes (8 or 4 bits) with one fp32 absmax per block.
class QuantizedBuffer {
 public:
  QuantizedBuffer() = default;
  // numel values in blocks of `block` (the last may be short), bits 8 or 4; zeros.
  QuantizedBuffer(int64_t numel, int bits, int64_t block, bool is_signed, at::Device device = at::kCPU);
  // The same with the codes in storage that make_codes(bytes, zero) returns: uint8, `bytes` of
  // them, each already `zero` (the code byte of two zeros, or of one at 8 bits), e.g. a file's.
  QuantizedBuffer(int64_t numel, int bits, int64_t block, bool is_signed, at::Device device,
                  const std::function<at::Tensor(int64_t bytes, uint8_t zero)>& make_codes);

  // Values [begin, end) as fp32 on the buffer's device; begin must be a multiple of the block.
  at::Tensor load(int64_t begin, int64_t end) const;
  // Quantizes values (fp32, end - begin of them) into [begin, end); begin block-aligned.
  void store(int64_t begin, int64_t end, const at::Tensor& values);

  // The number of values.
  int64_t numel() const { return numel_; }
  // Bits per code: 8 or 4.
  int bits() const { return bits_; }
  // Values per block (one absmax each).
  int64_t block() const { return block_; }
  // Whether the code map spans [-1, 1] (true) or [0, 1].
  bool is_signed() const { return signed_; }
  int64_t bytes() const;  // codes + scales
  // The codes, uint8: one per value (8-bit) or per two (4-bit).
  const at::Tensor& codes() const { return codes_; }
  // The scales, fp32, one per block.
  const at::Tensor& absmax() const { return absmax_; }
  // Replaces codes and scales (a saved state); checks their sizes.
  void assign(const at::Tensor& codes, const at::Tensor& absmax);

  // For the fused CPU kernels: the code of the map entry nearest a value x (already divided by its
  // block's absmax), exactly as at::searchsorted over the midpoints gives it, is
  //   c = lut()[bits(x) >> 15];  c + (lut_boundary_data()[c] < x)
  // (the table holds the code of the lowest value of each cell of fp32 values sharing their top 17
  // bits; no cell holds two midpoints). lut_boundary_data(): the midpoints, then +inf.
  const uint8_t* lut() const { return lut_.data_ptr<uint8_t>(); }
  // The midpoints between the map's entries, then +inf (levels() floats).
  const float* lut_boundary_data() const { return lut_boundaries_.data_ptr<float>(); }
  // 8-bit maps: the same search in one look-up, e = encode_table()[bits(x) >> 15] (int32), then
  //   t = bits(x) & 0x7fff, flipped (^ 0x7fff) where x is negative;  (e & 255) + (t > (e >> 8))
  // (the cell's code, and the threshold past which its midpoint is exceeded; 0x7fff where the cell
  // holds no midpoint). Null for 4-bit maps.
  const int32_t* encode_table() const { return encode_table_.defined() ? encode_table_.data_ptr<int32_t>() : nullptr; }
  // The code map's values, ascending (levels() floats).
  const float* map_data() const { return map_.data_ptr<float>(); }
  // The number of entries of the code map: 2^bits.
  int64_t levels() const { return map_.numel(); }

 private:
  int64_t numel_ = 0, block_ = 256;
  int bits_ = 8;
  bool signed_ = true;
  at::Tensor map_, boundaries_;  // the code map and the midpoints between its entries
  at::Tensor lut_;               // uint8 (131072), on the buffer's device: see lut()
  at::Tensor lut_boundaries_;    // fp32 (levels), on the buffer's device: the midpoints, then +inf
  at::Tensor encode_table_;      // int32 (131072), 8-bit maps only: see encode_table()
  at::Tensor codes_, absmax_;
  std::shared_ptr<const void> tables_;  // keeps the shared tables alive while this buffer is
};

}  // namespace optim
}  // namespace frugal

namespace frugal {
namespace optim {

// The scalars of one Adam(W) step; bias_correction1/2 are 1 - beta1^t and 1 - beta2^t at step t.
struct AdamStep {
  double lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2;
  bool decoupled;  // AdamW
};

// Which code runs the fused CPU step (cpu_kernel.h). automatic: AVX-512 (F, BW and VBMI: Intel since
// Ice Lake, AMD since Zen 4) where the processor has it, else AVX2, else a portable loop the compiler
// vectorises for the build's target. All do the same fp32 operations in the same order
// and find the same codes, so they give identical bits. A path the processor lacks is refused.
// Blocks a vector path does not take go down a path: AVX-512 takes blocks of a multiple of 64
// values, AVX2 of 32, and a short last block is the portable loop's.
using QuantKernel = CpuKernel;  // cpu_kernel.h: the paths and FRUGAL_CPU_KERNELS
inline const char* quant_kernel_name(QuantKernel k) { return cpu_kernel_name(k); }
bool quant_kernel_supported(QuantKernel k);  // whether this processor can run that path
QuantKernel quant_kernel_chosen();           // what automatic runs here
bool quant_kernel_vectorized();              // whether that is AVX2 or AVX-512

// One Adam(W) step over elements [begin, end) of a CPU parameter whose moments are quantized, fused:
// per block, dequantize, update the moments and the parameter, requantize. begin is block-aligned;
// end is too, or the end of the buffer. p and g: fp32, contiguous, end - begin elements. Threads over
// blocks with at::parallel_for.
void adam_step_quantized_cpu(const AdamStep& h, float* p, const float* g, QuantizedBuffer& m, QuantizedBuffer& v, int64_t begin,
                             int64_t end, QuantKernel kernel = QuantKernel::automatic);

// How a bf16 parameter's updated fp32 value goes back to bf16: to nearest (ties to even, as
// at::Tensor::to does), or stochastically: up with probability equal to the distance from the
// lower neighbour, the noise a hash of `seed` and the element's index in the parameter, so the
// bits do not depend on the chunking or the number of threads.
struct Bf16Rounding {
  bool stochastic = false;
  uint64_t seed = 0;
  // The index in its parameter of the first element a dense step is given: a step taken a chunk at
  // a time draws the noise the whole parameter's step would.
  int64_t first_index = 0;
};

// The same step for a parameter and gradient of fp32 or bf16 (contiguous CPU tensors of end - begin
// elements, the parameter's elements [begin, end)): each block is widened to fp32 in registers,
// updated, and a bf16 parameter rounded back per `rounding`. No temporary tensor is made.
// m_codes/v_codes, when given, hold the codes of [begin, end) in place of m's and v's (begin's code
// first: file placement's window buffers); the scales stay m's and v's.
void adam_step_quantized_cpu(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, QuantizedBuffer& m, QuantizedBuffer& v,
                             int64_t begin, int64_t end, const Bf16Rounding& rounding, QuantKernel kernel = QuantKernel::automatic,
                             uint8_t* m_codes = nullptr, uint8_t* v_codes = nullptr);

// Whether the CUDA kernel below is in this process: frugal's CUDA module (libfrugal_cuda.so, built
// against a CUDA build of LibTorch) is loaded (memory/cuda_runtime.h); the call is refused otherwise.
bool cuda_kernels_built();

// The same step on a CUDA parameter (p, g: contiguous fp32 or bf16 CUDA tensors of end - begin
// elements), one CUDA thread block per quantization block (blocks of 32 to 256 values, a multiple
// of 32). It gives the CPU kernel's bits: the same fp32 operations in the same order, compiled
// without contraction into fused multiply-adds and with IEEE division and square root, the same
// code tables and tie-breaking, the same bf16 rounding and noise. State on p's device is updated
// in place; state elsewhere (host memory, mapped files) has the range's codes and scales copied to
// the device, updated there and copied back, so only codes cross the bus, never fp32 moments.
// Returns the seconds spent on those copies (0 for state on the device).
double adam_step_quantized_cuda(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, QuantizedBuffer& m, QuantizedBuffer& v,
                                int64_t begin, int64_t end, const Bf16Rounding& rounding);

}  // namespace optim
}  // namespace frugal
