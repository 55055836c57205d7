#include "state_window.h"

#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace frugal {
namespace optim {
namespace detail {

namespace {

// Whole reads and writes: the kernel may move fewer bytes than asked (signals, large requests).
int read_all(int fd, uint8_t* p, size_t bytes, size_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;  // the files are sized for every chunk: a short file is damage
    p += n, bytes -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
  return 0;
}

// A chunk's bytes: copied from the page cache where they were read ahead into it (cached), else
// read from the disk straight into the buffer through direct_fd (the file opened O_DIRECT, or -1),
// so that reading the state costs neither page-cache pages nor a copy. Direct reads need the
// page's alignment: the chunks and the buffers have it (whole pages); elsewhere reads are buffered.
int read_chunk(int fd, int direct_fd, bool cached, uint8_t* p, size_t bytes, size_t offset) {
  if (cached || direct_fd < 0 || (offset | bytes | reinterpret_cast<uintptr_t>(p)) % kPage != 0) return read_all(fd, p, bytes, offset);
  return read_all(direct_fd, p, bytes, offset);
}

int write_all(int fd, const uint8_t* p, size_t bytes, size_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    p += n, bytes -= static_cast<size_t>(n), offset += static_cast<size_t>(n);
  }
  return 0;
}

[[noreturn]] void throw_io(const char* what, int err) {
  throw std::runtime_error(std::string("optimizer state: ") + what + " a chunk of a state file failed: " + std::strerror(err));
}

}  // namespace

WindowPool& WindowPool::get() {
  static WindowPool* pool = new WindowPool();  // never destroyed: its threads may outlive static destructors
  return *pool;
}

bool& WindowPool::direct_io() {
  static bool on = true;
  return on;
}

int WindowPool::find(int fd, size_t first) const {
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.use != Use::free && s.fd == fd && s.first == first) return static_cast<int>(i);
  }
  return -1;
}

int WindowPool::reclaimable(bool take_ready) const {
  // A free slot, else the written one longest untouched; the reader stops there. An acquire may
  // also take the chunk read ahead last (the one needed latest).
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.capacity < slot_bytes_) continue;  // being grown
    if (s.use == Use::free) return static_cast<int>(i);
    if (s.use == Use::clean && (best < 0 || slots_[static_cast<size_t>(best)].stamp > s.stamp)) best = static_cast<int>(i);
  }
  if (best >= 0 || !take_ready) return best;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (s.use == Use::ready && s.capacity >= slot_bytes_ && (best < 0 || slots_[static_cast<size_t>(best)].stamp < s.stamp))
      best = static_cast<int>(i);
  }
  return best;
}

void WindowPool::take(Slot& s, int fd, size_t first, size_t bytes, Use use) {
  s.fd = fd, s.first = first, s.bytes = bytes, s.use = use, s.stamp = ++clock_, s.error = 0;
}

int WindowPool::direct_fd_of(int fd) const {
  const auto file = std::find_if(attached_.begin(), attached_.end(), [&](const std::pair<int, int>& a) { return a.first == fd; });
  return file != attached_.end() && file->second != fd ? file->second : -1;
}

void WindowPool::start_threads() {
  if (reader_.joinable()) return;
  reader_ = std::thread([this] { read_loop(); });
  writer_ = std::thread([this] { write_loop(); });
}

void WindowPool::wait_for_io(std::unique_lock<std::mutex>& lock, int fd) {
  changed_.wait(lock, [&] {
    return std::none_of(slots_.begin(), slots_.end(),
                        [&](const Slot& s) { return (s.use == Use::reading || s.use == Use::writing) && (fd < 0 || s.fd == fd); });
  });
}

