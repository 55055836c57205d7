#include "frugal/optim/state_buffer.h"

#include "frugal/io/units.h"
#include "state_window.h"

#include <chrono>

#include <c10/core/Allocator.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <limits>
#include <map>
#include <mutex>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

namespace frugal {
namespace optim {

const char* precision_name(StatePrecision p) {
  switch (p) {
    case StatePrecision::fp32: return "fp32";
    case StatePrecision::bf16: return "bf16";
    case StatePrecision::int8: return "int8";
    case StatePrecision::int4: return "int4";
  }
  return "fp32";
}

std::optional<StatePrecision> parse_precision(const std::string& s) {
  for (StatePrecision p : kAllStatePrecisions) {
    if (s == precision_name(p)) return p;
  }
  return std::nullopt;
}

const char* placement_name(StatePlacement p) {
  switch (p) {
    case StatePlacement::device: return "device";
    case StatePlacement::host: return "host";
    case StatePlacement::mmap: return "mmap";
    case StatePlacement::file: return "file";
  }
  return "device";
}

std::optional<StatePlacement> parse_placement(const std::string& s) {
  for (StatePlacement p : kAllStatePlacements) {
    if (s == placement_name(p)) return p;
  }
  return std::nullopt;
}

int64_t state_block_size(StatePrecision precision) {
  switch (precision) {
    case StatePrecision::int8: return 256;
    case StatePrecision::int4: return 128;
    default: return 1;
  }
}

StatePrecision effective_precision(int64_t numel, const StateOptions& o) {
  // small tensors: scales would cost more than they save
  return is_quantized(o.precision()) && numel < o.min_quantized_numel() ? StatePrecision::fp32 : o.precision();
}

namespace {

using detail::kPage;
// File placement's chunks start on a page of the file in every precision: 8192 values are 32 KiB
// of fp32, 4 KiB of 4-bit codes (and whole blocks of 256 and 128).
constexpr int64_t kWindowChunkUnit = 8192;

// Elements per chunk of the update: options.chunk_elements, or under file placement as many as
// fill one of the window's buffers (whole pages); whole blocks, at least one.
int64_t dense_elements_per_chunk(StatePrecision p, const StateOptions& o) {
  if (o.placement() == StatePlacement::file) {
    const int64_t slot = std::max<int64_t>(1, o.window_bytes() / kStateWindowSlots);
    const int64_t elements = slot / state_bits(p) * 8;  // no overflow for any window_bytes
    return std::max(kWindowChunkUnit, elements / kWindowChunkUnit * kWindowChunkUnit);
  }
  const int64_t block = state_block_size(p) > 1 ? state_block_size(p) : 256;
  return std::max(block, o.chunk_elements() / block * block);
}

int64_t round_to_page(int64_t bytes) {
  return (bytes + static_cast<int64_t>(kPage) - 1) / static_cast<int64_t>(kPage) * static_cast<int64_t>(kPage);
}

// File placement's live buffers by the start of their mapping (release_state_pages).
std::mutex registry_mutex;
std::map<const char*, std::pair<size_t, StateBuffer*>>& registry() {
  static std::map<const char*, std::pair<size_t, StateBuffer*>> r;
  return r;
}

}  // namespace

void check_state_dir_space(const std::string& dir, int64_t bytes) {
  struct statvfs fs {};
  if (::statvfs(dir.c_str(), &fs) != 0) throw std::invalid_argument(dir + " cannot be used for the state files: " + std::strerror(errno));
  const double free = static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize);
  if (static_cast<double>(bytes) > free) {
    const int64_t shown = free >= 9.0e18 ? std::numeric_limits<int64_t>::max() : static_cast<int64_t>(free);
    throw std::invalid_argument(dir + " has " + io::human_bytes(shown) + " free; the optimizer state files need " + io::human_bytes(bytes) +
                                ": free space there or choose another folder (StateOptions::mmap_dir)");
  }
}

void release_state_pages(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.numel() == 0) return;
  const char* p = static_cast<const char*>(t.data_ptr());
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().upper_bound(p);
  if (it == registry().begin()) return;
  --it;
  if (p < it->first + it->second.first) it->second.second->release_all();
}

