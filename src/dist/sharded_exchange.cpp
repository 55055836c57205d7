#include "frugal/dist/sharded_exchange.h"

#include <algorithm>
#include <numeric>

namespace frugal {
namespace dist {

Ownership assign_owners(const std::vector<int64_t>& numels, int64_t world_size) {
  TORCH_CHECK(world_size >= 1, "dist: world size must be >= 1, got ", world_size);
  Ownership owners(numels.size());
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  std::vector<size_t> whole;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t n = numels[i];
    if (world_size == 1 || n < world_size * kMinSliceElements) {
      whole.push_back(i);
      continue;
    }
    // Split: rank r's slice ends at r+1 N-ths of n, rounded down to the alignment (the last at n).
    int64_t begin = 0;
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t end = r + 1 == world_size ? n : (n / world_size * (r + 1)) / kSliceAlignment * kSliceAlignment;
      owners[i].push_back({r, begin, end});
      load[static_cast<size_t>(r)] += end - begin;
      begin = end;
    }
  }
  std::stable_sort(whole.begin(), whole.end(), [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  for (size_t i : whole) {
    const auto lightest = std::min_element(load.begin(), load.end());  // first of the least loaded
    owners[i].push_back({lightest - load.begin(), 0, numels[i]});
    *lightest += numels[i];
  }
  return owners;
}

std::pair<int64_t, int64_t> owned_range(const std::vector<Slice>& slices, int64_t rank) {
  for (const Slice& s : slices) {
    if (s.rank == rank) return {s.begin, s.end};
  }
  return {0, 0};
}

ShardedExchange::ShardedExchange(std::shared_ptr<Group> group, Ownership owners, std::vector<std::string> names)
    : group_(std::move(group)), owners_(std::move(owners)), names_(std::move(names)) {
  TORCH_CHECK(owners_.size() == names_.size(), "dist: ", owners_.size(), " owners for ", names_.size(), " parameters");
  for (const auto& slices : owners_) {
    for (const Slice& s : slices)
      TORCH_CHECK(s.rank >= 0 && s.rank < group_->size(), "dist: owner rank ", s.rank, " outside the world of ", group_->size());
  }
}

std::vector<Group::Wait> ShardedExchange::for_each_slice(size_t i, const at::Tensor& flat, const SliceOp& op) const {
  std::vector<Group::Wait> started;
  for (const Slice& s : owners_.at(i)) started.push_back(op(flat.narrow(0, s.begin, s.end - s.begin), s.rank));
  return started;
}

optim::Exchange::Wait ShardedExchange::average_gradient(size_t i, const at::Tensor& grad) {
  TORCH_CHECK(grad.is_contiguous(), "dist: the gradient of '", names_.at(i), "' is not contiguous");
  const at::Tensor flat = grad.view({-1});
  const auto sent = for_each_slice(i, flat, [&](const at::Tensor& slice, int64_t owner) {
    return group_->reduce_sum_async(slice, owner, "the reduce of the gradient of '" + names_.at(i) + "' to rank " + std::to_string(owner));
  });
  const auto mine = owned_range(i);
  const double n = static_cast<double>(group_->size());
  return [sent, flat, mine, n]() {
    for (const auto& w : sent) w();
    if (mine.first < mine.second) flat.narrow(0, mine.first, mine.second - mine.first).div_(n);
  };
}

optim::Exchange::Wait ShardedExchange::share_parameter(size_t i, const at::Tensor& param) {
  TORCH_CHECK(param.is_contiguous(), "dist: parameter '", names_.at(i), "' is not contiguous");
  const auto sent = for_each_slice(i, param.view({-1}), [&](const at::Tensor& slice, int64_t owner) {
    return group_->broadcast_async(slice, owner, "the broadcast of parameter '" + names_.at(i) + "' from rank " + std::to_string(owner));
  });
  return [sent]() {
    for (const auto& w : sent) w();
  };
}

double ShardedExchange::sum(double x) {
  at::Tensor t = at::scalar_tensor(x, at::kDouble).reshape({1});
  group_->allreduce_sum(t, "the sum of the gradient norms");
  return t.item<double>();
}

}  // namespace dist
}  // namespace frugal
