#include "frugal/dist/group.h"

#include "backend.h"

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>

#include "frugal/io/numbers.h"

#include <dirent.h>
#include <fcntl.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

namespace frugal {
namespace dist {
namespace {

// A variable's integer value in [lo, hi], or the default when unset.
int64_t integer_variable(const char* name, int64_t lo, int64_t hi, std::optional<int64_t> fallback) {
  const char* text = std::getenv(name);
  if (!text || !*text) {
    if (fallback) return *fallback;
    throw std::invalid_argument(std::string("the environment variable ") + name + " must be set for a distributed run (WORLD_SIZE is set)");
  }
  return io::parse_int(text, std::string("the environment variable ") + name, lo, hi);
}

// The first line of an error, without LibTorch's "[file:line] " prefix or its backtrace.
std::string first_line(const std::exception& e) {
  const auto* c10 = dynamic_cast<const c10::Error*>(&e);
  std::string m = c10 ? c10->what_without_backtrace() : e.what();
  m = m.substr(0, m.find('\n'));
  if (!m.empty() && m[0] == '[') {
    const size_t close = m.find("] ");
    if (close != std::string::npos && close < 200) m = m.substr(close + 2);
  }
  return m;
}

// c10d and Gloo write to standard error on their own while a group is made: glog's "WARNING:
// Logging before InitGoogleLogging()", "socket.cpp:426] [c10d] The server socket has failed to
// bind ...", "socket.cpp:860] ... timed out", around the one sentence frugal says about the
// failure. Their loggers differ between the LibTorch builds frugal supports (glog in Debian's
// 1.13; c10's own logger in the 2.x wheels, whose level flag is another symbol, and glog's flags
// are not exported by both), so the one place that holds for both is the file descriptor: while
// this scope lives, fd 2 is an anonymous in-memory file; when it ends, fd 2 is put back and the
// captured text is appended to it only when it is a regular file (a rank's log, as launch_local
// makes for ranks 1..N-1), never to a terminal or a pipe. Nothing else of frugal's prints while
// a group is being made.
class LibraryTextToLog {
 public:
  LibraryTextToLog() {
    std::fflush(stderr);
    capture_ = ::memfd_create("frugal-dist-library-text", MFD_CLOEXEC);
    if (capture_ < 0) return;  // the text then reaches stderr as before
    saved_ = ::fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 3);
    if (saved_ < 0 || ::dup2(capture_, STDERR_FILENO) < 0) {
      if (saved_ >= 0) ::close(saved_);
      ::close(capture_);
      saved_ = capture_ = -1;
    }
  }
  ~LibraryTextToLog() {
    if (capture_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    struct stat st {};
    if (::fstat(STDERR_FILENO, &st) == 0 && S_ISREG(st.st_mode) && ::lseek(capture_, 0, SEEK_SET) == 0) {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(capture_, buf, sizeof(buf))) > 0) {
        if (::write(STDERR_FILENO, buf, static_cast<size_t>(n)) != n) break;
      }
    }
    ::close(capture_);
  }
  LibraryTextToLog(const LibraryTextToLog&) = delete;
  LibraryTextToLog& operator=(const LibraryTextToLog&) = delete;