StateBufferBytes state_buffer_bytes(int64_t numel, const StateOptions& o) {
  const StatePrecision p = effective_precision(numel, o);
  StateBufferBytes b;
  int64_t dense = 0, scales = 0;
  if (!is_quantized(p)) {
    dense = numel * state_bits(p) / 8;
  } else {
    const int64_t block = state_block_size(p), blocks = (numel + block - 1) / block;
    dense = blocks * block * state_bits(p) / 8;  // codes of the padded blocks
    scales = blocks * 4;
  }
  b.total = dense + scales;
  b.in_files = in_files(o.placement()) ? dense : 0;
  if (o.placement() == StatePlacement::file) {
    const int64_t elements = dense_elements_per_chunk(p, o);
    b.window = std::min(round_to_page(dense), elements * state_bits(p) / 8);  // the file is whole pages
  }
  return b;
}

StateBuffer::StateBuffer(const at::Tensor& param, bool is_signed, const StateOptions& o)
    : numel_(param.numel()),
      shape_(param.sizes().vec()),
      precision_(effective_precision(param.numel(), o)),
      placement_(o.placement()),
      signed_(is_signed),
      mmap_dir_(o.mmap_dir()) {
  device_ = placement_ == StatePlacement::device ? param.device() : at::Device(at::kCPU);
  // Chunks of the streamed update hold whole blocks (256 values for the unquantized precisions).
  const int64_t block = state_block_size(precision_) > 1 ? state_block_size(precision_) : 256;
  chunk_ = dense_elements_per_chunk(precision_, o);
  switch (precision_) {
    case StatePrecision::fp32: dense_ = allocate(numel_, at::kFloat, device_); break;
    case StatePrecision::bf16: dense_ = allocate(numel_, at::kBFloat16, device_); break;
    case StatePrecision::int8:
    case StatePrecision::int4: {
      if (in_files(placement_)) {  // the codes in the file, written there as the zero's code
        quantized_ =
            std::make_unique<QuantizedBuffer>(numel_, state_bits(precision_), block, is_signed, device_,
                                              [this](int64_t bytes, uint8_t zero) { return allocate(bytes, at::kByte, device_, zero); });
      } else {
        quantized_ = std::make_unique<QuantizedBuffer>(numel_, state_bits(precision_), block, is_signed, device_);
      }
      break;
    }
  }
}

namespace {

// File placement's reading ahead and starting of write-backs, on a thread of their own: the system
// calls that submit the I/O (readahead, sync_file_range) can wait for the disk's queue, and the
// thread that asked is computing backward. Jobs run in the order posted; a buffer's file is closed
// only once no job of its is queued or running (forget).
class StateIo {
 public:
  static StateIo& get() {
    static StateIo* io = new StateIo();  // never destroyed: its thread may outlive static destructors
    return *io;
  }
  void read(int fd, size_t first, size_t bytes) { post({fd, first, bytes, false}); }
  void write_back(int fd, size_t first, size_t bytes) { post({fd, first, bytes, true}); }
  // Drops fd's queued jobs and waits for its running one.
  void forget(int fd) {
    std::unique_lock<std::mutex> lock(mutex_);
    jobs_.erase(std::remove_if(jobs_.begin(), jobs_.end(), [fd](const Job& j) { return j.fd == fd; }), jobs_.end());
    idle_.wait(lock, [&] { return running_fd_ != fd; });
  }

 private:
  struct Job {
    int fd;
    size_t first, bytes;
    bool write;
  };
  void post(const Job& job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!thread_.joinable()) thread_ = std::thread([this] { run(); });
      jobs_.push_back(job);
    }
    wake_.notify_one();
  }
  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return !jobs_.empty(); });
      const Job job = jobs_.front();
      jobs_.pop_front();
      running_fd_ = job.fd;
      lock.unlock();
      if (job.write) {
        ::sync_file_range(job.fd, static_cast<off_t>(job.first), static_cast<off_t>(job.bytes), SYNC_FILE_RANGE_WRITE);
      } else {
        ::readahead(job.fd, static_cast<off_t>(job.first), job.bytes);
      }
      lock.lock();
      running_fd_ = -1;
      idle_.notify_all();
    }
  }
  std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  int running_fd_ = -1;
  std::thread thread_;
};

}  // namespace

StateBuffer::~StateBuffer() {
  dense_ = at::Tensor();
  quantized_.reset();
  for (const Mapping& m : maps_) {
    ::munmap(m.p, m.bytes);
    if (m.fd >= 0) {
      {
        std::lock_guard<std::mutex> lock(registry_mutex);
        registry().erase(static_cast<const char*>(m.p));
      }
      detail::WindowPool::get().detach(m.fd);
      StateIo::get().forget(m.fd);
      if (m.write_fd != m.fd) ::close(m.write_fd);
      ::close(m.fd);
    } else {
      c10::reportMemoryUsageToProfiler(m.p, -static_cast<int64_t>(m.bytes), 0, 0, c10::Device(c10::kCPU));
    }
  }
}

