// src/precision/x86_kernels.h — whether the AVX2 and AVX-512 paths of frugal's fused CPU kernels are
// compiled (optim/'s Adam(W), SGD and quantized-state kernels, loss/'s cross-entropy rows):
// FRUGAL_X86_KERNELS is 1 on x86-64 with GCC or Clang (their per-function target attributes let one
// file hold every path, chosen at run time), with the intrinsics included; 0 elsewhere, where only
// the portable loops exist.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define FRUGAL_X86_KERNELS 1
#include <immintrin.h>
#else
#define FRUGAL_X86_KERNELS 0
#endif
