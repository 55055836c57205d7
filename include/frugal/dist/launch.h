// frugal/dist/launch.h — start N local ranks of one command, as torchrun does, and supervise them.
//
// Each child is the same executable with torchrun's variables set (RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; group.h) and, when it gets fewer threads than the
// machine has cores (cores / N, or threads_per_rank), that share in FRUGAL_NUM_THREADS (applied by
// the child with use_launcher_threads()) and OPENBLAS_NUM_THREADS, with OMP_WAIT_POLICY=PASSIVE
// above 1 thread. It dies with the launcher (PR_SET_PDEATHSIG). All the cores: LibTorch's defaults,
// untouched. Measured on 2 cores (the default recipe's step): unset 1.60 s; OMP_NUM_THREADS=2 or
// at::set_num_threads(2) 3.3-3.5 s (libgomp's threads spin against OpenBLAS's); 1 thread 1.79 s;
// OMP_NUM_THREADS=2 with a passive wait 1.75 s. Rank 0 keeps the launcher's terminal; the others
// write to log_dir/rank-R.log. When a rank fails (exits non-zero or is killed) the launcher stops
// the others (SIGTERM, then SIGKILL after `grace`) and reports which rank failed and how.
//
//   auto r = frugal::dist::launch_local(frugal::dist::LaunchOptions{2, {"/proc/self/exe", "train", "tiny"}, "out/logs"}, log);
//   return r.exit_code;
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace frugal {
namespace dist {

// What launch_local starts: how many ranks, the command, where logs go, threads per rank, the grace period.
struct LaunchOptions {
  int64_t nproc = 2;
  std::vector<std::string> argv;  // argv[0]: the executable
  std::string log_dir;            // ranks 1.. write rank-R.log here
  int64_t threads_per_rank = 0;   // 0: the machine's cores / nproc (at least 1); > 0: this many
  bool rank0_to_log = false;      // rank 0 writes to log_dir/rank-0.log too (not the terminal)
  std::chrono::milliseconds grace{10000};
};

// How the ranks ended: the exit code to return, and which rank failed and how.
struct LaunchResult {
  int exit_code = 0;  // 0 when every rank succeeded; else the first failed rank's code (1 if it was killed)
  int64_t failed_rank = -1;
  std::string failure;  // "rank 1 was killed by signal 9 (Killed)"
  int64_t port = 0;     // MASTER_PORT the ranks used
};

// The most threads a rank may be given (FRUGAL_NUM_THREADS's bound).
constexpr int64_t kMaxThreads = 4096;

// FRUGAL_NUM_THREADS: nullopt when unset or empty; throws std::invalid_argument naming the
// variable and its range (1 to kMaxThreads) when it is anything but a whole integer in it.
std::optional<int64_t> launcher_threads();
// In a child of launch_local: LibTorch's intra-op threads from FRUGAL_NUM_THREADS (nothing when unset).
void use_launcher_threads();

// A free TCP port on 127.0.0.1 (the kernel's choice), for MASTER_PORT.
int64_t free_port();

// Throws std::invalid_argument when nproc is outside 1 to kMaxWorldSize (group.h) or MASTER_PORT
// is set but not a port (both before anything is made), std::runtime_error when the log folder
// cannot be made or a child cannot be started. MASTER_PORT unset or empty: a free port. `log` gets a line when the ranks start and when one
// fails.
LaunchResult launch_local(const LaunchOptions& options, const std::function<void(const std::string&)>& log);

}  // namespace dist
}  // namespace frugal