namespace {

// Sets the first `bytes` of the file to `value`, by writes of 1 MiB from an aligned buffer (fd may be
// direct: then bytes is a multiple of the page). Returns 0 or errno.
int fill_file(int fd, size_t bytes, uint8_t value) {
  constexpr size_t kPiece = size_t{1} << 20;
  void* buffer = nullptr;
  if (::posix_memalign(&buffer, kPage, kPiece) != 0) return ENOMEM;
  std::memset(buffer, value, kPiece);
  int err = 0;
  for (size_t at = 0; at < bytes && !err;) {
    const ssize_t n = ::pwrite(fd, buffer, std::min(kPiece, bytes - at), static_cast<off_t>(at));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) err = n < 0 ? errno : EIO;
    if (n > 0) at += static_cast<size_t>(n);
  }
  std::free(buffer);
  return err;
}

}  // namespace

at::Tensor StateBuffer::allocate(int64_t numel, at::ScalarType dtype, at::Device device, uint8_t fill) {
  if (!in_files(placement_)) {
    TORCH_CHECK(fill == 0, "optimizer state: a filled tensor off the files");
    return at::zeros({numel}, at::TensorOptions().dtype(dtype).device(device));
  }
  // A file the kernel pages in and out: unlinked at once, so it vanishes with the mapping.
  std::string path = mmap_dir_ + "/frugal-state-XXXXXX";
  const int fd = ::mkstemp(&path[0]);
  if (fd < 0) throw std::runtime_error("optimizer state: cannot create a file in " + mmap_dir_ + ": " + std::strerror(errno));
  const bool windowed = placement_ == StatePlacement::file;
  // The window's reads and writes bypass the page cache where the file system allows it (tmpfs may
  // not: then they are buffered); only the reading ahead between steps (cache) goes through it.
  const int direct = windowed && detail::WindowPool::direct_io() ? ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC) : -1;
  ::unlink(path.c_str());
  size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  if (windowed) bytes = static_cast<size_t>(round_to_page(static_cast<int64_t>(bytes)));  // chunks are whole pages
  // Reserved now: a sparse file on a full disk fails later, as SIGBUS on first touch of a page.
  const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  // A fresh file reads as zeros; other fills (the code of zero) are written, not mapped in.
  const int filled = rc == 0 && fill != 0 ? fill_file(direct >= 0 ? direct : fd, bytes, fill) : 0;
  if (rc != 0 || filled != 0) {
    if (direct >= 0) ::close(direct);
    ::close(fd);
    throw std::runtime_error("optimizer state: cannot reserve " + std::to_string(bytes) + " bytes in " + mmap_dir_ + " (" +
                             std::strerror(rc != 0 ? rc : filled) +
                             "); free space there or choose another folder (StateOptions::mmap_dir)");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED || !windowed) ::close(fd);
  if (p == MAP_FAILED) {
    if (direct >= 0) ::close(direct);
    throw std::runtime_error("optimizer state: cannot map a file in " + mmap_dir_);
  }
  maps_.push_back({p, bytes, windowed ? fd : -1, windowed ? (direct >= 0 ? direct : fd) : -1});
  if (windowed) {
    {
      std::lock_guard<std::mutex> lock(registry_mutex);
      registry()[static_cast<const char*>(p)] = {bytes, this};
    }
    // The window's buffers hold a chunk of this file: they are (re)made now, in the caller's scope.
    detail::WindowPool::get().attach(
        fd, maps_.back().write_fd,
        static_cast<size_t>(std::min<int64_t>(static_cast<int64_t>(bytes), chunk_ * state_bits(precision_) / 8)));
  }
  if (!windowed) {
    // Mapped state is the process's memory too (on the CPU, the device's): the kernel keeps the
    // pages a step touches. The tracker sees it as it sees allocator memory, in the scope that
    // made it (optimizer_state). File placement's is seen a chunk at a time (acquire).
    c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(bytes), 0, 0, c10::Device(c10::kCPU));
  }
  return at::from_blob(p, {numel}, at::TensorOptions().dtype(dtype));  // zeros: a fresh file reads as zeros
}

