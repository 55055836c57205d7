// src/precision/exp_nonpositive.h — exp(x) for x <= 0 in fp32, as a plain function the compiler can
// vectorise for any target, and its constants for hand-written vector versions (loss/'s rows).
#pragma once

#include <cstdint>
#include <cstring>

namespace frugal {
namespace precision {

// exp(x) for x <= 0 (in loss/: a logit minus its row's maximum or log-sum-exp; in models/: silu's
// exp(-|x|)). x = n ln2 + r with n an integer and |r| <= ln2 / 2; e^r is its Taylor polynomial
// of degree 7 (truncation below 1e-8 relative, under fp32's half unit in the last place) and 2^n
// is built in the exponent bits. ln2 is split in two (the first part has 9 significant bits, so
// n * kLn2Hi is exact) to keep r accurate. Below kExpMin the result would not be a normal float:
// it is 0, as it is for x = -inf; a NaN stays NaN.
namespace exp_constants {
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpMin = -87.3365402f;  // ln of the smallest normal float
constexpr float kC2 = 1.0f / 2, kC3 = 1.0f / 6, kC4 = 1.0f / 24, kC5 = 1.0f / 120, kC6 = 1.0f / 720, kC7 = 1.0f / 5040;
// Adding 1.5 * 2^23 to a float of magnitude below 2^22 rounds it to an integer (to nearest, ties
// to even) held in the low bits of the sum's significand.
constexpr float kRoundMagic = 12582912.0f;
constexpr uint32_t kRoundMagicBits = 0x4B400000u;
}  // namespace exp_constants

// always_inline: so that it vectorises inside the callers compiled for AVX2 or AVX-512.
inline __attribute__((always_inline)) float exp_nonpositive(float x) {
  using namespace exp_constants;
  const float t = x * kLog2e + kRoundMagic;
  const float n = t - kRoundMagic;
  uint32_t t_bits;
  std::memcpy(&t_bits, &t, 4);
  const uint32_t two_n_bits = (t_bits - kRoundMagicBits + 127u) << 23;  // 2^n for n in [-126, 0]
  float two_n;
  std::memcpy(&two_n, &two_n_bits, 4);
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = kC7;
  p = p * r + kC6;
  p = p * r + kC5;
  p = p * r + kC4;
  p = p * r + kC3;
  p = p * r + kC2;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return x < kExpMin ? 0.0f : p * two_n;
}

}  // namespace precision
}  // namespace frugal
