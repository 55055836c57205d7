#include "frugal/checkpoint/policy.h"

#include <optional>
#include <stdexcept>

#include "frugal/io/numbers.h"

namespace frugal {
namespace checkpoint {

namespace {
constexpr int64_t kMaxEvery = (int64_t{1} << 31) - 1;  // allowed_names() states it
}  // namespace

CheckpointPolicy CheckpointPolicy::every(int64_t k) {
  if (k < 1) throw std::invalid_argument("every_k needs k >= 1, got " + std::to_string(k));
  return {PolicyKind::every_k, k};
}

CheckpointPolicy CheckpointPolicy::parse(const std::string& text) {
  if (text == "none") return none();
  if (text == "full") return full();
  if (text == "selective") return selective();
  const std::string prefix = "every_";
  if (text.rfind(prefix, 0) == 0 && text.size() > prefix.size()) {
    const std::string digits = text.substr(prefix.size());
    const std::optional<int64_t> k = digits[0] == '-' ? std::nullopt : io::to_int(digits);
    if (k && *k >= 1 && *k <= kMaxEvery) return every(*k);
  }
  throw std::invalid_argument("unknown checkpointing policy " + io::quote_text(text) + " (allowed: " + allowed_names() + ")");
}

const char* CheckpointPolicy::allowed_names() { return "none, full, every_K (K from 1 to 2147483647), selective"; }

std::string CheckpointPolicy::name() const {
  switch (kind) {
    case PolicyKind::none: return "none";
    case PolicyKind::full: return "full";
    case PolicyKind::every_k: return "every_" + std::to_string(k);
    case PolicyKind::selective: return "selective";
  }
  return "none";
}

bool CheckpointPolicy::checkpoints(int64_t block_index) const {
  switch (kind) {
    case PolicyKind::none: return false;
    case PolicyKind::full:
    case PolicyKind::selective: return true;
    case PolicyKind::every_k: return block_index % k == 0;
  }
  return false;
}

CheckpointOptions CheckpointPolicy::options() const { return CheckpointOptions().keep_linear_outputs(kind == PolicyKind::selective); }

at::Tensor run_chain(const std::vector<ChainBlock>& chain, at::Tensor x, const CheckpointPolicy& policy) {
  for (size_t i = 0; i < chain.size(); ++i) {
    const ChainBlock& block = chain[i];
    if (policy.checkpoints(static_cast<int64_t>(i))) {
      CheckpointOptions options = policy.options().name("block " + std::to_string(i)).buffers(block.buffers).skip_final_tail(true);
      x = checkpoint(block.forward, x, block.params, options);
    } else {
      x = block.forward(x);
    }
  }
  return x;
}

}  // namespace checkpoint
}  // namespace frugal
