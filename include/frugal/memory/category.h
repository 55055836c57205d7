// frugal/memory/category.h — what a byte of training memory is for.
//
// Every allocation the tracker sees has one Category and one Phase (the part of the training step
// running when it was made). The category follows one rule, applied by the tracker alone
// (tracker.cpp, Tracker::settle) and read by every view through the trace (trace.h):
//
//   1. tag(tensor, C) names what an allocation is for, from its allocation on, and wins over
//      everything below (the optimizer tags parameters' .grad as gradient the moment autograd
//      accumulates it; the code tables of quantized state are tagged other).
//   2. Otherwise, an allocation freed while the scope it was made in is still open is temporary:
//      it was allocated and freed within that phase or scope (workspaces, autograd's
//      intermediate gradients, a forward's transients).
//   3. Otherwise it has the category of the innermost scope open when it was made: a
//      CategoryScope's, or its phase's default (forward: activation, backward: other,
//      optimizer: optimizer_state, outside any scope: other).
//
// So: parameter = parameter tensors (and buffers); gradient = parameters' .grad, nothing else;
// optimizer_state = the optimizer's moments, momentum and scales; activation = what forward keeps
// for backward, and what a checkpointed region recomputes for it; temporary = everything made and
// freed within one phase or scope; input = batches and targets; other = the rest.
// Rule 2 needs the free to be seen, so until a scope closes its live allocations count under
// rule 3; the tracker corrects every recorded peak, step summary and limit report when it learns
// better, so those are final once the scopes are closed.
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
  gradient,         // parameters' .grad, nothing else
  optimizer_state,  // moments, momentum buffers, quantization scales
  activation,       // tensors kept from forward for backward (and recomputed ones)
  temporary,        // made and freed inside one phase or scope: workspaces, intermediate gradients
  input,            // batches, targets
  other,            // anything allocated outside a declared scope
};
constexpr int kNumCategories = 7;
constexpr std::array<Category, kNumCategories> kAllCategories = {Category::parameter,  Category::gradient,  Category::optimizer_state,
                                                                 Category::activation, Category::temporary, Category::input,
                                                                 Category::other};

// evaluation and sampling: a training run's validation passes and its text sample, marked so the
// report can name the spikes they make between steps.
enum class Phase : uint8_t { idle, forward, backward, optimizer, evaluation, sampling };
constexpr int kNumPhases = 6;

const char* category_name(Category c);
const char* phase_name(Phase p);
std::optional<Category> parse_category(const std::string& name);

// The category an allocation gets inside a phase when no narrower scope says otherwise:
// forward -> activation, backward -> other, optimizer -> optimizer_state, idle -> other. (What
// backward keeps is a gradient only once the optimizer tags it; its intermediates are freed inside
// it, so they are temporary.)
Category default_category(Phase p);

}  // namespace memory
}  // namespace frugal
