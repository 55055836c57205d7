#include "frugal/optim/quantize.h"

#include "frugal/memory/tracker.h"

#include <cmath>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace frugal {
namespace optim {

at::Tensor dynamic_code_map(bool is_signed, int bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "dynamic_code_map: bits must be 8 or 4, got ", bits);
  // Positive magnitudes: decades 10^-k .. 10^-(k-1), each split linearly, twice as finely in each
  // larger decade (values are relative to their block's absmax), ending at exactly 1.
  //   signed (first moments): the magnitudes, the negatives of all but the smallest, and 0
  //   unsigned (second moments): only the magnitudes, no 0, so that a small second moment never
  //   rounds to zero (which would blow up its update).
  const int levels = 1 << bits;
  const int decades = bits == 8 ? 7 : 3;
  const int positives = is_signed ? levels / 2 : levels;
  std::vector<int> per(static_cast<size_t>(decades));
  int weight = 0;
  for (int i = 0; i < decades; ++i) weight += 1 << i;
  int used = 0;
  for (int i = 0; i < decades; ++i) {
    per[static_cast<size_t>(i)] = std::max(1, (positives - 1) * (1 << i) / weight);
    used += per[static_cast<size_t>(i)];
  }
  per.back() += positives - 1 - used;  // the largest decade takes the rounding rest
  std::vector<double> mags;
  for (int i = 0; i < decades; ++i) {
    const double lo = std::pow(10.0, -(decades - i)), hi = std::pow(10.0, -(decades - i - 1));
    const int n = per[static_cast<size_t>(i)];
    for (int j = 0; j < n; ++j) mags.push_back(lo + (hi - lo) * (j + 0.5) / n);
  }
  mags.push_back(1.0);  // positives entries in all
  std::vector<float> values;
  for (double m : mags) values.push_back(static_cast<float>(m));
  if (is_signed) {
    // the negatives of all but the smallest magnitude, and zero: positives + (positives - 1) + 1
    for (size_t i = 1; i < mags.size(); ++i) values.push_back(static_cast<float>(-mags[i]));
    values.push_back(0.0f);
  }
  TORCH_CHECK(static_cast<int>(values.size()) == levels, "dynamic_code_map: built ", values.size(), " entries, expected ", levels);
  at::Tensor map = at::tensor(values, at::kFloat);
  return std::get<0>(map.sort());
}

namespace {

// The maps and their midpoints, made once per (signedness, bits, device) and shared by all buffers.
struct SharedMap {
  at::Tensor map, boundaries, lut;
};

SharedMap shared_map(bool is_signed, int bits, at::Device device) {
  static std::mutex mutex;
  static std::map<std::tuple<bool, int, std::string>, SharedMap> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& entry = cache[std::make_tuple(is_signed, bits, device.str())];
  if (!entry.map.defined()) {
    const at::Tensor map = dynamic_code_map(is_signed, bits);
    const at::Tensor boundaries = ((map.narrow(0, 1, map.size(0) - 1) + map.narrow(0, 0, map.size(0) - 1)) / 2).contiguous();
    // Every 16-bit prefix of an fp32 value (its bf16 truncation), and its code.
    const at::Tensor prefixes = (at::arange(65536, at::kInt) * 65536).view(at::kFloat);
    const at::Tensor lut = at::searchsorted(boundaries, prefixes.nan_to_num(0.0).clamp(-1.0, 1.0)).to(at::kByte);
    entry = {map.to(device), boundaries.to(device), lut};
    // Constant tables shared by every buffer of the process: not any one optimizer's state.
    for (const at::Tensor* t : {&entry.map, &entry.boundaries, &entry.lut}) memory::tag(*t, memory::Category::other);
  }
  return entry;
}

}  // namespace

QuantizedBuffer::QuantizedBuffer(int64_t numel, int bits, int64_t block, bool is_signed, at::Device device)
    : numel_(numel), block_(block), bits_(bits), signed_(is_signed) {
  TORCH_CHECK(bits == 8 || bits == 4, "QuantizedBuffer: bits must be 8 or 4");
  TORCH_CHECK(block > 0 && block % 2 == 0, "QuantizedBuffer: block must be a positive even number");
  const SharedMap shared = shared_map(is_signed, bits, device);
  map_ = shared.map;
  boundaries_ = shared.boundaries;
  lut_ = shared.lut;
  const int64_t blocks = (numel + block - 1) / block;
  const auto u8 = at::TensorOptions().dtype(at::kByte).device(device);
  const int64_t zero_code = at::searchsorted(boundaries_, at::zeros({1}, map_.options())).item<int64_t>();
  const int64_t padded = blocks * block;
  at::Tensor zeros = at::full({padded}, zero_code, u8);
  codes_ = bits == 8 ? zeros : (zeros.view({-1, 2}).select(1, 0) | at::bitwise_left_shift(zeros.view({-1, 2}).select(1, 1), 4)).contiguous();
  absmax_ = at::zeros({blocks}, at::TensorOptions().dtype(at::kFloat).device(device));
}

