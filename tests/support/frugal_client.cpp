// frugal_test_client: stands in for `frugal` in the test scripts (tests/support/frugal_server.sh).
// It links no LibTorch, so it starts in a millisecond: it hands its arguments, working folder,
// environment and standard streams to the frugal_test_server listening on ARGV0.sock (argv[0] as
// invoked, plus ".sock": the script's link to this program names its server), forwards the signals
// it receives to the worker (its umask, resource limits, and ignored and blocked signals go along; its nice value and CPU
// affinity do not), and ends as the worker ended (its exit code, or killed by its signal).
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "frugal_server.h"

extern char** environ;

namespace {

using frugal::testing::read_all;

volatile sig_atomic_t worker_pid = 0;
volatile sig_atomic_t pending_signal = 0;

void forward(int sig) {
  if (worker_pid > 0) {
    ::kill(worker_pid, sig);
  } else {
    pending_signal = sig;
  }
}

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "frugal_test_client: %s: %s\n", what.c_str(), std::strerror(errno));
  std::_Exit(125);
}

}  // namespace

int main(int argc, char** argv) {
  const std::string path = std::string(argv[0]) + ".sock";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) fail("socket path too long: " + path);
  std::strcpy(addr.sun_path, path.c_str());
  const int sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (sock < 0) fail("socket");
  if (::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) fail("no server at " + path);

  // The signals this process ignores (a script's background job ignores SIGINT and SIGQUIT) and
  // blocks, for the worker to start as this would have; then the forwarding handlers.
  uint64_t ignored = 0;
  for (int sig = 1; sig < 64; ++sig) {
    struct sigaction old {};
    if (::sigaction(sig, nullptr, &old) == 0 && old.sa_handler == SIG_IGN) ignored |= uint64_t{1} << sig;
  }
  sigset_t blocked_set;
  ::sigprocmask(SIG_BLOCK, nullptr, &blocked_set);
  uint64_t blocked = 0;
  for (int sig = 1; sig < 64; ++sig) blocked |= sigismember(&blocked_set, sig) == 1 ? uint64_t{1} << sig : 0;
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) {
    if (ignored & (uint64_t{1} << sig)) continue;  // the worker ignores it too
    struct sigaction sa {};
    sa.sa_handler = forward;
    ::sigaction(sig, &sa, nullptr);
  }

  char cwd[4096];
  if (!::getcwd(cwd, sizeof cwd)) fail("getcwd");
  std::string payload = std::string(cwd) + '\0';
  const mode_t mask = ::umask(0);
  ::umask(mask);
  payload += std::to_string(mask) + '\0';
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource) {
    rlimit limit{};
    if (::getrlimit(resource, &limit) != 0) fail("getrlimit");
    payload += std::to_string(limit.rlim_cur) + '\0' + std::to_string(limit.rlim_max) + '\0';
  }
  payload += std::to_string(ignored) + '\0' + std::to_string(blocked) + '\0';
  payload += std::to_string(argc) + '\0';
  for (int i = 0; i < argc; ++i) payload += std::string(argv[i]) + '\0';
  for (char** e = environ; *e; ++e) payload += std::string(*e) + '\0';
  if (payload.size() > frugal::testing::kServerMaxPayload) {
    errno = E2BIG;
    fail("arguments and environment");
  }

  uint32_t len = static_cast<uint32_t>(payload.size());
  const int fds[3] = {0, 1, 2};
  char control[CMSG_SPACE(sizeof fds)] = {};
  iovec iov{&len, sizeof len};
  msghdr msg{};
  msg.msg_iov = &iov, msg.msg_iovlen = 1, msg.msg_control = control, msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof fds);
  std::memcpy(CMSG_DATA(c), fds, sizeof fds);
  if (::sendmsg(sock, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(sizeof len)) fail("sending the command");
  for (size_t at = 0; at < payload.size();) {
    const ssize_t put = ::send(sock, payload.data() + at, payload.size() - at, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) fail("sending the command");
    at += static_cast<size_t>(put);
  }

  int32_t pid = 0, status = 0;
  if (!read_all(sock, &pid, sizeof pid)) fail("the server did not start the command");
  worker_pid = pid;
  if (pending_signal) ::kill(pid, pending_signal);
  if (!read_all(sock, &status, sizeof status)) fail("the server lost the command");
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    ::signal(sig, SIG_DFL);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    ::sigprocmask(SIG_UNBLOCK, &set, nullptr);
    ::raise(sig);
  }
  return 125;
}
