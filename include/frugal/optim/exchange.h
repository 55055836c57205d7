// frugal/optim/exchange.h — what the optimizer needs from data-parallel training, and nothing more.
//
// With an Exchange set, the optimizer averages each gradient over the processes (ranks) before it
// is used, updates only the parameters (or the slices of a large parameter) its rank owns (their
// state lives nowhere else: ZeRO-style sharding; the others' gradients are dropped once sent), and
// then has each owner send its updated values to the others. The calls are made in the same order on every rank, which is what
// collectives need. dist::ShardedExchange implements it on a c10d process group; the optimizer
// itself knows nothing of processes.
//
//   auto exchange = std::make_shared<frugal::dist::ShardedExchange>(group, optimizer.parameter_numels());
//   optimizer.set_exchange(exchange);   // before the first step
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <utility>

namespace frugal {
namespace optim {

// The optimizer's view of data-parallel training: gradient averaging, parameter ownership and sharing.
class Exchange {
 public:
  // Waits until an operation started by the exchange is done; throws if it failed.
  using Wait = std::function<void()>;

  virtual ~Exchange() = default;
  virtual int64_t world_size() const = 0;  // the number of ranks
  // The elements [first, second) of the flattened parameter i (the optimizer's parameter index)
  // whose state this rank keeps and which it updates: the whole parameter, a slice of it (a large
  // parameter split over every rank), or nothing (first == second).
  virtual std::pair<int64_t, int64_t> owned_range(size_t i) const = 0;
  // Whether this rank owns any of parameter i (a non-empty owned_range).
  bool owns(size_t i) const {
    const auto r = owned_range(i);
    return r.first < r.second;
  }
  // Starts averaging parameter i's gradient over the ranks. Once the returned Wait has returned,
  // the owned range of `grad` holds the mean (what the rest holds is unspecified). `grad` must be
  // contiguous and live until then.
  virtual Wait average_gradient(size_t i, const at::Tensor& grad) = 0;
  // Starts sending each owner's values of parameter i to every other rank (into their `param`).
  virtual Wait share_parameter(size_t i, const at::Tensor& param) = 0;
  // The sum of x over the ranks (blocking).
  virtual double sum(double x) = 0;
  // Called on the training thread once the waits it was handed are gone (wait = true: every
  // operation is done), so that what the operations held is freed on this thread — where the
  // memory tracker sees the frees — and not on a communication thread.
  virtual void release(bool wait) { (void)wait; }
};

}  // namespace optim
}  // namespace frugal
