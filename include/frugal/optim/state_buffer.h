// frugal/optim/state_buffer.h — one optimizer-state tensor in a chosen precision and place.
//
// Precision: fp32, bf16, 8-bit (blocks of 256) or 4-bit (blocks of 128) with one fp32 absmax per
// block (quantize.h). Place: on the parameter's device, in host memory (streamed to the device a
// chunk at a time during the step), in a memory-mapped file that the operating system pages
// (mmap), or in a file streamed through a bounded window (file): before its update a chunk is read
// into one of kStateWindowSlots buffers (read ahead, in the order the updates need them, by a thread
// of its own), updated there by the fused kernels and written back after (by another), with direct
// I/O where the file system allows it, so at most window_bytes of state are resident at once and
// none of it passes through the page cache. The step reads and writes a chunk of blocks at a time,
// so no full fp32 copy of the state exists.
// Tensors with fewer than min_quantized_numel elements keep fp32 state.
//
//   frugal::optim::StateBuffer m(param, /*is_signed=*/true, frugal::optim::StateOptions().precision(
//       frugal::optim::StatePrecision::int8));
//   at::Tensor chunk = m.load(0, 65536, param.device());   // fp32
//   ...; m.store(0, 65536, chunk);
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "frugal/optim/quantize.h"

namespace frugal {
namespace optim {

enum class StatePrecision { fp32, bf16, int8, int4 };
enum class StatePlacement { device, host, mmap, file };
constexpr std::array<StatePrecision, 4> kAllStatePrecisions = {StatePrecision::fp32, StatePrecision::bf16, StatePrecision::int8,
                                                               StatePrecision::int4};
constexpr std::array<StatePlacement, 4> kAllStatePlacements = {StatePlacement::device, StatePlacement::host, StatePlacement::mmap,
                                                               StatePlacement::file};

// File placement's window: this many buffers of one chunk each (both moments' chunk of the update
// at hand, and the chunks read ahead or being written back).
constexpr int kStateWindowSlots = 8;

// Bits one value takes in this precision: 32, 16, 8 or 4 (scales of the 8- and 4-bit blocks apart).
constexpr int state_bits(StatePrecision p) {
  return p == StatePrecision::fp32 ? 32 : p == StatePrecision::bf16 ? 16 : p == StatePrecision::int8 ? 8 : 4;
}
// 8- and 4-bit: codes and block scales (QuantizedBuffer); fp32 and bf16 are dense values.
constexpr bool is_quantized(StatePrecision p) { return state_bits(p) <= 8; }

// "fp32", "bf16", "int8", "int4"; parse_precision is the inverse (nullopt for any other text).
const char* precision_name(StatePrecision p);
std::optional<StatePrecision> parse_precision(const std::string& s);
// "device", "host", "mmap", "file"; parse_placement is the inverse.
const char* placement_name(StatePlacement p);
std::optional<StatePlacement> parse_placement(const std::string& s);

// How an optimizer keeps its state: precision, place, and the streamed update's chunk size.
struct StateOptions {
  TORCH_ARG(StatePrecision, precision) = StatePrecision::fp32;
  TORCH_ARG(StatePlacement, placement) = StatePlacement::device;
  TORCH_ARG(std::string, mmap_dir) = "/tmp";       // where mmap and file placement create their files
  TORCH_ARG(int64_t, window_bytes) = 64 << 20;     // file placement: the most state bytes resident at once
  TORCH_ARG(int64_t, min_quantized_numel) = 4096;  // smaller tensors keep fp32 state
  TORCH_ARG(int64_t, chunk_elements) = 1 << 20;    // elements per step of the streamed update
};

// Whether the state's values (codes or dense values) live in files: mmap and file placement.
inline bool in_files(StatePlacement p) { return p == StatePlacement::mmap || p == StatePlacement::file; }

// Refuses, before anything is made, state files of `bytes` in total that the free space of `dir`
// cannot hold (std::invalid_argument: "<dir> has N free; ..."), and a `dir` that is not a folder.
void check_state_dir_space(const std::string& dir, int64_t bytes);

// Where `t` is a view of file-placement state (StateBuffer::save's), unmaps that buffer's pages
// (StateBuffer::release_all); anything else is left alone.
void release_state_pages(const at::Tensor& t);

// Values per quantization block (one fp32 absmax each): 256 for int8, 128 for int4, 1 otherwise.
int64_t state_block_size(StatePrecision precision);
// The precision a parameter of `numel` elements really gets (small tensors keep fp32 state).
StatePrecision effective_precision(int64_t numel, const StateOptions& options);
// Bytes one StateBuffer of `numel` values allocates (codes and scales, or the dense tensor), and
// how many of them live in mapped files (mmap and file placement: codes or dense values; scales stay
// in memory), and of those how many file placement brings in at once (one chunk, StateBuffer::chunk:
// the size of a window buffer it needs; the window is kStateWindowSlots buffers of the largest).
struct StateBufferBytes {
  int64_t total = 0;
  int64_t in_files = 0;
  int64_t window = 0;
};
StateBufferBytes state_buffer_bytes(int64_t numel, const StateOptions& options);
// The bits (8 or 4) of saved codes and scales for `numel` values: the block geometry that `codes`
// code bytes and `scales` absmax values imply, or 0 when they fit neither.
int quantized_bits_of(int64_t numel, int64_t codes, int64_t scales);

// One state tensor of a parameter (a moment), kept as StateOptions say and read and written a range at a time.
class StateBuffer {
 public:
  // Zeros shaped like param.
  StateBuffer(const at::Tensor& param, bool is_signed, const StateOptions& options);
  ~StateBuffer();
  StateBuffer(const StateBuffer&) = delete;
  StateBuffer& operator=(const StateBuffer&) = delete;

