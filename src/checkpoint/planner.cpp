#include "frugal/checkpoint/planner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <sstream>

#include "frugal/checkpoint/selective.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace checkpoint {
namespace {

int64_t kept_sum(const std::vector<BlockCost>& costs, int64_t begin, int64_t end) {
  int64_t s = 0;
  for (int64_t b = begin; b < end; ++b) s += costs[static_cast<size_t>(b)].kept_bytes;
  return s;
}

// What recomputing the checkpointed segment [begin, end) costs: its blocks' forward but the last
// one's tail product.
double recompute_sum(const std::vector<BlockCost>& costs, int64_t begin, int64_t end) {
  double s = 0;
  for (int64_t b = begin; b < end; ++b) s += costs[static_cast<size_t>(b)].forward_s;
  const BlockCost& last = costs[static_cast<size_t>(end - 1)];
  return s - std::min(last.tail_s, last.forward_s);
}

// What a segment keeps from the end of forward until its backward.
int64_t contribution(const std::vector<BlockCost>& costs, const Segment& s) {
  return s.checkpointed ? costs[static_cast<size_t>(s.end - 1)].output_bytes : kept_sum(costs, s.begin, s.end);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

}  // namespace

std::string ActivationPlan::describe() const {
  std::ostringstream out;
  for (size_t i = 0; i < segments.size(); ++i) {
    const Segment& s = segments[i];
    if (i) out << " | ";
    out << s.begin;
    if (s.end - s.begin > 1) out << "-" << s.end - 1;
    if (s.checkpointed) out << " ckpt";
  }
  return out.str();
}

int64_t ActivationPlan::checkpointed_blocks() const {
  int64_t n = 0;
  for (const Segment& s : segments) n += s.checkpointed ? s.end - s.begin : 0;
  return n;
}

int64_t predicted_peak_bytes(const std::vector<BlockCost>& costs, const std::vector<Segment>& segments) {
  int64_t prefix = 0, peak = 0;
  for (const Segment& s : segments) {
    if (s.checkpointed) peak = std::max(peak, prefix + kept_sum(costs, s.begin, s.end));
    prefix += contribution(costs, s);
  }
  return std::max(peak, prefix);
}

double recompute_seconds(const std::vector<BlockCost>& costs, const std::vector<Segment>& segments) {
  double t = 0;
  for (const Segment& s : segments) t += s.checkpointed ? recompute_sum(costs, s.begin, s.end) : 0.0;
  return t;
}

ActivationPlan make_plan(const std::vector<BlockCost>& costs, std::vector<Segment> segments) {
  ActivationPlan plan;
  plan.predicted_bytes = predicted_peak_bytes(costs, segments);
  plan.recompute_s = recompute_seconds(costs, segments);
  plan.segments = std::move(segments);
  return plan;
}

std::optional<ActivationPlan> plan_for_budget(const std::vector<BlockCost>& costs, int64_t budget_bytes) {
  const int64_t n = static_cast<int64_t>(costs.size());
  // states[i]: the Pareto front of partial plans covering blocks [0, i), as (kept prefix, recompute
  // time) with neither worse than another's; each remembers how it was reached.
  struct State {
    int64_t prefix;
    double time;
    int64_t from_position;
    size_t from_state;
    Segment last;
  };
  std::vector<std::vector<State>> states(static_cast<size_t>(n + 1));
  states[0].push_back({0, 0.0, -1, 0, {}});
  auto prune = [](std::vector<State>& front) {
    std::sort(front.begin(), front.end(),
              [](const State& a, const State& b) { return a.prefix != b.prefix ? a.prefix < b.prefix : a.time < b.time; });
    std::vector<State> kept;
    for (const State& s : front) {
      if (kept.empty() || s.time < kept.back().time) kept.push_back(s);
    }
    front = std::move(kept);
  };
  for (int64_t i = 0; i < n; ++i) {
    prune(states[static_cast<size_t>(i)]);
    const auto& front = states[static_cast<size_t>(i)];
    for (size_t k = 0; k < front.size(); ++k) {
      const State& s = front[k];
      // Block i runs plainly.
      const int64_t plain_prefix = s.prefix + costs[static_cast<size_t>(i)].kept_bytes;
      if (plain_prefix <= budget_bytes) {
        states[static_cast<size_t>(i + 1)].push_back({plain_prefix, s.time, i, k, {i, i + 1, false}});
      }
      // Blocks [i, j) form one checkpointed segment.
      int64_t recompute_live = s.prefix;
      double forward_time = s.time;
      for (int64_t j = i + 1; j <= n; ++j) {
        const BlockCost& last = costs[static_cast<size_t>(j - 1)];
        recompute_live += last.kept_bytes;
        forward_time += last.forward_s;
        if (recompute_live > budget_bytes) break;  // longer segments only need more
        const int64_t prefix = s.prefix + last.output_bytes;
        const double recompute_time = forward_time - std::min(last.tail_s, last.forward_s);
        states[static_cast<size_t>(j)].push_back({prefix, recompute_time, i, k, {i, j, true}});
      }
    }
  }
  auto& last = states[static_cast<size_t>(n)];
  prune(last);
  const State* best = nullptr;
  for (const State& s : last) {
    if (s.prefix <= budget_bytes && (!best || s.time < best->time)) best = &s;
  }
  if (!best) return std::nullopt;
  std::vector<Segment> segments;
  for (const State* s = best; s->from_position >= 0; s = &states[static_cast<size_t>(s->from_position)][s->from_state]) {
    segments.push_back(s->last);
  }
  std::reverse(segments.begin(), segments.end());
  return make_plan(costs, std::move(segments));
}

int64_t min_achievable_bytes(const std::vector<BlockCost>& costs) {
  // Feasibility is monotone in the budget: bisect on whole bytes.
  int64_t lo = 0, hi = no_checkpoint_plan(costs).predicted_bytes;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (plan_for_budget(costs, mid)) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

ActivationPlan sqrt_n_plan(const std::vector<BlockCost>& costs) {
  const int64_t n = static_cast<int64_t>(costs.size());
  const int64_t len = std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(n))));
  std::vector<Segment> segments;
  for (int64_t b = 0; b < n; b += len) segments.push_back({b, std::min(n, b + len), true});
  return make_plan(costs, std::move(segments));
}