 private:
  int saved_ = -1, capture_ = -1;
};

// Shuts down every socket of this process whose peer is on `port` (the store's): a thread
// blocked reading one returns at once.
void shut_sockets_to(int64_t port) {
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return;
  const int own = ::dirfd(dir);
  while (const dirent* e = ::readdir(dir)) {
    const std::optional<int64_t> fd = io::to_int(e->d_name);
    if (!fd || *fd == own) continue;
    struct stat st {};
    if (::fstat(static_cast<int>(*fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (::getpeername(static_cast<int>(*fd), reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    int64_t peer_port = -1;
    if (peer.ss_family == AF_INET) peer_port = ntohs(reinterpret_cast<const sockaddr_in*>(&peer)->sin_port);
    if (peer.ss_family == AF_INET6) peer_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_port);
    if (peer_port == port) ::shutdown(static_cast<int>(*fd), SHUT_RDWR);
  }
  ::closedir(dir);
}

// c10d's TCPStore, made on a thread of its own and waited for at most `limit`. Its client bounds
// the connection by the store's timeout but then waits for the store's first answer without a
// deadline (LibTorch 1.13), so a listener that accepts and never answers (not a c10d store: a
// wrong MASTER_PORT) held a rank forever. When the limit passes, the sockets to the store's port
// are shut down, which ends that wait, and nullptr is returned: the caller reports the timeout.
// The thread is joined, or (should it still not return) left to end with the process.
c10::intrusive_ptr<c10d::Store> make_store_within(const std::string& addr, const c10d::TCPStoreOptions& options,
                                                  std::chrono::milliseconds limit) {
  struct Attempt {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    c10::intrusive_ptr<c10d::Store> store;
    std::exception_ptr error;
  };
  auto attempt = std::make_shared<Attempt>();
  std::thread worker([attempt, addr, options]() {
    c10::intrusive_ptr<c10d::Store> store;
    std::exception_ptr error;
    try {
      store = c10::make_intrusive<c10d::TCPStore>(addr, options);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(attempt->m);
    attempt->store = std::move(store);
    attempt->error = error;
    attempt->done = true;
    attempt->cv.notify_all();
  });
  std::unique_lock<std::mutex> lock(attempt->m);
  const bool in_time = attempt->cv.wait_for(lock, limit, [&] { return attempt->done; });
  if (!in_time) {
    lock.unlock();
    shut_sockets_to(options.port);
    lock.lock();
    attempt->cv.wait_for(lock, std::chrono::seconds(5), [&] { return attempt->done; });
  }
  const bool done = attempt->done;
  lock.unlock();
  if (done) {
    worker.join();
  } else {
    worker.detach();
  }
  if (!in_time) return c10::intrusive_ptr<c10d::Store>();
  if (attempt->error) std::rethrow_exception(attempt->error);
  return attempt->store;
}

// Whether something accepts a TCP connection at addr:port within a second. Tells a rank that timed
// out whether nothing listens there (rank 0 not up, a wrong port) or something that is not a store.
bool something_listens(const std::string& addr, int64_t port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(addr.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return false;
  bool accepted = false;
  for (const addrinfo* a = found; a && !accepted; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      accepted = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof(err);
      accepted = ::poll(&p, 1, 1000) == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return accepted;
}

bool is_loopback(const std::string& addr) { return addr == "localhost" || addr.rfind("127.", 0) == 0 || addr == "::1"; }

}  // namespace

std::optional<Environment> environment_from_variables() {
  const char* ws = std::getenv("WORLD_SIZE");
  if (!ws || !*ws) return std::nullopt;
  Environment env;
  env.world_size = integer_variable("WORLD_SIZE", 1, kMaxWorldSize, std::nullopt);
  env.rank = integer_variable("RANK", 0, env.world_size - 1, std::nullopt);
  env.local_world_size = integer_variable("LOCAL_WORLD_SIZE", 1, env.world_size, env.world_size);
  env.local_rank = integer_variable("LOCAL_RANK", 0, env.local_world_size - 1, env.rank % env.local_world_size);
  const char* addr = std::getenv("MASTER_ADDR");
  if (env.world_size > 1 && (!addr || !*addr)) {
    throw std::invalid_argument("the environment variable MASTER_ADDR must be set for a distributed run (rank 0's host name or address)");
  }
  if (addr && *addr) env.master_addr = addr;
  env.master_port = integer_variable("MASTER_PORT", 1, 65535, env.world_size > 1 ? std::nullopt : std::optional<int64_t>(29500));
  return env;
}

std::optional<int64_t> master_port_variable() {
  const char* text = std::getenv("MASTER_PORT");
  if (!text || !*text) return std::nullopt;
  return integer_variable("MASTER_PORT", 1, 65535, std::nullopt);
}

std::vector<std::pair<std::string, std::string>> environment_variables(const Environment& env) {
  return {{"RANK", std::to_string(env.rank)},
          {"WORLD_SIZE", std::to_string(env.world_size)},
          {"LOCAL_RANK", std::to_string(env.local_rank)},
          {"LOCAL_WORLD_SIZE", std::to_string(env.local_world_size)},
          {"MASTER_ADDR", env.master_addr},
          {"MASTER_PORT", std::to_string(env.master_port)}};
}

struct Group::Impl {
  std::vector<c10::intrusive_ptr<c10d::Work>> finished;  // waited for; destroyed by release_finished
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<BackendBase> gloo;  // CPU tensors
  c10::intrusive_ptr<BackendBase> nccl;  // CUDA tensors, when made for a CUDA device

  BackendBase& for_tensor(const at::Tensor& t, const std::string& what) {
    if (t.is_cuda()) {
      TORCH_CHECK(nccl, "dist: ", what, " is on a CUDA device but the group was made for the CPU");
      return *nccl;
    }
    TORCH_CHECK(t.device().is_cpu(), "dist: ", what, " is on ", t.device(), "; only CPU (Gloo) and CUDA (NCCL) tensors go");
    return *gloo;
  }
};

Group::Group(Environment env, std::chrono::milliseconds timeout)
    : env_(std::move(env)), timeout_(timeout), impl_(std::make_unique<Impl>()) {}
Group::~Group() = default;

std::shared_ptr<Group> Group::create(const Environment& env, std::chrono::milliseconds timeout, c10::Device device) {
  std::shared_ptr<Group> g(new Group(env, timeout));
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifname && *ifname && ::if_nametoindex(ifname) == 0) {
    // Gloo would refuse it only after the rendezvous, with its assertion text ("ifa != nullptr").
    throw std::invalid_argument("the environment variable GLOO_SOCKET_IFNAME names " + io::quote_text(ifname) +
                                ", which is not a network interface here");
  }
  const std::string seconds = std::to_string(timeout.count() / 1000) + " s";
  LibraryTextToLog quiet;
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(env.master_port);
    o.isServer = env.rank == 0;
    o.numWorkers = static_cast<size_t>(env.world_size);
    o.waitWorkers = true;
    o.timeout = timeout;
    // c10d's own timeout ends its waits first; the limit catches those it leaves unbounded.
    const auto limit = timeout + std::chrono::milliseconds(std::max<int64_t>(2000, timeout.count() / 10));
    g->impl_->store = make_store_within(env.master_addr, o, limit);
  } catch (const std::exception& e) {
    const std::string m = first_line(e);
    if (env.rank == 0 && (m.find("EADDRINUSE") != std::string::npos || m.find("ddress already in use") != std::string::npos)) {
      throw std::invalid_argument("MASTER_PORT " + std::to_string(env.master_port) + " is already in use on " + env.master_addr +
                                  ", so rank 0 cannot host the rendezvous store there; choose a free port");
    }
    if (env.rank == 0) {
      throw std::runtime_error("rank 0 could not host the rendezvous store on " + where + " or not every one of the " +
                               std::to_string(env.world_size) + " ranks joined it within " + seconds + ": " + m);
    }
    throw std::runtime_error("rank " + std::to_string(env.rank) + " could not reach the rendezvous store at " + where + " within " +
                             seconds + " (is rank 0 running, and are MASTER_ADDR and MASTER_PORT right?): " + m);
  }
  if (!g->impl_->store) {
    if (env.rank == 0) {
      throw std::runtime_error("rank 0 hosts the rendezvous store on " + where + " but not every one of the " +
                               std::to_string(env.world_size) + " ranks joined it within " + seconds);
    }
    if (!something_listens(env.master_addr, env.master_port)) {
      throw std::runtime_error("rank " + std::to_string(env.rank) + " could not reach the rendezvous store at " + where + " within " +
                               seconds +
                               ": nothing accepts connections there (is rank 0 running, and are MASTER_ADDR and MASTER_PORT right?)");
    }
    throw std::runtime_error("rank " + std::to_string(env.rank) + " connected to " + where +
                             " but no rendezvous store answered there within " + seconds +
                             ": what listens there is not rank 0's c10d store (are MASTER_ADDR and MASTER_PORT right?)");
  }
  try {
    auto options = c10d::ProcessGroupGloo::Options::create();
    if (ifname && *ifname) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (is_loopback(env.master_addr)) {
      options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    options->timeout = timeout;
    options->threads = 2;
    g->impl_->gloo =
        c10::make_intrusive<c10d::ProcessGroupGloo>(g->impl_->store, static_cast<int>(env.rank), static_cast<int>(env.world_size), options);
  } catch (const std::exception& e) {
    throw std::runtime_error("rank " + std::to_string(env.rank) + " could not connect to the other ranks (Gloo, rendezvous at " + where +
                             "): " + first_line(e));
  }
  if (device.is_cuda()) {
    g->impl_->nccl = make_nccl_backend(g->impl_->store, static_cast<int>(env.rank), static_cast<int>(env.world_size), timeout);
    if (!g->impl_->nccl) {
      throw std::invalid_argument("data parallel on " + device.str() +
                                  " needs NCCL, which this LibTorch build (" TORCH_VERSION ", CPU) does not have");
    }
  }
  return g;
}

namespace {

// Waits for a c10d work, turning its failure into one sentence.
void wait_for(const c10::intrusive_ptr<c10d::Work>& work, const Environment& env, std::chrono::milliseconds timeout,
              const std::string& what) {
  try {
    work->wait();
    return;
  } catch (const std::exception& e) {
    const std::string suspect = env.world_size == 2 ? "rank " + std::to_string(1 - env.rank) : "another rank";
    throw CollectiveError("rank " + std::to_string(env.rank) + ": " + what + " failed: " + first_line(e) + " (" + suspect +
                          " has probably died or stopped answering; collectives time out after " + std::to_string(timeout.count() / 1000) +
                          " s)");
  }
}

bool summable(at::ScalarType t) { return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kInt; }

}  // namespace

Group::Wait Group::reduce_sum_async(const at::Tensor& t, int64_t root, const std::string& what) {
  BackendBase& backend = impl_->for_tensor(t, what);
  // Gloo reduces dense tensors of a few dtypes: others (bf16, fp16) and strided ones go through a
  // copy; NCCL takes bf16 and fp16 as they are.
  const bool native = summable(t.scalar_type()) || (t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf));
  const bool copy = !native || !t.is_contiguous();
  at::Tensor buf = copy ? t.to(native ? t.scalar_type() : at::kFloat).contiguous() : t;
  std::vector<at::Tensor> list{buf};
  c10d::ReduceOptions o;
  o.rootRank = root;
  o.reduceOp = c10d::ReduceOp::SUM;
  auto work = backend.reduce(list, o);
  traffic_.reduce_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  ++traffic_.calls;
  const Environment env = env_;
  const auto timeout = timeout_;
  const bool at_root = env_.rank == root;
  Impl* impl = impl_.get();
  return [impl, work, buf, t, copy, env, timeout, what, at_root]() {
    wait_for(work, env, timeout, what);
    impl->finished.push_back(work);
    if (copy && at_root) t.copy_(buf);
  };
}

Group::Wait Group::broadcast_async(const at::Tensor& t, int64_t root, const std::string& what) {
  BackendBase& backend = impl_->for_tensor(t, what);
  // Bytes, so that any dtype goes through unchanged.
  const bool copy = !t.is_contiguous();
  at::Tensor dense = copy ? t.contiguous() : t;
  at::Tensor bytes = dense.view({-1}).view(at::kByte);
  std::vector<at::Tensor> list{bytes};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  auto work = backend.broadcast(list, o);
  traffic_.broadcast_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  ++traffic_.calls;
  const Environment env = env_;
  const auto timeout = timeout_;
  Impl* impl = impl_.get();
  return [impl, work, dense, t, copy, env, timeout, what]() {
    wait_for(work, env, timeout, what);
    impl->finished.push_back(work);
    if (copy) t.copy_(dense);
  };
}

void Group::allreduce_sum(const at::Tensor& t, const std::string& what) {
  TORCH_CHECK(summable(t.scalar_type()) && t.is_contiguous(), "dist: ", what,
              ": allreduce_sum takes a dense tensor of fp32, fp64, int32 or int64");
  std::vector<at::Tensor> list{t};
  auto work = impl_->for_tensor(t, what).allreduce(list);
  traffic_.allreduce_bytes += t.numel() * static_cast<int64_t>(t.element_size());
  ++traffic_.calls;
  wait_for(work, env_, timeout_, what);
  impl_->finished.push_back(work);
  release_finished(false);
}

std::vector<int64_t> Group::allgather(const std::vector<int64_t>& mine, const std::string& what) {
  at::Tensor in = at::tensor(mine, at::kLong);
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < env_.world_size; ++r) out[0].push_back(at::empty_like(in));
  std::vector<at::Tensor> inputs{in};
  auto work = impl_->gloo->allgather(out, inputs);
  ++traffic_.calls;
  wait_for(work, env_, timeout_, what);
  impl_->finished.push_back(work);
  std::vector<int64_t> all;
  for (const at::Tensor& t : out[0]) {
    const auto* p = t.data_ptr<int64_t>();
    all.insert(all.end(), p, p + t.numel());
  }
  return all;
}

void Group::release_finished(bool wait) {
  auto& finished = impl_->finished;
  for (size_t i = 0; i < finished.size();) {
    // use_count 1: only this list holds it, so destroying it here frees its tensors here.
    for (int spins = 0; wait && finished[i].use_count() > 1 && spins < 100000; ++spins)
      std::this_thread::sleep_for(std::chrono::microseconds(10));
    if (finished[i].use_count() == 1) {
      finished[i] = std::move(finished.back());
      finished.pop_back();
    } else {
      ++i;
    }
  }
}

void Group::barrier(const std::string& what) {
  auto work = impl_->gloo->barrier();
  ++traffic_.calls;
  wait_for(work, env_, timeout_, what);
  impl_->finished.push_back(work);
  release_finished(false);
}

}  // namespace dist
}  // namespace frugal
