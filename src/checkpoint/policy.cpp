#include "frugal/checkpoint/policy.h"

#include <stdexcept>

namespace frugal {
namespace checkpoint {

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
    if (digits.size() <= 9 && digits.find_first_not_of("0123456789") == std::string::npos) {
      const int64_t k = std::stoll(digits);
      if (k >= 1) return every(k);
    }
  }
  throw std::invalid_argument("unknown checkpointing policy '" + text +
                              "' (allowed: none, full, every_K with K >= 1, selective)");
}

const char* CheckpointPolicy::allowed_names() { return "none, full, every_K (K >= 1), selective"; }

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

CheckpointOptions CheckpointPolicy::options() const {
  return CheckpointOptions().keep_linear_outputs(kind == PolicyKind::selective);
}

at::Tensor run_chain(const std::vector<ChainBlock>& chain, at::Tensor x, const CheckpointPolicy& policy) {
  for (size_t i = 0; i < chain.size(); ++i) {
    const ChainBlock& block = chain[i];
    if (policy.checkpoints(static_cast<int64_t>(i))) {
      CheckpointOptions options =
          policy.options().name("block " + std::to_string(i)).buffers(block.buffers).skip_final_tail(true);
      x = checkpoint(block.forward, x, block.params, options);
    } else {
      x = block.forward(x);
    }
  }
  return x;
}

}  // namespace checkpoint
}  // namespace frugal
