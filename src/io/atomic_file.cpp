#include "frugal/io/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace frugal {
namespace io {
namespace {

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw std::runtime_error(what + " " + path + ": " + std::strerror(errno));
}

std::string parent_dir(const std::string& path) {
  const auto slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

// The test hook of atomic_file.h, read once.
void kill_if_testing_after(const std::string& path) {
  static const std::string marker = [] {
    const char* v = std::getenv("FRUGAL_TEST_KILL_AFTER_WRITING");
    return std::string(v ? v : "");
  }();
  if (!marker.empty() && path.find(marker) != std::string::npos) ::raise(SIGKILL);
}

}  // namespace

void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp.XXXXXX") {
  fd_ = ::mkstemp(&tmp_[0]);
  if (fd_ < 0) fail("cannot create a temporary file next to", path_);
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) {
    ::close(fd_);
    ::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::write(fd_, p + done, bytes - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("cannot write", tmp_);
    }
    done += static_cast<size_t>(n);
  }
}

void AtomicFileWriter::write_at(uint64_t offset, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(fd_, p + done, bytes - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail("cannot write", tmp_);
    }
    done += static_cast<size_t>(n);
  }
}

void AtomicFileWriter::truncate(uint64_t bytes) {
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0 || ::lseek(fd_, static_cast<off_t>(bytes), SEEK_SET) < 0) {
    fail("cannot truncate", tmp_);
  }
}

void AtomicFileWriter::commit() {
  if (::fchmod(fd_, 0644) != 0 || ::fsync(fd_) != 0) fail("cannot flush", tmp_);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    ::unlink(tmp_.c_str());
    fail("cannot close", tmp_);
  }
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    ::unlink(tmp_.c_str());
    fail("cannot rename the temporary file onto", path_);
  }
  sync_directory(parent_dir(path_));
  kill_if_testing_after(path_);
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  AtomicFileWriter w(path);
  w.write(contents.data(), contents.size());
  w.commit();
}

}  // namespace io
}  // namespace frugal
