// frugal/checkpoint/autocast.h — moved to frugal/precision/autocast.h (the precision layer, below
// checkpoint/ and loss/). This header keeps code written against the old place compiling; new code
// includes frugal/precision/autocast.h and names frugal::precision::.
#pragma once

#include "frugal/precision/autocast.h"

namespace frugal {
namespace checkpoint {

using precision::AutocastGuard;
using precision::AutocastState;
using precision::compute_dtype_for;
using precision::ComputeThreadsGuard;
using precision::fast_bf16;

}  // namespace checkpoint
}  // namespace frugal
