// The examples file's fixed values, shared by its writer (examples.cpp) and reader
// (example_batches.cpp); the layout is described in frugal/data/examples.h.
#pragma once

#include <cstdint>

namespace frugal {
namespace data {
namespace examples_format {

constexpr char kMagic[8] = {'F', 'R', 'U', 'G', 'A', 'L', 'E', 'X'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 64;

}  // namespace examples_format
}  // namespace data
}  // namespace frugal
