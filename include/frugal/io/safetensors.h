// frugal/io/safetensors.h — the safetensors format, read defensively and written atomically.
//
// Layout: 8-byte little-endian header length N, N bytes of JSON {name: {dtype, shape,
// data_offsets: [begin, end]}, "__metadata__": {string: string}}, then the raw little-endian data.
// The reader checks every offset, size, dtype and shape against the file before reading a byte of
// data, so a malformed or hostile file is a SafetensorsError naming the problem: never an
// out-of-bounds read, never an allocation larger than the file.
//
//   frugal::io::write_safetensors("model.safetensors", {{"w", w}, {"b", b}});
//   frugal::io::SafetensorsReader file("model.safetensors");
//   at::Tensor w2 = file.load("w");
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "frugal/io/files.h"

namespace frugal {
namespace io {

struct SafetensorsError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// One tensor of a header: name, dtype, shape and where its bytes are.
struct TensorEntry {
  std::string name;
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
};

// A validated header: the tensors and the __metadata__ strings.
struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // in file order
  std::map<std::string, std::string> metadata;
};

constexpr uint64_t kMaxSafetensorsHeaderBytes = 100ull << 20;

// Validates a header against the size of the data section that follows it. Throws SafetensorsError.
SafetensorsHeader parse_safetensors_header(const std::string& json, uint64_t data_bytes);

// An open safetensors file whose header has been checked against the file; tensors are read on demand.
class SafetensorsReader {
 public:
  // Opens the file and validates its header; throws SafetensorsError naming the path and the problem.
  explicit SafetensorsReader(const std::string& path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  // The path it was opened with.
  const std::string& path() const { return path_; }
  // Every tensor's entry, in file order.
  const std::vector<TensorEntry>& tensors() const { return header_.tensors; }
  // The header's __metadata__ (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  const TensorEntry* find(const std::string& name) const;  // the entry called `name`, or nullptr
  // A new CPU tensor with the stored bytes. Throws SafetensorsError for an unknown name.
  at::Tensor load(const std::string& name) const;

 private:
  std::string path_;
  ReadableFile file_;  // io::open_regular_file's: a regular file, its size at open
  uint64_t data_start_ = 0;
  SafetensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// Writes tensors (any device, any layout; stored contiguous) atomically. Names must be unique and
// must not be "__metadata__". `written`, when set, is called with each tensor's index once its
// bytes are written (a caller streaming state from files drops the pages it read).
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {}, const std::function<void(size_t)>& written = {});

const char* safetensors_dtype_name(at::ScalarType t);  // "F32", "BF16", ...

}  // namespace io
}  // namespace frugal