ActivationPlan no_checkpoint_plan(const std::vector<BlockCost>& costs) {
  std::vector<Segment> segments;
  for (int64_t b = 0; b < static_cast<int64_t>(costs.size()); ++b) segments.push_back({b, b + 1, false});
  return make_plan(costs, std::move(segments));
}

std::vector<BlockCost> measure_chain(const std::vector<ChainBlock>& chain, const at::Tensor& x, int timing_runs) {
  std::vector<BlockCost> costs(chain.size());
  {
    auto tracker = memory::Tracker::create();
    memory::TrackingGuard tracking(tracker);
    memory::PhaseScope forward(memory::Phase::forward);
    std::vector<at::Tensor> outputs;  // keep every block's graph alive until all are measured
    at::Tensor h = x;
    for (size_t i = 0; i < chain.size(); ++i) {
      const int64_t before = tracker->live_bytes();
      h = chain[i].forward(h);
      outputs.push_back(h);
      costs[i].kept_bytes = tracker->live_bytes() - before;
      costs[i].output_bytes = static_cast<int64_t>(h.storage().nbytes());
    }
  }
  std::vector<std::vector<double>> times(chain.size()), tails(chain.size());
  for (int r = 0; r < std::max(1, timing_runs) + 1; ++r) {  // the first pass warms up
    at::Tensor h = x;
    for (size_t i = 0; i < chain.size(); ++i) {
      double tail = 0;
      detail::TailTimer timer(&tail);
      const auto t0 = std::chrono::steady_clock::now();
      h = chain[i].forward(h);
      if (r > 0) {
        times[i].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        tails[i].push_back(tail);
      }
    }
  }
  for (size_t i = 0; i < chain.size(); ++i) {
    costs[i].forward_s = median(times[i]);
    costs[i].tail_s = median(tails[i]);
  }
  return costs;
}

at::Tensor run_plan(const std::vector<ChainBlock>& chain, at::Tensor x, const ActivationPlan& plan, const CheckpointOptions& options) {
  for (const Segment& s : plan.segments) {
    TORCH_CHECK(s.begin >= 0 && s.begin < s.end && s.end <= static_cast<int64_t>(chain.size()), "run_plan: segment [", s.begin, ", ", s.end,
                ") is outside the chain of ", chain.size(), " blocks");
    if (!s.checkpointed) {
      for (int64_t b = s.begin; b < s.end; ++b) x = chain[static_cast<size_t>(b)].forward(x);
      continue;
    }
    std::vector<at::Tensor> params, buffers;
    std::vector<UnaryFn> blocks;
    for (int64_t b = s.begin; b < s.end; ++b) {
      const ChainBlock& block = chain[static_cast<size_t>(b)];
      params.insert(params.end(), block.params.begin(), block.params.end());
      buffers.insert(buffers.end(), block.buffers.begin(), block.buffers.end());
      blocks.push_back(block.forward);
    }
    CheckpointOptions opt = options;
    opt.name("blocks " + std::to_string(s.begin) + "-" + std::to_string(s.end - 1)).buffers(buffers).skip_final_tail(true);
    x = checkpoint(
        [blocks](const at::Tensor& in) {
          at::Tensor h = in;
          for (const UnaryFn& f : blocks) h = f(h);
          return h;
        },
        x, params, opt);
  }
  return x;
}

}  // namespace checkpoint
}  // namespace frugal
