// The fused 8- and 4-bit Adam(W) step's CPU paths (src/optim/quantize_kernel.h): each path this
// processor has (portable, AVX2, AVX-512) forced in turn against the portable one, bit for bit in
// codes, scales and parameters (a NaN's payload aside), over maps, dtypes, rounding, block sizes,
// sizes that end in a short block, NaN and infinite gradients; and values exactly on the code maps' midpoints, where every
// path must give searchsorted's code.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "frugal/optim/quantize.h"
#include "optim/quantize_kernel.h"

using namespace frugal::optim;

namespace {

std::vector<QuantKernel> available_paths() {
  std::vector<QuantKernel> out;
  for (QuantKernel k : {QuantKernel::portable, QuantKernel::avx2, QuantKernel::avx512}) {
    if (quant_kernel_supported(k)) out.push_back(k);
  }
  return out;
}

// Whether two fp32 or bf16 tensors hold the same bits (signed zeros included), NaN where the other
// has NaN. Not the NaNs' payloads: where both operands of an addition or multiplication are NaN
// the result is one of them, and which depends on the operand order the compiler picks for a
// commutative operation; the paths agree up to that.
bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  const auto type = a.scalar_type() == at::kFloat ? at::kInt : at::kShort;
  const at::Tensor nan = a.isnan();
  return at::equal(nan, b.isnan()) && at::equal(a.view(type).masked_fill(nan, 0), b.view(type).masked_fill(nan, 0));
}

// Moments spanning several decades relative to their block's largest, and some all-zero blocks.
at::Tensor spread(int64_t n, double scale, bool positive) {
  at::Tensor x = (positive ? at::rand({n}) : at::randn({n})) * scale * at::pow(10.0, -at::randint(0, 7, {n}).to(at::kFloat));
  for (int64_t z = 300; z < n; z += 5000) x.narrow(0, z, std::min<int64_t>(256, n - z)).zero_();
  return x;
}

struct StepResult {
  at::Tensor p, m_codes, m_absmax, v_codes, v_absmax;
};

}  // namespace

TEST(QuantKernel, NamesAndChoice) {
  EXPECT_STREQ(quant_kernel_name(QuantKernel::portable), "portable");
  EXPECT_STREQ(quant_kernel_name(QuantKernel::avx2), "avx2");
  EXPECT_STREQ(quant_kernel_name(QuantKernel::avx512), "avx512");
  EXPECT_TRUE(quant_kernel_supported(QuantKernel::portable));
  EXPECT_TRUE(quant_kernel_supported(quant_kernel_chosen()));
  EXPECT_EQ(quant_kernel_vectorized(), quant_kernel_chosen() != QuantKernel::portable);
  // AVX-512 implies AVX2 here; automatic takes the widest unless FRUGAL_CPU_KERNELS says otherwise
  if (quant_kernel_supported(QuantKernel::avx512)) {
    EXPECT_TRUE(quant_kernel_supported(QuantKernel::avx2));
  }
  const char* env = std::getenv("FRUGAL_CPU_KERNELS");
  if (!env) {
    const QuantKernel widest = quant_kernel_supported(QuantKernel::avx512) ? QuantKernel::avx512
                               : quant_kernel_supported(QuantKernel::avx2) ? QuantKernel::avx2
                                                                           : QuantKernel::portable;
    EXPECT_EQ(quant_kernel_chosen(), widest);
  }
  // every 8- and 4-bit map fits the AVX-512 path's register tables
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) {
      const QuantizedBuffer q(1, bits, bits == 8 ? 256 : 128, is_signed);
      EXPECT_NE(avx512_code_tables(q.map_data(), q.lut_boundary_data(), bits, is_signed), nullptr) << bits << " " << is_signed;
    }
  }
}

