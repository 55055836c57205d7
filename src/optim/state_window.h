// src/optim/state_window.h — file placement's resident window (internal to frugal_core).
//
// A fixed set of kStateWindowSlots page-aligned buffers ("slots") that chunks of the state files
// are read into before their update and written back from after it, by explicit reads and writes
// (pread/pwrite: no mapping of the state's pages, so none of the kernel's page-table work a page at
// a time). Where the file was also opened O_DIRECT, reads and writes bypass the page cache (the
// writes drop pages read before): the state costs no page-cache pages and no copy, except the
// chunks the caller read into the cache ahead of the window (readahead, then cached()), which are
// copied from there. Elsewhere (tmpfs) reads and writes are buffered, and the writing back started
// at once. A reader thread reads queued chunks ahead into free slots, in the order asked; a writer
// thread writes released ones back. The slots are allocated, touched and shown to the tracker once
// (attach), so what the window holds is the same from step to step.
//
// A chunk is keyed by its file and first byte; a key is in at most one slot, so a read of a chunk
// can never overtake the write of the same chunk (the slot is reused only once its write is done).
//
//   WindowPool& pool = WindowPool::get();
//   pool.attach(fd, direct_fd, slot_bytes);          // direct_fd: fd, or the file opened O_DIRECT
//   pool.read_ahead(fd, 0, bytes, /*urgent=*/false);   // returns at once
//   uint8_t* chunk = pool.acquire(fd, 0, bytes);       // waits for the read if it is not done
//   ... update chunk ...;
//   pool.release(fd, 0);                               // the write is posted; returns at once
//   pool.detach(fd);                                   // before the file is closed
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "frugal/optim/state_buffer.h"

namespace frugal {
namespace optim {
namespace detail {

// The page the state files' chunks and the window's buffers are aligned to (and direct I/O needs).
constexpr size_t kPage = 4096;

class WindowPool {
 public:
  static WindowPool& get();

  // A windowed buffer's file `fd`, with direct_fd the same file opened O_DIRECT (or fd itself): its
  // chunks take at most slot_bytes (a multiple of the page). Grows every slot to that size when it
  // is larger than the slots are (waiting for their I/O); the new memory is reported to the
  // tracker on the calling thread.
  void attach(int fd, int direct_fd, size_t slot_bytes);
  // Forgets fd: its queued reads are dropped, its I/O waited for, its slots freed. The last detach
  // frees the slots' memory.
  void detach(int fd);
  // Waits until the file holds every write of fd's chunks and no slot holds them (before the file
  // is read or written another way: a checkpoint's copy, a restore, the mapped path).
  void settle(int fd);
  // The chunk [first, first + bytes) of fd in a slot, in use until release: taken from the slot
  // read ahead (waiting for the read if it is under way) or read now.
  uint8_t* acquire(int fd, size_t first, size_t bytes);
  // The chunk is updated: its write is posted, and the slot is free once it is done.
  void release(int fd, size_t first);
  // Queues the chunks of [first, first + bytes) (chunk_bytes each) for reading ahead: urgent ones
  // before the rest. Chunks already in a slot or queued are left where they are.
  void read_ahead(int fd, size_t first, size_t bytes, size_t chunk_bytes, bool urgent);
  // The chunks of [first, first + bytes) are being read into the page cache (the caller posted it):
  // their next read, unless they are written first, copies them from there rather than reading the
  // disk again.
  void cached(int fd, size_t first, size_t bytes, size_t chunk_bytes);
  // Bytes of the slots (kStateWindowSlots times the largest attached chunk).
  int64_t resident_bytes() const;
  // How many slots hold a chunk read ahead and not yet acquired (tests).
  int ready_slots() const;
  // Whether files are opened for direct writes (tests turn it off to check buffered writes).
  static bool& direct_io();

 private:
  enum class Use { free, reading, ready, in_use, writing, clean };
  struct Slot {
    uint8_t* mem = nullptr;
    size_t capacity = 0;
    Use use = Use::free;
    int fd = -1;
    size_t first = 0, bytes = 0;
    uint64_t stamp = 0;  // when it was last read or written: which ready slot goes first
    int error = 0;       // errno of a failed read ahead, reported by the acquire
  };
  struct Key {
    int fd;
    size_t first, bytes;
  };
  WindowPool() = default;
  int find(int fd, size_t first) const;    // the slot holding the chunk, or -1
  int reclaimable(bool take_ready) const;  // a slot to reuse, or -1
  int direct_fd_of(int fd) const;          // fd's file opened O_DIRECT, or -1
  void take(Slot& s, int fd, size_t first, size_t bytes, Use use);
  void resize_slots(std::unique_lock<std::mutex>& lock, size_t bytes);
  void wait_for_io(std::unique_lock<std::mutex>& lock, int fd);  // fd -1: all
  void start_threads();
  void read_loop();
  void write_loop();

  mutable std::mutex mutex_;
  std::condition_variable changed_;  // a slot changed use, a key was queued, a write was posted
  std::vector<Slot> slots_ = std::vector<Slot>(kStateWindowSlots);
  std::deque<Key> queue_;                      // chunks to read ahead
  std::deque<int> writes_;                     // slots to write back
  std::vector<std::pair<int, int>> attached_;  // fd, direct_fd (fd where none)
  std::set<std::pair<int, size_t>> in_cache_;  // chunks (fd, first) in the page cache, not read or written since
  size_t slot_bytes_ = 0;
  uint64_t clock_ = 0;
  bool resizing_ = false;
  int write_error_ = 0;  // errno of a failed write: every later acquire, release and settle throws it
  std::thread reader_, writer_;
};

}  // namespace detail
}  // namespace optim
}  // namespace frugal
