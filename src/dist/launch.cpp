#include "frugal/dist/launch.h"

#include <ATen/Parallel.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <optional>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "frugal/dist/group.h"
#include "frugal/io/files.h"
#include "frugal/io/numbers.h"

namespace frugal {
namespace dist {
namespace {

volatile sig_atomic_t g_forward_signal = 0;
void remember_signal(int sig) { g_forward_signal = sig; }

std::string describe_status(int status) {
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return "was killed by signal " + std::to_string(sig) + " (" + ::strsignal(sig) + ")";
  }
  return "exited with code " + std::to_string(WEXITSTATUS(status));
}

}  // namespace

std::optional<int64_t> launcher_threads() {
  const char* text = std::getenv("FRUGAL_NUM_THREADS");
  if (!text || !*text) return std::nullopt;
  return io::parse_int(text, "the environment variable FRUGAL_NUM_THREADS", 1, kMaxThreads);
}

void use_launcher_threads() {
  if (const auto n = launcher_threads()) at::set_num_threads(static_cast<int>(*n));
}

int64_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error("cannot open a socket to find a free port");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot find a free port on 127.0.0.1");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {

void check_launch_options(const LaunchOptions& o) {
  if (o.nproc < 1 || o.nproc > kMaxWorldSize) {
    throw std::invalid_argument("the number of ranks must be " + io::int_range(1, kMaxWorldSize) + ", not " + std::to_string(o.nproc));
  }
  if (o.threads_per_rank < 0 || o.threads_per_rank > kMaxThreads) {
    throw std::invalid_argument("the threads per rank must be " + io::int_range(0, kMaxThreads) + ", not " +
                                std::to_string(o.threads_per_rank));
  }
  if (o.argv.empty()) throw std::invalid_argument("launch_local needs the command to run");
}

// In the forked child of rank env.rank: dies with the launcher, takes the rank's environment and its
// share of the cores, writes to its log (rank 0: the terminal, unless rank0_to_log), and becomes
// the command. Never returns.
[[noreturn]] void become_rank(const LaunchOptions& o, const Environment& env, pid_t launcher, int64_t threads, unsigned cores,
                              const std::vector<char*>& argv) {
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(1);  // the launcher died before the request took
  for (const auto& [k, v] : environment_variables(env)) ::setenv(k.c_str(), v.c_str(), 1);
  if (threads < static_cast<int64_t>(cores)) {  // a share of the cores (all of them: LibTorch's defaults)
    ::setenv("FRUGAL_NUM_THREADS", std::to_string(threads).c_str(), 1);
    ::setenv("OPENBLAS_NUM_THREADS", std::to_string(threads).c_str(), 1);
    if (threads > 1) ::setenv("OMP_WAIT_POLICY", "PASSIVE", 0);
  }
  if (env.rank > 0 || o.rank0_to_log) {
    const std::string log_path = o.log_dir + "/rank-" + std::to_string(env.rank) + ".log";
    const int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
  }
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

// The ranks' processes while they run: which are still running, signals passed on, the first
// failure stopping the others (SIGTERM, then SIGKILL after the grace period).
class RankProcesses {
 public:
  explicit RankProcesses(std::vector<pid_t> pids) : pids_(std::move(pids)), running_(pids_.size(), true), left_(pids_.size()) {}

  bool any_running() const { return left_ > 0; }

  void signal_running(int sig) {
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (running_[i]) ::kill(pids_[i], sig);
    }
  }

  // A rank that has ended since the last call (its index and wait status), or nullopt when none has.
  std::optional<std::pair<size_t, int>> reap() {
    int status = 0;
    const pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done <= 0) return std::nullopt;
    for (size_t i = 0; i < pids_.size(); ++i) {
      if (pids_[i] == done && running_[i]) {
        running_[i] = false;
        --left_;
        return std::make_pair(i, status);
      }
    }
    return std::nullopt;  // not one of ours, or already counted
  }

  void stop_all(std::chrono::milliseconds grace) {
    signal_running(SIGTERM);
    const auto deadline = std::chrono::steady_clock::now() + grace;
    while (left_ > 0) {
      if (reap()) continue;
      if (std::chrono::steady_clock::now() > deadline) signal_running(SIGKILL);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

 private:
  std::vector<pid_t> pids_;
  std::vector<bool> running_;
  size_t left_;
};

}  // namespace

LaunchResult launch_local(const LaunchOptions& o, const std::function<void(const std::string&)>& log) {
  check_launch_options(o);
  LaunchResult result;
  Environment env;
  env.world_size = env.local_world_size = o.nproc;
  if (const char* addr = std::getenv("MASTER_ADDR")) env.master_addr = addr;
  const std::optional<int64_t> port = master_port_variable();  // refused before anything is made
  env.master_port = port ? *port : free_port();
  io::make_directories(o.log_dir);
  result.port = env.master_port;
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int64_t threads = o.threads_per_rank > 0 ? o.threads_per_rank : std::max<int64_t>(1, cores / o.nproc);

  // Start the ranks; SIGINT and SIGTERM are passed on to them until they have all ended.
  std::vector<char*> argv;
  for (const std::string& a : o.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<pid_t> pids;
  struct sigaction forward {
  }, old_int{}, old_term{};
  forward.sa_handler = remember_signal;
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  const pid_t launcher = ::getpid();
  for (int64_t rank = 0; rank < o.nproc; ++rank) {
    env.rank = env.local_rank = rank;
    const pid_t pid = ::fork();
    if (pid < 0) {
      for (pid_t p : pids) ::kill(p, SIGKILL);
      throw std::runtime_error("cannot start rank " + std::to_string(rank) + ": fork failed");
    }
    if (pid == 0) become_rank(o, env, launcher, threads, cores, argv);
    pids.push_back(pid);
  }
  std::string list;
  for (size_t i = 0; i < pids.size(); ++i) list += (i ? ", " : "") + std::to_string(pids[i]);
  log("started " + std::to_string(o.nproc) + " ranks on 127.0.0.1:" + std::to_string(env.master_port) + " (pids " + list + ")" +
      (o.nproc == 1   ? std::string()
       : o.nproc == 2 ? "; rank 1 logs to " + o.log_dir + "/rank-1.log"
                      : "; ranks 1-" + std::to_string(o.nproc - 1) + " log to " + o.log_dir + "/rank-R.log"));

  // Wait for them; the first to fail stops the others.
  RankProcesses ranks(pids);
  while (ranks.any_running()) {
    if (g_forward_signal) {
      const int sig = g_forward_signal;
      g_forward_signal = 0;
      ranks.signal_running(sig);
    }
    const auto ended = ranks.reap();
    if (!ended) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const auto [rank, status] = *ended;
    const bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && result.failed_rank < 0) {
      result.failed_rank = static_cast<int64_t>(rank);
      result.failure = "rank " + std::to_string(rank) + " " + describe_status(status);
      result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
      if (ranks.any_running())
        log(result.failure + (rank > 0 ? " (its log: " + o.log_dir + "/rank-" + std::to_string(rank) + ".log)" : "") +
            "; stopping the other ranks");
      ranks.stop_all(o.grace);
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return result;
}

}  // namespace dist
}  // namespace frugal
