// frugal/models/evaluate.h — a decoder's loss on held-out tokens: sum of token losses and their count.
//
// A document's ids are cut into consecutive non-overlapping windows of seq_len ids, in order (the
// last one shorter). Each window is scored alone, as transformers does with labels = input_ids:
// position t predicts id t+1 of the same window, so a window of n ids gives n-1 predicted tokens
// (the first id of a window is never predicted; a window of one id predicts nothing). The mean
// loss is the sum over every predicted token of every window, divided by their count (not a mean
// of window means); perplexity = exp(mean loss). Logits are taken in fp32 whatever the model's dtype.
//
//   auto windows = frugal::models::cut_windows(ids, 512);
//   frugal::models::EvalTotals t = frugal::models::score_windows(*model, windows, /*batch_size=*/8);
//   double ppl = t.perplexity();
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "frugal/models/decoder.h"

namespace frugal {
namespace models {

// Loss totals over scored windows; add them up with +=.
struct EvalTotals {
  double loss_sum = 0;  // sum of the token losses (natural log)
  int64_t tokens = 0;   // predicted tokens
  int64_t windows = 0;
  at::Tensor last_logits;  // the last window's logits (1, n, V) in fp32, when asked for
  // The mean token loss in nats (loss_sum / tokens), NaN when no token was predicted.
  double mean_loss() const { return tokens > 0 ? loss_sum / static_cast<double>(tokens) : NAN; }
  // exp(mean_loss()).
  double perplexity() const { return std::exp(mean_loss()); }
  EvalTotals& operator+=(const EvalTotals& o);  // sums; keeps o's last_logits when it has some
};

// ids cut into consecutive windows of seq_len (>= 1) ids; the last holds the rest.
std::vector<std::vector<int32_t>> cut_windows(const std::vector<int32_t>& ids, int64_t seq_len);

// Scores the windows batch_size at a time (shorter windows padded; padding is never predicted and,
// attention being causal, never seen by real positions). Ids must be < the model's vocab_size
// (std::invalid_argument otherwise). No autograd; the model is in eval mode while scoring.
EvalTotals score_windows(DecoderImpl& model, const std::vector<std::vector<int32_t>>& windows, int64_t batch_size,
                         bool keep_last_logits = false);

}  // namespace models
}  // namespace frugal