int64_t QuantizedBuffer::bytes() const {
  return codes_.numel() * static_cast<int64_t>(codes_.element_size()) + absmax_.numel() * 4;
}

at::Tensor QuantizedBuffer::load(int64_t begin, int64_t end) const {
  TORCH_CHECK(begin % block_ == 0 && begin <= end && end <= numel_, "QuantizedBuffer::load: bad range");
  const int64_t b0 = begin / block_, b1 = (end + block_ - 1) / block_, n = (b1 - b0) * block_;
  at::Tensor codes;  // (n) int64 indices into the map
  if (bits_ == 8) {
    codes = codes_.narrow(0, b0 * block_, n).to(at::kLong);
  } else {
    const at::Tensor packed = codes_.narrow(0, b0 * block_ / 2, n / 2);
    codes = at::stack({at::bitwise_and(packed, 15), at::bitwise_right_shift(packed, 4)}, 1).reshape({n}).to(at::kLong);
  }
  const at::Tensor values = map_.index_select(0, codes).view({b1 - b0, block_}) * absmax_.narrow(0, b0, b1 - b0).unsqueeze(1);
  return values.view({n}).narrow(0, 0, end - begin);
}

void QuantizedBuffer::store(int64_t begin, int64_t end, const at::Tensor& values) {
  TORCH_CHECK(begin % block_ == 0 && begin <= end && end <= numel_, "QuantizedBuffer::store: bad range");
  TORCH_CHECK(values.numel() == end - begin, "QuantizedBuffer::store: expected ", end - begin, " values");
  const int64_t b0 = begin / block_, b1 = (end + block_ - 1) / block_, n = (b1 - b0) * block_;
  at::Tensor v = values.to(map_.device(), at::kFloat).reshape({-1});
  if (n != v.numel()) v = at::cat({v, at::zeros({n - v.numel()}, v.options())});  // the short last block
  const at::Tensor blocks = v.view({b1 - b0, block_});                        // (blocks, block)
  const at::Tensor absmax = std::get<0>(blocks.abs().max(1));                 // (blocks)
  const at::Tensor scale = absmax.clamp_min(1e-30).unsqueeze(1);
  const at::Tensor normalized = (blocks / scale).clamp(signed_ ? -1.0 : 0.0, 1.0).reshape({n});
  const at::Tensor codes = at::searchsorted(boundaries_, normalized).to(at::kByte);  // nearest entry
  absmax_.narrow(0, b0, b1 - b0).copy_(absmax);
  if (bits_ == 8) {
    codes_.narrow(0, b0 * block_, n).copy_(codes);
  } else {
    const at::Tensor pairs = codes.view({-1, 2});
    codes_.narrow(0, b0 * block_ / 2, n / 2).copy_(pairs.select(1, 0) | at::bitwise_left_shift(pairs.select(1, 1), 4));
  }
}

void QuantizedBuffer::assign(const at::Tensor& codes, const at::Tensor& absmax) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == codes_.numel(), "quantized state: codes of ",
              codes.numel(), " bytes, expected ", codes_.numel());
  TORCH_CHECK(absmax.numel() == absmax_.numel(), "quantized state: ", absmax.numel(), " scales, expected ", absmax_.numel());
  codes_.copy_(codes.reshape({-1}));
  absmax_.copy_(absmax.reshape({-1}).to(at::kFloat));
}

}  // namespace optim
}  // namespace frugal

namespace frugal {
namespace optim {

void QuantizedBuffer::move_codes_to(at::Tensor storage) {
  TORCH_CHECK(storage.scalar_type() == at::kByte && storage.numel() == codes_.numel(), "QuantizedBuffer: storage of the wrong size");
  storage.copy_(codes_);
  codes_ = storage;
}

}  // namespace optim
}  // namespace frugal

