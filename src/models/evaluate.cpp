#include "frugal/models/evaluate.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>
#include <string>

namespace frugal {
namespace models {

EvalTotals& EvalTotals::operator+=(const EvalTotals& o) {
  loss_sum += o.loss_sum;
  tokens += o.tokens;
  windows += o.windows;
  if (o.last_logits.defined()) last_logits = o.last_logits;
  return *this;
}

std::vector<std::vector<int32_t>> cut_windows(const std::vector<int32_t>& ids, int64_t seq_len) {
  if (seq_len < 1) throw std::invalid_argument("seq_len must be >= 1, not " + std::to_string(seq_len));
  std::vector<std::vector<int32_t>> out;
  for (size_t at = 0; at < ids.size(); at += static_cast<size_t>(seq_len)) {
    const size_t end = std::min(ids.size(), at + static_cast<size_t>(seq_len));
    out.emplace_back(ids.begin() + static_cast<std::ptrdiff_t>(at), ids.begin() + static_cast<std::ptrdiff_t>(end));
  }
  return out;
}

EvalTotals score_windows(DecoderImpl& model, const std::vector<std::vector<int32_t>>& windows, int64_t batch_size, bool keep_last_logits) {
  if (batch_size < 1) throw std::invalid_argument("batch_size must be >= 1, not " + std::to_string(batch_size));
  const int64_t vocab = model.config().vocab_size;
  for (const auto& w : windows) {
    if (static_cast<int64_t>(w.size()) > model.config().max_seq_len) {
      throw std::invalid_argument("a window of " + std::to_string(w.size()) + " tokens is longer than the model's max_seq_len " +
                                  std::to_string(model.config().max_seq_len));
    }
    for (int32_t id : w) {
      if (id < 0 || id >= vocab) {
        throw std::invalid_argument("token " + std::to_string(id) + " is outside the model's vocabulary [0, " + std::to_string(vocab) +
                                    ")");
      }
    }
  }
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  EvalTotals t;
  for (size_t first = 0; first < windows.size(); first += static_cast<size_t>(batch_size)) {
    const size_t last = std::min(windows.size(), first + static_cast<size_t>(batch_size));
    int64_t T = 0;
    for (size_t i = first; i < last; ++i) T = std::max<int64_t>(T, static_cast<int64_t>(windows[i].size()));
    if (T < 2) {  // nothing to predict in this batch
      t.windows += static_cast<int64_t>(last - first);
      continue;
    }
    const int64_t B = static_cast<int64_t>(last - first);
    at::Tensor inputs = at::zeros({B, T}, at::kLong);            // (B, T), padded with id 0
    at::Tensor targets = at::full({B, T - 1}, -100, at::kLong);  // (B, T-1): id t+1, -100 where none
    auto in = inputs.accessor<int64_t, 2>();
    auto tg = targets.accessor<int64_t, 2>();
    for (int64_t b = 0; b < B; ++b) {
      const auto& w = windows[first + static_cast<size_t>(b)];
      for (size_t j = 0; j < w.size(); ++j) in[b][static_cast<int64_t>(j)] = w[j];
      for (size_t j = 0; j + 1 < w.size(); ++j) tg[b][static_cast<int64_t>(j)] = w[j + 1];
    }
    const at::Tensor logits = model.logits(inputs.to(device)).to(at::kFloat).to(at::kCPU);  // (B, T, V)
    const at::Tensor pred = logits.narrow(1, 0, T - 1).reshape({-1, vocab});                // (B*(T-1), V)
    const at::Tensor flat = targets.reshape({-1});                                          // (B*(T-1))
    const at::Tensor mask = flat != -100;
    const at::Tensor logp = at::log_softmax(pred, 1);                                     // (B*(T-1), V)
    const at::Tensor picked = logp.gather(1, flat.clamp_min(0).unsqueeze(1)).squeeze(1);  // (B*(T-1))
    t.loss_sum += -picked.masked_select(mask).to(at::kDouble).sum().item<double>();
    t.tokens += mask.sum().item<int64_t>();
    t.windows += B;
    if (keep_last_logits && last == windows.size()) {
      const int64_t n = static_cast<int64_t>(windows.back().size());
      t.last_logits = logits.select(0, B - 1).narrow(0, 0, n).unsqueeze(0).contiguous();  // (1, n, V)
    }
  }
  if (was_training) model.train();
  return t;
}

}  // namespace models
}  // namespace frugal
