// frugal_test_server: frugal's command line, started once per test script and forked for each
// command the script runs (tests/support/frugal_server.sh). Loading LibTorch and its libraries is
// most of a short command's time (0.47 s on Debian's 1.13, which pulls in 290 libraries); a fork
// of a process that has loaded them and done nothing else costs milliseconds, and the forked
// worker runs cli::run exactly as a fresh `frugal` would: the client's arguments, working folder,
// environment, umask, resource limits, ignored and blocked signals and standard streams, its exit
// status returned (its nice value and CPU affinity are the server's: a test that sets those runs
// the program itself).
//
//   frugal_test_server --serve SOCKET    listen on SOCKET (a Unix socket path) until SIGTERM
//   frugal_test_server ARGS...           frugal ARGS... (how `frugal train` re-executes itself
//                                        for ranks: /proc/self/exe is this file)
//
// The server never touches LibTorch before forking (no OpenMP pool: fork copies only the calling
// thread), and refuses to serve if a thread started at load time outlives a fork's handlers.
#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "../../apps/frugal/commands.h"
#include "frugal_server.h"

namespace {

using frugal::testing::read_all;

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "frugal_test_server: %s: %s\n", what.c_str(), std::strerror(errno));
  std::_Exit(125);
}

bool write_all(int fd, const void* buf, size_t n) {
  const auto* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t put = ::send(fd, p, n, MSG_NOSIGNAL);
    if (put < 0 && errno == EINTR) continue;
    if (put <= 0) return false;
    p += put, n -= static_cast<size_t>(put);
  }
  return true;
}

int threads_of_this_process() {
  DIR* d = ::opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  while (const dirent* e = ::readdir(d)) n += e->d_name[0] != '.';
  ::closedir(d);
  return n;
}

struct Request {
  int fds[3] = {-1, -1, -1};
  std::string cwd;
  mode_t umask = 022;
  uint64_t ignored = 0, blocked = 0;  // bit s: signal s
  std::vector<rlimit> limits;
  std::vector<std::string> args, env;
};

// The client's one message: three descriptors and the payload (frugal_server.h).
bool receive(int sock, Request& r) {
  uint32_t len = 0;
  char control[CMSG_SPACE(3 * sizeof(int))] = {};
  iovec iov{&len, sizeof len};
  msghdr msg{};
  msg.msg_iov = &iov, msg.msg_iovlen = 1, msg.msg_control = control, msg.msg_controllen = sizeof control;
  ssize_t got;
  do got = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_WAITALL);
  while (got < 0 && errno == EINTR);
  if (got != static_cast<ssize_t>(sizeof len)) return false;
  const cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (!c || c->cmsg_type != SCM_RIGHTS || c->cmsg_len != CMSG_LEN(3 * sizeof(int))) return false;
  std::memcpy(r.fds, CMSG_DATA(c), sizeof r.fds);
  if (len == 0 || len > frugal::testing::kServerMaxPayload) return false;
  std::string payload(len, '\0');
  if (!read_all(sock, &payload[0], len) || payload.back() != '\0') return false;
  std::vector<std::string> parts;
  for (size_t at = 0; at < payload.size();) {
    const size_t end = payload.find('\0', at);
    parts.emplace_back(payload, at, end - at);
    at = end + 1;
  }
  size_t at = 0;
  r.cwd = parts[at++];
  r.umask = static_cast<mode_t>(std::strtoul(parts[at++].c_str(), nullptr, 10));
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource, at += 2) {
    if (at + 1 >= parts.size()) return false;
    r.limits.push_back({std::strtoull(parts[at].c_str(), nullptr, 10), std::strtoull(parts[at + 1].c_str(), nullptr, 10)});
  }
  if (at + 2 >= parts.size()) return false;
  r.ignored = std::strtoull(parts[at++].c_str(), nullptr, 10);
  r.blocked = std::strtoull(parts[at++].c_str(), nullptr, 10);
  const unsigned long argc = std::strtoul(parts[at++].c_str(), nullptr, 10);
  if (argc == 0 || argc > parts.size() - at) return false;
  r.args.assign(parts.begin() + static_cast<long>(at), parts.begin() + static_cast<long>(at + argc));
  r.env.assign(parts.begin() + static_cast<long>(at + argc), parts.end());
  return true;
}

