// frugal/io/tensor_values.h — checks over the values of a tensor read from (or about to be written
// to) a file, by reductions over pieces, so a check holds no per-element temporary.
//
//   if (!frugal::io::all_finite(weight)) throw ...;   // NaN or infinity somewhere
//   if (frugal::io::any_negative(exp_avg_sq)) throw ...;
#pragma once

#include <ATen/ATen.h>

namespace frugal {
namespace io {

// True when every value is finite (integer tensors always are).
bool all_finite(const at::Tensor& t);
// True when some value is below zero (check all_finite first: a piece holding NaN answers false).
bool any_negative(const at::Tensor& t);

}  // namespace io
}  // namespace frugal
