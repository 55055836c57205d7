// frugal/memory/category.h — what a byte of training memory is for.
//
// Every allocation the tracker sees is tagged with one Category (from the scope open when it was
// made) and one Phase (the part of the training step running at the time).
//
//   auto c = frugal::memory::parse_category("activation");   // -> Category::activation
//   std::cout << frugal::memory::category_name(*c);           // "activation"
//   for (auto cat : frugal::memory::kAllCategories) { ... }
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

namespace frugal {
namespace memory {

enum class Category : uint8_t {
  parameter,        // model weights and buffers
  gradient,         // parameter gradients
  optimizer_state,  // moments, momentum buffers, quantization scales
  activation,       // tensors kept from forward for backward (and recomputed ones)
  temporary,        // made and freed inside one scope: workspaces, intermediate gradients
  input,            // batches, targets
  other,            // anything allocated outside a declared scope
};
constexpr int kNumCategories = 7;
constexpr std::array<Category, kNumCategories> kAllCategories = {
    Category::parameter, Category::gradient, Category::optimizer_state, Category::activation,
    Category::temporary, Category::input,    Category::other};

enum class Phase : uint8_t { idle, forward, backward, optimizer };
constexpr int kNumPhases = 4;

const char* category_name(Category c);
const char* phase_name(Phase p);
std::optional<Category> parse_category(const std::string& name);

// The category an allocation gets inside a phase when no narrower scope says otherwise:
// forward -> activation, backward -> gradient, optimizer -> optimizer_state, idle -> other.
Category default_category(Phase p);

}  // namespace memory
}  // namespace frugal
