#include "frugal/memory/category.h"

namespace frugal {
namespace memory {

const char* category_name(Category c) {
  switch (c) {
    case Category::parameter: return "parameter";
    case Category::gradient: return "gradient";
    case Category::optimizer_state: return "optimizer_state";
    case Category::activation: return "activation";
    case Category::temporary: return "temporary";
    case Category::input: return "input";
    case Category::other: return "other";
  }
  return "other";
}

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::idle: return "idle";
    case Phase::forward: return "forward";
    case Phase::backward: return "backward";
    case Phase::optimizer: return "optimizer";
    case Phase::evaluation: return "evaluation";
    case Phase::sampling: return "sampling";
  }
  return "idle";
}

std::optional<Category> parse_category(const std::string& name) {
  for (Category c : kAllCategories) {
    if (name == category_name(c)) return c;
  }
  return std::nullopt;
}

Category default_category(Phase p) {
  switch (p) {
    case Phase::forward: return Category::activation;
    case Phase::backward: return Category::other;
    case Phase::optimizer: return Category::optimizer_state;
    case Phase::idle:
    case Phase::evaluation:
    case Phase::sampling: return Category::other;
  }
  return Category::other;
}

}  // namespace memory
}  // namespace frugal