  // The number of values (the parameter's element count).
  int64_t numel() const { return numel_; }
  // The precision it really has (effective_precision: small tensors keep fp32).
  StatePrecision precision() const { return precision_; }
  // Elements per chunk of the update (a multiple of the block). File placement: as many as fill
  // one of the window's kStateWindowSlots buffers, in whole pages of the file (a multiple of 8192).
  int64_t chunk() const { return chunk_; }
  // True for file placement: the state lives in a file and only a bounded window of it is
  // resident. The calls below up to release_all do nothing otherwise.
  bool windowed() const { return placement_ == StatePlacement::file; }
  // The fused CPU kernels' path. Before the update of the chunk [begin, end) (begin a multiple of
  // chunk()): the chunk in a window buffer, read ahead or read now (the wait is timed into
  // transfer_seconds); the returned pointer holds value begin's bytes (code, or fp32/bf16 value) on.
  uint8_t* acquire_slot(int64_t begin, int64_t end);
  // After that update: the chunk's write back to the file is posted (the caller does not wait).
  void release_slot(int64_t begin, int64_t end);
  // Every other path (ATen's arithmetic through load/store, a GPU's kernel), before the update of
  // [begin, end): its pages are mapped in (timed). The tracker sees a chunk as memory while it is
  // mapped in.
  void acquire(int64_t begin, int64_t end);
  // After that update: the pages are unmapped (timed) and their writing back started.
  void release(int64_t begin, int64_t end);
  // Has [begin, end) read ahead of its update by a thread of its own (into window buffers, in the
  // order asked, urgent ones first; or, once the mapped path updates this buffer, into the page
  // cache): the caller does not wait for it.
  void prefetch(int64_t begin, int64_t end, bool urgent = false) const;
  // Has values [begin, end) of the file read into the page cache (file placement) by a thread of
  // its own, for a window's read to copy later rather than wait for the disk: the optimizer does
  // it for the next step's first updates once a step is over, while forward leaves the disk idle.
  void cache(int64_t begin, int64_t end) const;
  // The bytes of its file (file placement; 0 otherwise): what reading all of it ahead moves.
  int64_t file_bytes() const;
  // Unmaps every page: after a checkpoint has read them all, or a restore written them.
  void release_all();
  // Waits until the file holds every chunk written back through the window and no window buffer
  // holds one of this buffer's (save and restore do it before they touch the mapping).
  void settle() const;
  // Values [begin, end) as fp32 on `device`. For fp32 state on that device this is a view: writes
  // to it change the state, and store() of it is free.
  at::Tensor load(int64_t begin, int64_t end, at::Device device) const;
  // Writes values (fp32, end - begin of them, any device) into [begin, end), quantizing them when the
  // state is 8- or 4-bit (begin then block-aligned).
  void store(int64_t begin, int64_t end, const at::Tensor& values);
  int64_t bytes() const;  // bytes held: codes and scales, or the dense tensor
  // The quantized form (8- and 4-bit precisions), for fused kernels; nullptr otherwise.
  QuantizedBuffer* quantized() { return quantized_.get(); }
  // The fp32 or bf16 values (flat, numel() of them, on the state's place: the device, host memory
  // or a mapped file), for fused kernels that step on them in place; undefined when quantized.
  const at::Tensor& dense() const { return dense_; }

  // Saved as "<prefix>" (fp32/bf16, the parameter's shape) or "<prefix>.codes" + "<prefix>.absmax":
  // views of the live state on its device, not copies.
  void save(std::map<std::string, at::Tensor>& out, const std::string& prefix) const;
  // Loads either form (a full tensor is quantized; codes and scales are dequantized when this
  // buffer is not quantized). Throws std::invalid_argument naming the prefix on a mismatch.
  void restore(const std::map<std::string, at::Tensor>& in, const std::string& prefix);

  // Seconds load() and store() have spent moving chunks between the state's place and the
  // parameter's device (host or mapped state of a GPU parameter); 0 when both are the same.
  double transfer_seconds() const { return transfer_seconds_; }
  // Time a fused kernel spent moving this state's codes (adam_step_quantized_cuda's copies).
  void add_transfer_seconds(double seconds) { transfer_seconds_ += seconds; }

 private:
  // numel values of dtype on the state's place, every byte `fill` (0: zeros).
  at::Tensor allocate(int64_t numel, at::ScalarType dtype, at::Device device, uint8_t fill = 0);
  int64_t numel_ = 0, chunk_ = 0;
  std::vector<int64_t> shape_;
  StatePrecision precision_;
  StatePlacement placement_;
  bool signed_;
  at::Device device_ = at::kCPU;  // where the state lives
  at::Tensor dense_;              // fp32 or bf16 state
  std::unique_ptr<QuantizedBuffer> quantized_;
  struct Mapping {
    void* p;
    size_t bytes;
    int fd;        // file placement keeps it open for writing back; -1 for mmap placement
    int write_fd;  // file placement: the window's writes (opened O_DIRECT where it can be; else fd)
  };
  std::vector<Mapping> maps_;  // mmap and file placement: the codes or dense values
  // file placement: the byte range of maps_[0] a range of values takes, page-aligned outwards
  std::pair<size_t, size_t> file_range(int64_t begin, int64_t end) const;
  // The same for the whole chunks [begin, end) touches, and one chunk's bytes (the window's unit).
  std::pair<size_t, size_t> chunks_range(int64_t begin, int64_t end) const;
  size_t chunk_file_bytes() const;
  std::string mmap_dir_;
  mutable double transfer_seconds_ = 0;
  mutable bool mapped_updates_ = false;  // file placement: the mapped path updates it (prefetch then reads into the page cache)
};

}  // namespace optim
}  // namespace frugal