namespace frugal {
namespace optim {
namespace {

// The code of x (already normalized): the table's guess, corrected to searchsorted's answer. The
// guess comes from x's top 16 bits, off by at most one entry (a bf16 step is far finer than the
// map's gaps relative to the value), so one branch-free step each way settles it.
inline uint8_t nearest_code(float x, const uint8_t* lut, const float* boundaries, int64_t n_boundaries) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  int64_t code = lut[bits >> 16];
  code += (code < n_boundaries && boundaries[code] < x);
  code -= (code > 0 && boundaries[code - 1] >= x);
  return static_cast<uint8_t>(code);
}

template <int Bits>
void adam_blocks(const AdamStep& h, float* p, const float* g, QuantizedBuffer& m, QuantizedBuffer& v, int64_t begin,
                 int64_t end) {
  const int64_t block = m.block(), first = begin / block, last = (end + block - 1) / block;
  uint8_t* mc = m.codes().data_ptr<uint8_t>();
  uint8_t* vc = v.codes().data_ptr<uint8_t>();
  float* ma = m.absmax().data_ptr<float>();
  float* va = v.absmax().data_ptr<float>();
  const float *mmap = m.map_data(), *vmap = v.map_data();
  const float *mb = m.boundary_data(), *vb = v.boundary_data();
  const uint8_t *mlut = m.lut(), *vlut = v.lut();
  const int64_t mnb = m.levels() - 1, vnb = v.levels() - 1;
  const float b1 = static_cast<float>(h.beta1), b2 = static_cast<float>(h.beta2);
  const float one_b1 = static_cast<float>(1 - h.beta1), one_b2 = static_cast<float>(1 - h.beta2);
  const float eps = static_cast<float>(h.eps), wd = static_cast<float>(h.weight_decay);
  const float decay = static_cast<float>(1 - h.lr * h.weight_decay);
  const float sqrt_bc2 = static_cast<float>(std::sqrt(h.bias_correction2));
  const float step = static_cast<float>(-h.lr / h.bias_correction1);
  auto code_at = [](const uint8_t* codes, int64_t i) -> int {
    if (Bits == 8) return codes[i];
    const uint8_t byte = codes[i >> 1];
    return (i & 1) ? (byte >> 4) : (byte & 15);
  };
  at::parallel_for(first, last, 64, [&](int64_t b0, int64_t b1_) {
    std::vector<float> mt(static_cast<size_t>(block)), vt(static_cast<size_t>(block));
    for (int64_t b = b0; b < b1_; ++b) {
      const int64_t base = b * block;                       // element index in the parameter
      const int64_t count = std::min(block, m.numel() - base);
      const float am = ma[b], av = va[b];
      float max_m = 0, max_v = 0;
      for (int64_t j = 0; j < count; ++j) {
        const int64_t i = base + j, k = i - begin;         // k: index into this range's p and g
        float gj = g[k];
        float pj = p[k];
        if (h.decoupled) {
          pj *= decay;
        } else if (wd != 0) {
          gj = gj + wd * pj;
        }
        const float mj = mmap[code_at(mc, i)] * am * b1 + one_b1 * gj;
        const float vj = vmap[code_at(vc, i)] * av * b2 + one_b2 * gj * gj;
        const float denom = std::sqrt(vj) / sqrt_bc2 + eps;
        p[k] = pj + step * (mj / denom);
        mt[static_cast<size_t>(j)] = mj;
        vt[static_cast<size_t>(j)] = vj;
        max_m = std::max(max_m, std::fabs(mj));
        max_v = std::max(max_v, std::fabs(vj));
      }
      for (int64_t j = count; j < block; ++j) mt[static_cast<size_t>(j)] = vt[static_cast<size_t>(j)] = 0.0f;  // padding
      ma[b] = max_m;
      va[b] = max_v;
      const float inv_m = 1.0f / std::max(max_m, 1e-30f), inv_v = 1.0f / std::max(max_v, 1e-30f);
      for (int64_t j = 0; j < block; ++j) {
        const float xm = std::min(1.0f, std::max(-1.0f, mt[static_cast<size_t>(j)] * inv_m));
        const float xv = std::min(1.0f, std::max(0.0f, vt[static_cast<size_t>(j)] * inv_v));
        const uint8_t cm = nearest_code(xm, mlut, mb, mnb), cv = nearest_code(xv, vlut, vb, vnb);
        const int64_t i = base + j;
        if (Bits == 8) {
          mc[i] = cm;
          vc[i] = cv;
        } else if (i & 1) {
          mc[i >> 1] = static_cast<uint8_t>((mc[i >> 1] & 15) | (cm << 4));
          vc[i >> 1] = static_cast<uint8_t>((vc[i >> 1] & 15) | (cv << 4));
        } else {
          mc[i >> 1] = static_cast<uint8_t>((mc[i >> 1] & 0xF0) | cm);
          vc[i >> 1] = static_cast<uint8_t>((vc[i >> 1] & 0xF0) | cv);
        }
      }
    }
  });
}

}  // namespace

void adam_step_quantized_cpu(const AdamStep& h, float* p, const float* g, QuantizedBuffer& m, QuantizedBuffer& v,
                             int64_t begin, int64_t end) {
  TORCH_CHECK(m.bits() == v.bits() && m.block() == v.block() && begin % m.block() == 0, "adam_step_quantized_cpu: mismatched state");
  TORCH_CHECK(m.codes().device().is_cpu(), "adam_step_quantized_cpu: the state must be on the CPU");
  if (m.bits() == 8) {
    adam_blocks<8>(h, p, g, m, v, begin, end);
  } else {
    adam_blocks<4>(h, p, g, m, v, begin, end);
  }
}

}  // namespace optim
}  // namespace frugal
