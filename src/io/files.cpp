#include "frugal/io/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "frugal/io/units.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

namespace frugal {
namespace io {
namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a folder";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISLNK(mode)) return "a symbolic link";
  return "not a regular file";
}

std::string named(const std::string& what, const std::string& path) { return (what.empty() ? "" : what + " ") + printable(path, 4096); }

[[noreturn]] void refuse_kind(const std::string& what, const std::string& path, mode_t mode) {
  const std::string kind = kind_of(mode);
  throw std::invalid_argument(named(what, path) + " is " + kind + (kind == "not a regular file" ? "" : ", not a regular file"));
}

// ---- Removal with system calls only: no allocation, no stdio, no opendir (which mallocs), so a
// signal handler may run it. getdents64 fills a buffer on the stack; the folder is read again from
// its start until a pass removes nothing (removing entries while reading a folder may skip some).

struct LinuxDirent64 {
  ino64_t d_ino;
  off64_t d_off;
  unsigned short d_reclen;
  unsigned char d_type;
  char d_name[1];
};

constexpr int kMaxRemoveDepth = 64;  // folders nested deeper are left in place

void empty_folder(int fd, int depth);

// Removes `name` in the folder `dir_fd` (a file, a link, or a folder with everything under it).
bool remove_at(int dir_fd, const char* name, int depth) {
  if (::unlinkat(dir_fd, name, 0) == 0) return true;
  if (errno == ENOENT) return false;
  if (errno != EISDIR && errno != EPERM) return false;
  if (depth >= kMaxRemoveDepth) return false;
  const int fd = ::openat(dir_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return false;
  empty_folder(fd, depth + 1);
  ::close(fd);
  return ::unlinkat(dir_fd, name, AT_REMOVEDIR) == 0;
}

void empty_folder(int fd, int depth) {
  alignas(8) char buf[1024];
  for (int pass = 0; pass < 1000; ++pass) {
    if (::lseek(fd, 0, SEEK_SET) != 0) return;
    bool removed = false;
    for (;;) {
      const long n = ::syscall(SYS_getdents64, fd, buf, sizeof(buf));
      if (n <= 0) break;
      for (long at = 0; at < n;) {
        const auto* d = reinterpret_cast<const LinuxDirent64*>(buf + at);
        at += d->d_reclen;
        const char* name = d->d_name;
        if (name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'))) continue;
        removed |= remove_at(fd, name, depth);
      }
    }
    if (!removed) return;
  }
}

void remove_path(const char* path) {
  if (::unlink(path) == 0 || errno == ENOENT) return;
  const int fd = ::open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return;
  empty_folder(fd, 0);
  ::close(fd);
  ::rmdir(path);
}

// ---- The registry of live temporary folders, read by the signal handler. A slot's path and owner
// are written before its state says live (release), and read after the handler sees it live
// (acquire); lock-free atomics are safe in a signal handler.

constexpr int kFree = 0, kClaimed = 1, kLive = 2;
constexpr int kSlots = 64;
struct Slot {
  std::atomic<int> state{kFree};
  pid_t owner = 0;
  char path[PATH_MAX] = {};
};
static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");
Slot g_slots[kSlots];

constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};

extern "C" void remove_temp_dirs_then_die(int sig) {
  const int saved = errno;
  const pid_t self = ::getpid();
  for (Slot& s : g_slots) {
    if (s.state.load(std::memory_order_acquire) == kLive && s.owner == self) remove_path(s.path);
  }
  // The default action, so the process ends as the signal says (its exit status shows it).
  ::signal(sig, SIG_DFL);
  ::raise(sig);  // pending until the handler returns (the signal is blocked while it runs)
  errno = saved;
}

void install_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int sig : kSignals) {
      struct sigaction old {};
      if (::sigaction(sig, nullptr, &old) != 0) continue;
      if ((old.sa_flags & SA_SIGINFO) || old.sa_handler != SIG_DFL) continue;  // ignored, or someone else's
      struct sigaction sa {};
      sa.sa_handler = remove_temp_dirs_then_die;
      sigemptyset(&sa.sa_mask);
      for (int s : kSignals) sigaddset(&sa.sa_mask, s);
      sa.sa_flags = SA_RESTART;
      ::sigaction(sig, &sa, nullptr);
    }
  });
}

// Blocks the three signals in this thread for a scope (a folder is never made and left unregistered).
class BlockSignals {
 public:
  BlockSignals() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : kSignals) sigaddset(&set, s);
    ::pthread_sigmask(SIG_BLOCK, &set, &old_);
  }
  ~BlockSignals() { ::pthread_sigmask(SIG_SETMASK, &old_, nullptr); }

 private:
  sigset_t old_;
};