void WindowPool::resize_slots(std::unique_lock<std::mutex>& lock, size_t bytes) {
  resizing_ = true;  // the reader takes no slot meanwhile
  // Every read and write done, and no update at hand (one on another thread: data-parallel ranks
  // as threads; a state file is made before its own updates, never within one).
  changed_.wait(lock, [&] {
    return std::none_of(slots_.begin(), slots_.end(),
                        [](const Slot& s) { return s.use == Use::reading || s.use == Use::writing || s.use == Use::in_use; });
  });
  for (Slot& s : slots_) {
    if (s.mem) {
      c10::reportMemoryUsageToProfiler(s.mem, -static_cast<int64_t>(s.capacity), 0, 0, c10::Device(c10::kCPU));
      ::munmap(s.mem, s.capacity);
    }
    s = Slot();
    if (bytes == 0) continue;
    // Anonymous pages, touched now: the window is resident from here on, as the tracker is told.
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (p == MAP_FAILED) {
      // No window rather than part of one (a buffer left empty would never come free): every later
      // acquire refuses, as a chunk larger than the buffers.
      for (Slot& made : slots_) {
        if (made.mem) {
          c10::reportMemoryUsageToProfiler(made.mem, -static_cast<int64_t>(made.capacity), 0, 0, c10::Device(c10::kCPU));
          ::munmap(made.mem, made.capacity);
        }
        made = Slot();
      }
      slot_bytes_ = 0;
      resizing_ = false;
      changed_.notify_all();
      throw std::runtime_error("optimizer state: cannot allocate the window's " + std::to_string(bytes) + "-byte buffers");
    }
    s.mem = static_cast<uint8_t*>(p);
    s.capacity = bytes;
    c10::reportMemoryUsageToProfiler(s.mem, static_cast<int64_t>(bytes), 0, 0, c10::Device(c10::kCPU));
  }
  slot_bytes_ = bytes;
  resizing_ = false;
  changed_.notify_all();
}

void WindowPool::attach(int fd, int direct_fd, size_t slot_bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  start_threads();
  attached_.emplace_back(fd, direct_fd);
  if (slot_bytes > slot_bytes_) resize_slots(lock, slot_bytes);
}

void WindowPool::detach(int fd) {
  std::unique_lock<std::mutex> lock(mutex_);
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [fd](const Key& k) { return k.fd == fd; }), queue_.end());
  wait_for_io(lock, fd);
  for (Slot& s : slots_) {
    if (s.fd == fd && s.use != Use::free) s.use = Use::free, s.fd = -1;
  }
  attached_.erase(std::remove_if(attached_.begin(), attached_.end(), [fd](const std::pair<int, int>& a) { return a.first == fd; }),
                  attached_.end());
  in_cache_.erase(in_cache_.lower_bound({fd, 0}), in_cache_.upper_bound({fd, SIZE_MAX}));
  if (attached_.empty()) resize_slots(lock, 0);
  changed_.notify_all();
}

void WindowPool::settle(int fd) {
  std::unique_lock<std::mutex> lock(mutex_);
  queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [fd](const Key& k) { return k.fd == fd; }), queue_.end());
  wait_for_io(lock, fd);
  if (write_error_) throw_io("writing", write_error_);
  for (Slot& s : slots_) {
    TORCH_CHECK(!(s.fd == fd && s.use == Use::in_use), "optimizer state: a state file was read during its update");
    if (s.fd == fd && s.use != Use::free) s.use = Use::free, s.fd = -1;
  }
  changed_.notify_all();
}

uint8_t* WindowPool::acquire(int fd, size_t first, size_t bytes) {
  std::unique_lock<std::mutex> lock(mutex_);
  TORCH_CHECK(bytes <= slot_bytes_, "optimizer state: a chunk larger than the window's buffers");
  if (write_error_) throw_io("writing", write_error_);
  for (;;) {
    const int i = find(fd, first);
    if (i >= 0) {
      Slot& s = slots_[static_cast<size_t>(i)];
      if (s.use == Use::ready || s.use == Use::clean) {
        if (s.error) {
          const int err = s.error;
          s.use = Use::free, s.fd = -1, s.error = 0;
          throw_io("reading", err);
        }
        s.use = Use::in_use;
        return s.mem;
      }
      TORCH_CHECK(s.use != Use::in_use, "optimizer state: a chunk acquired twice");
      changed_.wait(lock);  // its read or its write is under way
      continue;
    }
    queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [&](const Key& k) { return k.fd == fd && k.first == first; }), queue_.end());
    const int r = reclaimable(/*take_ready=*/true);
    if (r < 0) {
      changed_.wait(lock);  // every slot is being read or written
      continue;
    }
    Slot& s = slots_[static_cast<size_t>(r)];
    take(s, fd, first, bytes, Use::reading);
    const int direct_fd = direct_fd_of(fd);
    const bool cached = in_cache_.erase({fd, first}) > 0;
    lock.unlock();
    const int err = read_chunk(fd, direct_fd, cached, s.mem, bytes, first);
    lock.lock();
    s.use = err ? Use::free : Use::in_use;
    changed_.notify_all();
    if (err) throw_io("reading", err);
    return s.mem;
  }
}

