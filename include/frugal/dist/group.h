// frugal/dist/group.h — the processes of one data-parallel job: torchrun's environment, a c10d
// process group (Gloo on CPU tensors), and the few collectives frugal uses, with clear errors.
//
// A job of N processes (ranks) is described by torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT. Rank 0 hosts the rendezvous store (c10d's TCPStore)
// on MASTER_ADDR:MASTER_PORT; every rank joins it, then the Gloo group. Collectives are counted
// (bytes each rank hands over), time out after `timeout`, and a failure (a rank died, hung or was
// killed) is a dist::CollectiveError saying which collective failed and which rank is suspect.
// CPU tensors go through Gloo; CUDA tensors through NCCL, in a CUDA build of LibTorch when the
// group is made for a CUDA device (compiled in CI against the CUDA wheel; run only on a machine
// with a GPU per rank, which these have not been).
//
//   auto env = frugal::dist::environment_from_variables();   // nullopt: no WORLD_SIZE, one process
//   auto group = frugal::dist::Group::create(*env, std::chrono::seconds(300));
//   group->allreduce_sum(t);                                   // t: a CPU tensor, summed in place
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace frugal {
namespace dist {

// torchrun's environment contract.
struct Environment {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  int64_t local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
};

// The most ranks a job may have (WORLD_SIZE's bound, and a launcher's).
constexpr int64_t kMaxWorldSize = 4096;

// The job described by the process's environment: nullopt when WORLD_SIZE is unset. Throws
// std::invalid_argument naming the variable and its range when one is missing or malformed
// (RANK outside [0, WORLD_SIZE), a port outside 1-65535, text that is not a whole integer, ...).
std::optional<Environment> environment_from_variables();
// MASTER_PORT alone (a launcher picks a free one when it is unset or empty: nullopt); throws as above.
std::optional<int64_t> master_port_variable();
// The variables that describe `env` (for a launcher to set in a child).
std::vector<std::pair<std::string, std::string>> environment_variables(const Environment& env);

// A collective that did not complete: a rank died, hung past the timeout, or the network failed.
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bytes handed to collectives by this rank, by kind (the payload; what the algorithm sends on the
// wire is measured by the data-parallel benchmark).
struct Traffic {
  int64_t reduce_bytes = 0;     // gradients sent to their owners
  int64_t broadcast_bytes = 0;  // parameters sent from their owners
  int64_t allreduce_bytes = 0;  // small sums: losses, norms, step summaries
  int64_t calls = 0;
};

// This process's membership of a job: its rank, the process group(s), and the collectives frugal uses.
class Group {
 public:
  // Joins (rank 0: hosts) the store and builds the Gloo group, and for a CUDA device the NCCL one.
  // Throws std::invalid_argument when MASTER_PORT is taken on rank 0 or a CUDA device is asked of
  // a build without NCCL, std::runtime_error when the store cannot be reached within the timeout.
  static std::shared_ptr<Group> create(const Environment& env, std::chrono::milliseconds timeout,
                                       c10::Device device = c10::Device(c10::kCPU));
  ~Group();

  // This process's rank, 0 to size() - 1.
  int64_t rank() const { return env_.rank; }
  // The number of ranks in the job (WORLD_SIZE).
  int64_t size() const { return env_.world_size; }
  // The environment the group was created from.
  const Environment& environment() const { return env_; }
  // How long a collective may take before it fails with CollectiveError.
  std::chrono::milliseconds timeout() const { return timeout_; }

  using Wait = std::function<void()>;
  // Sum into `t` on `root` (the others' t is left unspecified). On the CPU, fp32/fp64 are summed
  // in place, bf16 and fp16 in fp32 (Gloo in 1.13 has no bf16). `what` names the collective in errors.
  Wait reduce_sum_async(const at::Tensor& t, int64_t root, const std::string& what);
  // root's t into every rank's t (bitwise: any dtype).
  Wait broadcast_async(const at::Tensor& t, int64_t root, const std::string& what);
  void allreduce_sum(const at::Tensor& t, const std::string& what);                           // blocking; fp32/fp64/int64
  std::vector<int64_t> allgather(const std::vector<int64_t>& mine, const std::string& what);  // every rank's, rank order
  void barrier(const std::string& what);  // blocks until every rank reaches it; CollectiveError on failure

  // Gloo's worker thread can hold a finished operation (and the tensors it was given) a moment
  // after the wait returns; if it dropped the last reference, the memory would be freed on that
  // thread, out of the memory tracker's sight. Waited operations are kept here instead and
  // destroyed on the calling thread once the worker has let go: those it has now, or (wait) all
  // of them, waiting up to a second for each.
  void release_finished(bool wait);

  // The bytes and calls this rank has handed to collectives so far.
  const Traffic& traffic() const { return traffic_; }

  struct Impl;

 private:
  Group(Environment env, std::chrono::milliseconds timeout);
  Environment env_;
  std::chrono::milliseconds timeout_;
  Traffic traffic_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dist
}  // namespace frugal