TEST(QuantKernel, EveryPathGivesThePortableBits) {
  const std::vector<QuantKernel> paths = available_paths();
  if (paths.size() < 2) GTEST_SKIP() << "only the portable path runs on this processor";
  std::vector<std::shared_ptr<const void>> tables;  // made once, not for every buffer
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) tables.push_back(retain_code_tables(is_signed, bits, at::kCPU));
  }
  int64_t configs = 0;
  for (int bits : {8, 4}) {
    // the default block, the smallest AVX-512 block, and one AVX-512 leaves to AVX2
    for (int64_t block : {bits == 8 ? int64_t{256} : int64_t{128}, int64_t{64}, int64_t{96}}) {
      for (int64_t n : {int64_t{1}, int64_t{255}, int64_t{257}, int64_t{70001}}) {
        for (bool usual_maps : {true, false}) {  // m signed and v unsigned, or the other way round
          for (at::ScalarType p_type : {at::kFloat, at::kBFloat16}) {
            for (at::ScalarType g_type : {at::kFloat, at::kBFloat16}) {
              for (bool stochastic : {false, true}) {
                if (stochastic && p_type == at::kFloat) continue;  // only a bf16 parameter rounds
                for (int variant = 0; variant < 3; ++variant) {    // AdamW, Adam with and without weight decay
                  const std::string where = std::to_string(bits) + "-bit, block " + std::to_string(block) + ", n " + std::to_string(n) +
                                            (usual_maps ? "" : ", swapped maps") + ", p " + c10::toString(p_type) + ", g " +
                                            c10::toString(g_type) + (stochastic ? ", stochastic" : "") + ", variant " +
                                            std::to_string(variant);
                  SCOPED_TRACE(where);
                  ++configs;
                  at::manual_seed(static_cast<uint64_t>(configs));
                  const at::Tensor p0 = at::randn({n}).to(p_type);
                  std::vector<at::Tensor> grads;
                  for (int t = 0; t < 3; ++t)
                    grads.push_back((at::randn({n}) * 0.1 * at::pow(10.0, -at::randint(0, 4, {n}).to(at::kFloat))));
                  grads[1][n / 2] = std::numeric_limits<float>::quiet_NaN();
                  if (n > 2) grads[2][n - 1] = -std::numeric_limits<float>::infinity();
                  for (at::Tensor& g : grads) g = g.to(g_type);
                  const at::Tensor m0 = spread(n, 0.01, !usual_maps), v0 = spread(n, 1e-4, usual_maps);
                  auto run = [&](QuantKernel kernel) {
                    QuantizedBuffer m(n, bits, block, usual_maps), v(n, bits, block, !usual_maps);
                    m.store(0, n, m0);
                    v.store(0, n, v0);
                    at::Tensor p = p0.clone();
                    for (int t = 1; t <= 3; ++t) {
                      const AdamStep h{
                          1e-2, 0.9, 0.999, 1e-8, variant == 2 ? 0.0 : 0.01, 1 - std::pow(0.9, t), 1 - std::pow(0.999, t), variant == 0};
                      // two ranges, as the optimizer's chunks call it: a whole number of blocks, then the rest
                      const int64_t cut = std::min(n, 3 * block);
                      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, cut}, {cut, n}}) {
                        if (b == e) continue;
                        adam_step_quantized_cpu(h, p.narrow(0, b, e - b), grads[t - 1].narrow(0, b, e - b), m, v, b, e,
                                                Bf16Rounding{stochastic, 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(t)}, kernel);
                      }
                    }
                    return StepResult{p, m.codes().clone(), m.absmax().clone(), v.codes().clone(), v.absmax().clone()};
                  };
                  const StepResult want = run(QuantKernel::portable);
                  for (QuantKernel kernel : paths) {
                    if (kernel == QuantKernel::portable) continue;
                    SCOPED_TRACE(quant_kernel_name(kernel));
                    const StepResult got = run(kernel);
                    ASSERT_TRUE(same_bits(got.p, want.p));
                    ASSERT_TRUE(at::equal(got.m_codes, want.m_codes));
                    ASSERT_TRUE(at::equal(got.v_codes, want.v_codes));
                    ASSERT_TRUE(same_bits(got.m_absmax, want.m_absmax));
                    ASSERT_TRUE(same_bits(got.v_absmax, want.v_absmax));
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(configs, 500);
}

TEST(QuantKernel, ValuesOnTheMidpointsGetSearchsortedsCode) {
  // First moments made to land exactly on the maps' midpoints and on their fp32 neighbours: with
  // beta1 = 0 the new first moment is the gradient, and each block's first gradient is 1, so the
  // block's scale is 1 and the gradient itself is encoded. Every path must give at::searchsorted's
  // code over the midpoints (a midpoint itself goes to the lower code).
  for (int bits : {8, 4}) {
    for (bool is_signed : {true, false}) {
      SCOPED_TRACE(std::to_string(bits) + (is_signed ? " signed" : " unsigned"));
      const int64_t block = bits == 8 ? 256 : 128;
      const QuantizedBuffer probe(1, bits, block, is_signed);
      const at::Tensor bounds = at::from_blob(const_cast<float*>(probe.lut_boundary_data()), {probe.levels() - 1}).clone();
      // each midpoint, one fp32 step below and above it, and the ends of the range
      const at::Tensor targets = at::cat({bounds, at::nextafter(bounds, at::full_like(bounds, -2.0)),
                                          at::nextafter(bounds, at::full_like(bounds, 2.0)), at::tensor({-1.0f, -0.0f, 0.0f, 1e-30f})});
      const int64_t per_block = block - 1, blocks = (targets.numel() + per_block - 1) / per_block, n = blocks * block;
      at::Tensor x = at::ones({blocks, block});
      x.narrow(1, 1, per_block).copy_(at::cat({targets, at::zeros({blocks * per_block - targets.numel()})}).view({blocks, per_block}));
      x = x.view({n});
      const at::Tensor want = at::searchsorted(bounds, x).to(at::kByte);
      for (QuantKernel kernel : available_paths()) {
        SCOPED_TRACE(quant_kernel_name(kernel));
        QuantizedBuffer m(n, bits, block, is_signed), v(n, bits, block, false);
        at::Tensor p = at::zeros({n});
        const AdamStep h{1e-3, 0.0, 0.999, 1e-8, 0.0, 1.0, 1e-3, true};
        adam_step_quantized_cpu(h, p, x, m, v, 0, n, Bf16Rounding{}, kernel);
        EXPECT_TRUE(at::equal(m.absmax(), at::ones({blocks})));
        at::Tensor codes = m.codes();
        if (bits == 4) codes = at::stack({at::bitwise_and(codes, 15), at::bitwise_right_shift(codes, 4)}, 1).view({n});
        EXPECT_TRUE(at::equal(codes, want)) << (codes != want).sum().item<int64_t>() << " codes differ";
      }
    }
  }
}

TEST(QuantKernel, EncodeTableGivesTheCodesOfEveryFloat) {
  // The AVX2 path encodes 8-bit codes from one table (QuantizedBuffer::encode_table) in place of
  // nearest_code's two look-ups: the same code for every one of the 2^32 fp32 bit patterns (NaNs,
  // infinities, subnormals, values outside [-1, 1] included), for both maps.
  if (!quant_kernel_supported(QuantKernel::avx2)) GTEST_SKIP() << "no AVX2 here";
  for (bool is_signed : {true, false}) {
    SCOPED_TRACE(is_signed ? "signed" : "unsigned");
    const QuantizedBuffer map(1, 8, 256, is_signed);
    constexpr int64_t kChunk = int64_t{1} << 22, kChunks = (int64_t{1} << 32) / kChunk;
    std::atomic<int64_t> differ{0}, first{-1};
    at::parallel_for(0, kChunks, 1, [&](int64_t c0, int64_t c1) {
      std::vector<float> x(kChunk);
      std::vector<uint8_t> want(kChunk), got(kChunk);
      for (int64_t c = c0; c < c1; ++c) {
        const uint32_t base = static_cast<uint32_t>(c * kChunk);
        for (int64_t i = 0; i < kChunk; ++i) {
          const uint32_t bits = base + static_cast<uint32_t>(i);
          std::memcpy(&x[i], &bits, 4);
        }
        encode_codes8(QuantKernel::portable, map, x.data(), want.data(), kChunk);
        encode_codes8(QuantKernel::avx2, map, x.data(), got.data(), kChunk);
        if (std::memcmp(want.data(), got.data(), kChunk) == 0) continue;
        for (int64_t i = 0; i < kChunk; ++i) {
          if (want[i] == got[i]) continue;
          differ.fetch_add(1);
          int64_t none = -1;
          first.compare_exchange_strong(none, base + i);
        }
      }
    });
    EXPECT_EQ(differ.load(), 0) << "first at bits 0x" << std::hex << first.load();
  }
}

TEST(QuantKernel, ForcingAPathTheProcessorLacksIsRefused) {
  for (QuantKernel k : {QuantKernel::avx2, QuantKernel::avx512}) {
    if (quant_kernel_supported(k)) continue;
    QuantizedBuffer m(256, 8, 256, true), v(256, 8, 256, false);
    at::Tensor p = at::zeros({256}), g = at::ones({256});
    const AdamStep h{1e-3, 0.9, 0.999, 1e-8, 0.0, 0.1, 0.001, true};
    EXPECT_THROW(adam_step_quantized_cpu(h, p, g, m, v, 0, 256, Bf16Rounding{}, k), c10::Error);
  }
}
