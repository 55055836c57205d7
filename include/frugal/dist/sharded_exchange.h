// frugal/dist/sharded_exchange.h — the optimizer's Exchange (optim/exchange.h) over a Group: each
// parameter, or each slice of a large one, has one owner rank, which alone keeps its optimizer
// state (ZeRO-1) and receives its averaged gradient (ZeRO-2: a reduce to the owner, not an
// allreduce); after its update the owner broadcasts it. Per step each rank sends (N-1)/N of the
// gradients' bytes and receives (N-1)/N of the parameters' — the bytes of a reduce-scatter plus an
// all-gather, which Gloo in LibTorch 1.13 does not offer.
//
//   auto owners = frugal::dist::assign_owners(optimizer.parameter_numels(), group->size());  // slices per parameter
//   optimizer.set_exchange(std::make_shared<frugal::dist::ShardedExchange>(group, owners, optimizer.parameter_names()));
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "frugal/dist/group.h"
#include "frugal/optim/exchange.h"

namespace frugal {
namespace dist {

// A rank's elements [begin, end) of a flattened parameter.
struct Slice {
  int64_t rank = 0;
  int64_t begin = 0, end = 0;
};

// Parameters of at least world_size * kMinSliceElements elements are split over every rank in
// near-equal slices whose boundaries are multiples of kSliceAlignment (whole blocks of 8- and 4-bit
// state, and every slice big enough to be quantized as the whole parameter would be); smaller ones
// go whole, the largest first, to the rank that owns the fewest elements so far (ties to the lowest
// rank). So each rank holds about 1/N of the state. The same on every rank: it depends only on the
// sizes, and each rank's total not even on their order.
constexpr int64_t kMinSliceElements = 8192;
constexpr int64_t kSliceAlignment = 256;
using Ownership = std::vector<std::vector<Slice>>;  // per parameter, its slices in rank order (one when whole)
Ownership assign_owners(const std::vector<int64_t>& numels, int64_t world_size);
// This rank's range of each parameter ({0, 0}: none).
std::pair<int64_t, int64_t> owned_range(const std::vector<Slice>& slices, int64_t rank);

// An optim::Exchange over a Group, each parameter's slices owned as `owners` says (see above).
class ShardedExchange : public optim::Exchange {
 public:
  // `owners` and `names` (used in errors) per optimizer parameter; throws c10::Error when their counts
  // differ or an owner is not a rank of the group.
  ShardedExchange(std::shared_ptr<Group> group, Ownership owners, std::vector<std::string> names);

  int64_t world_size() const override { return group_->size(); }
  std::pair<int64_t, int64_t> owned_range(size_t i) const override { return dist::owned_range(owners_.at(i), group_->rank()); }
  Wait average_gradient(size_t i, const at::Tensor& grad) override;
  Wait share_parameter(size_t i, const at::Tensor& param) override;
  double sum(double x) override;
  void release(bool wait) override { group_->release_finished(wait); }

  // Each parameter's slices and their owners, as given.
  const Ownership& owners() const { return owners_; }

 private:
  // Starts `op` on each owner's slice of parameter i's flattened tensor, in rank order.
  using SliceOp = std::function<Group::Wait(const at::Tensor& slice, int64_t owner)>;
  std::vector<Group::Wait> for_each_slice(size_t i, const at::Tensor& flat, const SliceOp& op) const;

  std::shared_ptr<Group> group_;
  Ownership owners_;
  std::vector<std::string> names_;
};

}  // namespace dist
}  // namespace frugal