// In the forked worker: become the client's command, run it, exit with its code.
[[noreturn]] void run_command(const Request& r, int sock) {
  ::close(sock);
  for (int i = 0; i < 3; ++i)
    if (::dup2(r.fds[i], i) < 0) die("dup2");
  for (int fd : r.fds)
    if (fd > 2) ::close(fd);
  if (::chdir(r.cwd.c_str()) != 0) die("chdir " + r.cwd);
  ::umask(r.umask);
  for (int resource = 0; resource < RLIM_NLIMITS; ++resource) {
    if (::setrlimit(resource, &r.limits[static_cast<size_t>(resource)]) != 0)
      die("the client's resource limit " + std::to_string(resource));
  }
  // The client's signal dispositions (ignored or default: it had no handler the command could
  // inherit through exec either) and mask.
  sigset_t mask;
  sigemptyset(&mask);
  for (int sig = 1; sig < 64; ++sig) {
    if (sig == SIGKILL || sig == SIGSTOP) continue;
    ::signal(sig, (r.ignored >> sig) & 1 ? SIG_IGN : SIG_DFL);
    if ((r.blocked >> sig) & 1) sigaddset(&mask, sig);
  }
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  ::clearenv();
  for (const auto& e : r.env) ::putenv(::strdup(e.c_str()));
  std::vector<char*> argv;
  for (const auto& a : r.args) argv.push_back(::strdup(a.c_str()));
  argv.push_back(nullptr);
  const int code = frugal::cli::run(static_cast<int>(r.args.size()), argv.data());
  // The streams flushed, then out without the static destructors: LibTorch's unregister its tens
  // of thousands of operator kernels, 80 ms a process (in copied-on-write pages here). frugal
  // registers nothing to run at exit: its cleanup is done in scopes, before cli::run returns.
  std::cout.flush(), std::cerr.flush(), std::clog.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

// One connection: fork the worker, report its pid, then wait for it to end (its status to the
// client) or for the client to go away (the worker killed: as if the client had been the command).
[[noreturn]] void serve_connection(int sock) {
  ::signal(SIGCHLD, SIG_DFL);
  Request r;
  if (!receive(sock, r)) std::_Exit(125);
  sigset_t chld;
  sigemptyset(&chld);
  sigaddset(&chld, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &chld, nullptr);
  const int sfd = ::signalfd(-1, &chld, SFD_CLOEXEC);
  if (sfd < 0) die("signalfd");
  const pid_t worker = ::fork();
  if (worker < 0) die("fork");
  if (worker == 0) {
    ::close(sfd);
    run_command(r, sock);
  }
  for (int fd : r.fds) ::close(fd);
  const int32_t pid = worker;
  if (!write_all(sock, &pid, sizeof pid)) ::kill(worker, SIGKILL);
  int status = 0;
  for (;;) {
    pollfd p[2] = {{sfd, POLLIN, 0}, {sock, POLLIN, 0}};
    if (::poll(p, 2, -1) < 0 && errno != EINTR) die("poll");
    const pid_t done = ::waitpid(worker, &status, WNOHANG);
    if (done == worker) break;
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      char byte;
      const ssize_t got = ::recv(sock, &byte, 1, MSG_DONTWAIT);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {  // gone: the client was killed
        ::kill(worker, SIGKILL);
        ::waitpid(worker, &status, 0);
        std::_Exit(0);
      }
    }
    if (p[0].revents & POLLIN) {
      signalfd_siginfo info;
      (void)!::read(sfd, &info, sizeof info);
    }
  }
  const int32_t s = status;
  write_all(sock, &s, sizeof s);
  std::_Exit(0);
}

[[noreturn]] void serve(const char* path) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the test script is gone: so is its server
  // A library's thread pool started at load time (OpenBLAS's) is shut down by its fork handlers and
  // restarts in whichever process calls it next: one fork runs the handlers. A thread still running
  // after that would be missing in the workers.
  const pid_t probe = ::fork();
  if (probe == 0) std::_Exit(0);
  if (probe < 0 || ::waitpid(probe, nullptr, 0) != probe) die("fork");
  if (threads_of_this_process() != 1) {
    std::fprintf(stderr, "frugal_test_server: %d threads after loading; forking would lose them\n", threads_of_this_process());
    std::_Exit(125);
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  const int listener = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) die("socket");
  // Bound under a temporary name and renamed once listening: a client that sees the path connects.
  const std::string temp = std::string(path) + ".tmp";
  if (temp.size() >= sizeof addr.sun_path) {
    std::fprintf(stderr, "frugal_test_server: socket path too long: %s\n", path);
    std::_Exit(125);
  }
  std::strcpy(addr.sun_path, temp.c_str());
  ::unlink(temp.c_str());
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) die("bind " + temp);
  if (::listen(listener, 64) != 0) die("listen");
  if (::rename(temp.c_str(), path) != 0) die(std::string("rename to ") + path);
  ::signal(SIGCHLD, SIG_IGN);  // connections' processes reap themselves
  for (;;) {
    const int sock = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (sock < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      die("accept");
    }
    const pid_t child = ::fork();
    if (child == 0) {
      ::close(listener);
      ::prctl(PR_SET_PDEATHSIG, 0);
      serve_connection(sock);
    }
    ::close(sock);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && !std::strcmp(argv[1], "--serve")) serve(argv[2]);
  return frugal::cli::run(argc, argv);
}