bool pid_is_dead(const std::string& digits) {
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(digits));
  return pid > 0 && pid != ::getpid() && ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace

// ---- Reading

ReadableFile::~ReadableFile() { close(); }

ReadableFile::ReadableFile(ReadableFile&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      size_(other.size_),
      offset_(other.offset_),
      path_(std::move(other.path_)),
      what_(std::move(other.what_)) {}

ReadableFile& ReadableFile::operator=(ReadableFile&& other) noexcept {
  if (this != &other) {
    close();
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
    offset_ = other.offset_;
    path_ = std::move(other.path_);
    what_ = std::move(other.what_);
  }
  return *this;
}

void ReadableFile::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

size_t ReadableFile::read(void* buf, size_t n) {
  if (fd_ < 0 || offset_ >= size_) return 0;
  n = static_cast<size_t>(std::min<uint64_t>(n, size_ - offset_));
  for (;;) {
    const ssize_t got = ::read(fd_, buf, n);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw std::invalid_argument(named(what_, path_) + " cannot be read: " + std::strerror(errno));
    offset_ += static_cast<uint64_t>(got);
    return static_cast<size_t>(got);
  }
}

ReadableFile open_regular_file(const std::string& path, const std::string& what) {
  // Looked at before it is opened (a device is not even opened), and again after, on the
  // descriptor (the path may have changed in between). O_NONBLOCK: an open of a FIFO returns at once.
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) throw std::invalid_argument(named(what, path) + " does not exist");
    throw std::invalid_argument(named(what, path) + " cannot be read: " + std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) refuse_kind(what, path, st.st_mode);
  ReadableFile f;
  f.path_ = path;
  f.what_ = what;
  f.fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (f.fd_ < 0) throw std::invalid_argument(named(what, path) + " cannot be opened: " + std::strerror(errno));
  if (::fstat(f.fd_, &st) != 0) throw std::invalid_argument(named(what, path) + " cannot be read: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode)) refuse_kind(what, path, st.st_mode);
  if (st.st_size == 0) {
    // Empty, or a file whose size the system does not know (/proc, /sys): a byte read at offset 0
    // (still non-blocking) tells them apart, and an error reading it is said here.
    char probe;
    const ssize_t n = ::pread(f.fd_, &probe, 1, 0);
    if (n < 0) throw std::invalid_argument(named(what, path) + " cannot be read: " + std::strerror(errno));
    if (n > 0) {
      throw std::invalid_argument(named(what, path) +
                                  " has no size the system knows (a file such as those under /proc); copy it to a regular file");
    }
  }
  const int flags = ::fcntl(f.fd_, F_GETFL);
  if (flags < 0 || ::fcntl(f.fd_, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    throw std::invalid_argument(named(what, path) + " cannot be opened: " + std::strerror(errno));
  }
  f.size_ = static_cast<uint64_t>(st.st_size);
  return f;
}

std::string read_file(const std::string& path, uint64_t max_bytes, const std::string& what) {
  ReadableFile f = open_regular_file(path, what);
  if (f.size() > max_bytes) {
    throw std::invalid_argument(named(what, path) + " is " + std::to_string(f.size()) + " bytes, more than the " +
                                std::to_string(max_bytes) + " (" + human_bytes(static_cast<int64_t>(max_bytes)) +
                                ") frugal reads of a file of its kind");
  }
  std::string out(static_cast<size_t>(f.size()), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const size_t n = f.read(&out[got], out.size() - got);
    if (n == 0) break;  // it shrank
    got += n;
  }
  out.resize(got);
  return out;
}

namespace {

// The length of a valid UTF-8 sequence at p (n bytes left) that is no control character (C1
// controls U+0080-U+009F included), or 0.
size_t printable_utf8(const unsigned char* p, size_t n) {
  const unsigned char c = p[0];
  size_t len = 0;
  uint32_t cp = 0;
  if (c >= 0xC2 && c <= 0xDF)
    len = 2, cp = c & 0x1F;
  else if (c >= 0xE0 && c <= 0xEF)
    len = 3, cp = c & 0x0F;
  else if (c >= 0xF0 && c <= 0xF4)
    len = 4, cp = c & 0x07;
  else
    return 0;
  if (len > n) return 0;
  for (size_t i = 1; i < len; ++i) {
    if ((p[i] & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (p[i] & 0x3F);
  }
  const bool overlong = (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000);
  if (overlong || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF) || (cp >= 0x80 && cp <= 0x9F)) return 0;
  return len;
}

}  // namespace

std::string printable(const std::string& bytes, size_t max_bytes) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = std::min(bytes.size(), max_bytes);
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
    } else if (const size_t len = c >= 0x80 ? printable_utf8(p + i, n - i) : 0) {
      out.append(bytes, i, len);  // a character of a name or a text, kept as it is
      i += len;
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
      ++i;
    }
  }
  if (bytes.size() > max_bytes) out += "...";
  return out;
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

int64_t free_space(const std::string& path) {
  std::string at = path.empty() ? "." : path;
  for (;;) {
    struct statvfs fs {};
    if (::statvfs(at.c_str(), &fs) == 0) {
      const double bytes = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
      return bytes >= 9.0e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(bytes);
    }
    if (errno != ENOENT && errno != ENOTDIR) return -1;
    while (at.size() > 1 && at.back() == '/') at.pop_back();  // "a/b/" is "a/b"
    const size_t slash = at.find_last_of('/');
    if (slash == std::string::npos) {
      if (at == ".") return -1;
      at.assign(1, '.');  // a relative path's first part: the working folder's file system
    } else if (slash == 0) {
      if (at == "/") return -1;
      at.assign(1, '/');
    } else {
      at.resize(slash);
    }
  }
}

void make_directories(const std::string& dir) {
  if (dir.empty()) return;
  std::string partial = dir[0] == '/' ? "/" : "";
  std::stringstream parts(dir);
  std::string piece;
  while (std::getline(parts, piece, '/')) {
    if (piece.empty()) continue;
    partial += piece + "/";
    ::mkdir(partial.c_str(), 0755);
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw std::runtime_error("cannot create folder " + dir);
}

void remove_tree(const std::string& path) { remove_path(path.c_str()); }

// ---- Temporary folders

std::string TempDir::base() {
  const char* t = std::getenv("TMPDIR");
  std::string b = t && *t ? t : "/tmp";
  while (b.size() > 1 && b.back() == '/') b.pop_back();
  return b;
}

TempDir::TempDir(const std::string& prefix) : owner_(::getpid()) {
  install_handlers();
  const std::string dir = base();
  remove_stale(prefix, dir);
  std::string templ = dir + "/" + prefix + "-" + std::to_string(owner_) + "-XXXXXX";
  if (templ.size() >= PATH_MAX) throw std::runtime_error("the temporary folder's path under " + dir + " is too long");
  for (int i = 0; i < kSlots && slot_ < 0; ++i) {
    int expected = kFree;
    if (g_slots[i].state.compare_exchange_strong(expected, kClaimed)) slot_ = i;
  }
  if (slot_ < 0) throw std::runtime_error("more than " + std::to_string(kSlots) + " temporary folders at once");
  {
    const BlockSignals blocked;  // made and registered as one step
    if (!::mkdtemp(&templ[0])) {
      const int err = errno;
      g_slots[slot_].state.store(kFree, std::memory_order_release);
      throw std::runtime_error("cannot create a temporary folder in " + dir + " (" + std::strerror(err) + "); set TMPDIR elsewhere");
    }
    Slot& s = g_slots[slot_];
    std::memcpy(s.path, templ.c_str(), templ.size() + 1);
    s.owner = owner_;
    s.state.store(kLive, std::memory_order_release);
  }
  path_ = templ;
}

TempDir::~TempDir() {
  if (::getpid() != owner_) return;  // a forked child's copy: the folder is its parent's
  remove_tree(path_);
  g_slots[slot_].state.store(kFree, std::memory_order_release);
}

int TempDir::remove_stale(const std::string& prefix, const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (!d) return 0;
  const std::string start = prefix + "-";
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n.rfind(start, 0) != 0) continue;
    const std::string rest = n.substr(start.size());  // <pid>-XXXXXX
    const auto dash = rest.find('-');
    if (dash == std::string::npos || rest.size() != dash + 7 || !pid_is_dead(rest.substr(0, dash))) continue;
    struct stat st {};
    const std::string p = dir + "/" + n;
    if (::lstat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) stale.push_back(p);
  }
  ::closedir(d);
  for (const auto& p : stale) remove_tree(p);
  return static_cast<int>(stale.size());
}

std::string parent_path(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

std::vector<std::string> helper_candidates(const char* env, const std::string& file) {
  std::vector<std::string> out;
  if (const char* e = std::getenv(env)) out.push_back(e);
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  const std::string dir = n > 0 ? parent_path(std::string(buf, static_cast<size_t>(n))) : "";
  out.push_back((dir.empty() ? "." : dir) + "/" + file);
  out.push_back(std::string(FRUGAL_HELPER_DIR) + "/" + file);  // the build folder
  return out;
}

}  // namespace io
}  // namespace frugal