void WindowPool::release(int fd, size_t first) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const int i = find(fd, first);
    TORCH_CHECK(i >= 0 && slots_[static_cast<size_t>(i)].use == Use::in_use, "optimizer state: released a chunk not acquired");
    slots_[static_cast<size_t>(i)].use = Use::writing;
    writes_.push_back(i);
    in_cache_.erase({fd, first});  // read into the cache while in the slot: the write drops those pages
  }
  changed_.notify_all();
}

void WindowPool::read_ahead(int fd, size_t first, size_t bytes, size_t chunk_bytes, bool urgent) {
  if (chunk_bytes == 0) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<Key> keys;
    for (size_t at = first; at < first + bytes; at += chunk_bytes) {
      if (find(fd, at) >= 0) continue;
      const auto queued = std::find_if(queue_.begin(), queue_.end(), [&](const Key& k) { return k.fd == fd && k.first == at; });
      if (queued != queue_.end()) {
        if (!urgent) continue;
        queue_.erase(queued);
      }
      keys.push_back({fd, at, std::min(chunk_bytes, first + bytes - at)});
    }
    if (urgent) {
      queue_.insert(queue_.begin(), keys.begin(), keys.end());
    } else {
      queue_.insert(queue_.end(), keys.begin(), keys.end());
    }
  }
  changed_.notify_all();
}

void WindowPool::cached(int fd, size_t first, size_t bytes, size_t chunk_bytes) {
  if (chunk_bytes == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  for (size_t at = first; at < first + bytes; at += chunk_bytes) in_cache_.insert({fd, at});
}

int64_t WindowPool::resident_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(slot_bytes_ * slots_.size());
}

int WindowPool::ready_slots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int>(std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.use == Use::ready; }));
}

void WindowPool::read_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    int r = -1;
    changed_.wait(lock, [&] { return !resizing_ && !queue_.empty() && (r = reclaimable(/*take_ready=*/false)) >= 0; });
    const Key key = queue_.front();
    queue_.pop_front();
    if (find(key.fd, key.first) >= 0) continue;
    Slot& s = slots_[static_cast<size_t>(r)];
    take(s, key.fd, key.first, key.bytes, Use::reading);
    const int direct_fd = direct_fd_of(key.fd);
    const bool cached = in_cache_.erase({key.fd, key.first}) > 0;
    lock.unlock();
    const int err = read_chunk(key.fd, direct_fd, cached, s.mem, key.bytes, key.first);
    lock.lock();
    s.use = Use::ready;
    s.error = err;  // acquire reports it
    changed_.notify_all();
  }
}

void WindowPool::write_loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return !writes_.empty(); });
    Slot& s = slots_[static_cast<size_t>(writes_.front())];
    writes_.pop_front();
    const int direct_fd = direct_fd_of(s.fd);
    const int write_fd = direct_fd >= 0 ? direct_fd : s.fd;
    lock.unlock();
    const int err = write_all(write_fd, s.mem, s.bytes, s.first);
    // Buffered: the writing back starts now rather than when the kernel gets to it.
    if (!err && write_fd == s.fd) ::sync_file_range(s.fd, static_cast<off_t>(s.first), static_cast<off_t>(s.bytes), SYNC_FILE_RANGE_WRITE);
    lock.lock();
    s.stamp = ++clock_;
    s.use = Use::clean;
    if (err && !write_error_) write_error_ = err;
    changed_.notify_all();
  }
}

}  // namespace detail
}  // namespace optim
}  // namespace frugal