std::pair<size_t, size_t> StateBuffer::file_range(int64_t begin, int64_t end) const {
  const Mapping& m = maps_.front();
  const int64_t per = quantized_ ? 1 : static_cast<int64_t>(dense_.element_size());
  size_t first = static_cast<size_t>(begin * per), last = static_cast<size_t>(end * per);
  if (quantized_ && quantized_->bits() == 4) first = static_cast<size_t>(begin / 2), last = static_cast<size_t>((end + 1) / 2);
  first = first / kPage * kPage;
  last = std::min(m.bytes, (last + kPage - 1) / kPage * kPage);
  return {first, std::max(first, last)};
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

void StateBuffer::acquire(int64_t begin, int64_t end) {
  if (!windowed() || begin >= end) return;
  const auto t0 = std::chrono::steady_clock::now();
  if (!mapped_updates_) settle();  // nothing of it is in the window's buffers from here on
  mapped_updates_ = true;
  const auto [first, last] = file_range(begin, end);
  char* base = static_cast<char*>(maps_.front().p);
  // Mapped in ahead of the kernel, and timed: the wait for the state to be read. Older kernels
  // lack the advice; then the kernel's first touches fault the pages in.
  (void)::madvise(base + first, last - first, MADV_POPULATE_WRITE);
  c10::reportMemoryUsageToProfiler(base + first, static_cast<int64_t>(last - first), 0, 0, c10::Device(c10::kCPU));
  transfer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void StateBuffer::release(int64_t begin, int64_t end) {
  if (!windowed() || begin >= end) return;
  const auto t0 = std::chrono::steady_clock::now();
  const auto [first, last] = file_range(begin, end);
  const Mapping& m = maps_.front();
  char* base = static_cast<char*>(m.p);
  // Unmapping a shared file mapping keeps what was written (the pages stay in the page cache,
  // dirty); the writing back to the file starts now rather than when the kernel gets to it.
  ::madvise(base + first, last - first, MADV_DONTNEED);
  StateIo::get().write_back(m.fd, first, last - first);
  c10::reportMemoryUsageToProfiler(base + first, -static_cast<int64_t>(last - first), 0, 0, c10::Device(c10::kCPU));
  transfer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

uint8_t* StateBuffer::acquire_slot(int64_t begin, int64_t end) {
  TORCH_CHECK(windowed() && begin % chunk_ == 0 && begin < end && end <= numel_, "optimizer state: not a chunk of a windowed state");
  const auto t0 = std::chrono::steady_clock::now();
  const Mapping& m = maps_.front();
  const auto [first, last] = file_range(begin, end);
  uint8_t* p = detail::WindowPool::get().acquire(m.fd, first, last - first);
  transfer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return p;
}

void StateBuffer::release_slot(int64_t begin, int64_t end) {
  detail::WindowPool::get().release(maps_.front().fd, file_range(begin, end).first);
}

void StateBuffer::prefetch(int64_t begin, int64_t end, bool urgent) const {
  end = std::min(end, numel_);
  if (!windowed() || begin >= end) return;
  if (mapped_updates_) {
    const auto [first, last] = file_range(begin, end);
    StateIo::get().read(maps_.front().fd, first, last - first);
    return;
  }
  // Whole chunks: the window's buffers hold chunks as the update asks for them, read from the
  // page cache where cache() put them, else straight from the disk.
  const auto [first, last] = chunks_range(begin, end);
  detail::WindowPool::get().read_ahead(maps_.front().fd, first, last - first, chunk_file_bytes(), urgent);
}

void StateBuffer::cache(int64_t begin, int64_t end) const {
  end = std::min(end, numel_);
  if (!windowed() || begin >= end) return;
  const auto [first, last] = chunks_range(begin, end);
  StateIo::get().read(maps_.front().fd, first, last - first);
  if (!mapped_updates_) detail::WindowPool::get().cached(maps_.front().fd, first, last - first, chunk_file_bytes());
}

std::pair<size_t, size_t> StateBuffer::chunks_range(int64_t begin, int64_t end) const {
  return file_range(begin / chunk_ * chunk_, std::min(numel_, (end + chunk_ - 1) / chunk_ * chunk_));
}

size_t StateBuffer::chunk_file_bytes() const { return file_range(0, std::min(numel_, chunk_)).second; }

void StateBuffer::settle() const {
  if (windowed()) detail::WindowPool::get().settle(maps_.front().fd);
}

int64_t StateBuffer::file_bytes() const { return windowed() ? static_cast<int64_t>(maps_.front().bytes) : 0; }

void StateBuffer::release_all() {
  if (!windowed()) return;
  settle();
  const Mapping& m = maps_.front();
  ::madvise(m.p, m.bytes, MADV_DONTNEED);
  ::sync_file_range(m.fd, 0, 0, SYNC_FILE_RANGE_WRITE);  // 0, 0: the whole file
}

at::Tensor StateBuffer::load(int64_t begin, int64_t end, at::Device device) const {
  at::Tensor v;
  if (quantized_) {
    v = quantized_->load(begin, end);
  } else {
    v = dense_.narrow(0, begin, end - begin);
    if (v.scalar_type() != at::kFloat) v = v.to(at::kFloat);
  }
  if (v.device() == device) return v;
  const auto t0 = std::chrono::steady_clock::now();
  v = v.to(device, /*non_blocking=*/false);
  transfer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return v;
}

void StateBuffer::store(int64_t begin, int64_t end, const at::Tensor& values) {
  const bool moves = values.device() != device_;
  const auto t0 = std::chrono::steady_clock::now();
  if (quantized_) {
    quantized_->store(begin, end, values.to(device_));  // quantized on the state's device, after the move
  } else {
    at::Tensor dst = dense_.narrow(0, begin, end - begin);
    if (values.is_same(dst) || (values.data_ptr() == dst.data_ptr() && values.scalar_type() == dst.scalar_type())) return;
    dst.copy_(values);
  }
  if (moves) transfer_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t StateBuffer::bytes() const {
  if (quantized_) return quantized_->bytes();
  return dense_.numel() * static_cast<int64_t>(dense_.element_size());
}

int quantized_bits_of(int64_t numel, int64_t codes, int64_t scales) {
  for (auto [bits, block] : {std::make_pair(8, int64_t{256}), std::make_pair(4, int64_t{128})}) {
    const int64_t blocks = (numel + block - 1) / block;
    if (scales == blocks && codes == (bits == 8 ? blocks * block : blocks * block / 2)) return bits;
  }
  return 0;
}

void StateBuffer::save(std::map<std::string, at::Tensor>& out, const std::string& prefix) const {
  settle();  // the views read the file through the mapping: every write of the window is in it
  if (quantized_) {
    out[prefix + ".codes"] = quantized_->codes();
    out[prefix + ".absmax"] = quantized_->absmax();
  } else {
    out[prefix] = dense_.view(shape_);
  }
}

void StateBuffer::restore(const std::map<std::string, at::Tensor>& in, const std::string& prefix) {
  settle();  // the window's buffers hold nothing of what this replaces
  const auto full = in.find(prefix);
  const auto codes = in.find(prefix + ".codes");
  const auto absmax = in.find(prefix + ".absmax");
  if (full != in.end()) {
    if (full->second.numel() != numel_) throw std::invalid_argument("optimizer state " + prefix + " has the wrong size");
    const at::Tensor v = full->second.reshape({-1}).to(at::kFloat);
    for (int64_t b = 0; b < numel_; b += chunk_) store(b, std::min(numel_, b + chunk_), v.narrow(0, b, std::min(numel_, b + chunk_) - b));
    release_all();
    return;
  }
  if (codes == in.end() || absmax == in.end()) throw std::invalid_argument("optimizer state " + prefix + " is missing");
  const at::Tensor c = codes->second, a = absmax->second;
  if (quantized_ && c.numel() == quantized_->codes().numel() && a.numel() == quantized_->absmax().numel()) {
    quantized_->assign(c.to(device_), a.to(device_));  // the same format: exactly as saved
    release_all();
    return;
  }
  // Another format: decode with the geometry the codes imply, then store in ours.
  const int bits = quantized_bits_of(numel_, c.numel(), a.numel());
  if (!bits) throw std::invalid_argument("optimizer state " + prefix + " has codes and scales of the wrong size");
  const int64_t block = bits == 8 ? 256 : 128;
  QuantizedBuffer other(numel_, bits, block, signed_);
  other.assign(c.to(at::kCPU), a.to(at::kCPU));
  const at::Tensor v = other.load(0, numel_);
  for (int64_t b = 0; b < numel_; b += chunk_) store(b, std::min(numel_, b + chunk_), v.narrow(0, b, std::min(numel_, b + chunk_) - b));
  release_all();
}

}  // namespace optim
}  // namespace frugal
