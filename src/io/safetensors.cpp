#include "frugal/io/safetensors.h"

#include <c10/core/Allocator.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <sstream>

#include "frugal/io/atomic_file.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"

namespace frugal {
namespace io {
namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors I/O assumes a little-endian host");

struct DtypeName {
  const char* name;
  at::ScalarType type;
};
constexpr DtypeName kDtypes[] = {
    {"F64", at::kDouble}, {"F32", at::kFloat}, {"F16", at::kHalf}, {"BF16", at::kBFloat16}, {"I64", at::kLong},
    {"I32", at::kInt},    {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},       {"BOOL", at::kBool},
};

[[noreturn]] void fail(const std::string& what) { throw SafetensorsError(what); }

// a * b, or fail when it does not fit in 63 bits
uint64_t checked_mul(uint64_t a, uint64_t b, const std::string& name) {
  if (a != 0 && b > (uint64_t{1} << 62) / a) fail("tensor '" + name + "': its size overflows");
  return a * b;
}

void read_exact(int fd, void* dst, uint64_t bytes, uint64_t offset, const std::string& path) {
  char* p = static_cast<char*>(dst);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, p, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail(path + ": read failed (" + (n < 0 ? std::string(std::strerror(errno)) : "unexpected end of file") + ")");
    p += n;
    bytes -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

const char* safetensors_dtype_name(at::ScalarType t) {
  for (const auto& d : kDtypes) {
    if (d.type == t) return d.name;
  }
  throw SafetensorsError(std::string("safetensors cannot store dtype ") + c10::toString(t));
}

SafetensorsHeader parse_safetensors_header(const std::string& json, uint64_t data_bytes) {
  JsonValue root;
  try {
    root = parse_json(json);
  } catch (const JsonError& e) {
    fail(std::string("header is not valid JSON: ") + e.what());
  }
  if (!root.is_object()) fail("header is not a JSON object");
  SafetensorsHeader h;
  for (const auto& [name, v] : root.members()) {
    const std::string shown = printable(name);  // names and values are quoted escaped and cut
    if (name == "__metadata__") {
      if (!v.is_object()) fail("__metadata__ is not an object");
      for (const auto& [k, m] : v.members()) {
        if (!m.is_string()) fail("__metadata__ value of '" + printable(k) + "' is not a string");
        h.metadata[k] = m.as_string();
      }
      continue;
    }
    if (!v.is_object()) fail("entry '" + shown + "' is not an object");
    TensorEntry e;
    e.name = name;
    const JsonValue* dtype = v.find("dtype");
    const JsonValue* shape = v.find("shape");
    const JsonValue* offsets = v.find("data_offsets");
    if (!dtype || !dtype->is_string()) fail("tensor '" + shown + "' has no dtype string");
    if (!shape || !shape->is_array()) fail("tensor '" + shown + "' has no shape array");
    if (!offsets || !offsets->is_array() || offsets->items().size() != 2) {
      fail("tensor '" + shown + "' needs data_offsets [begin, end]");
    }
    bool known = false;
    for (const auto& d : kDtypes) {
      if (dtype->as_string() == d.name) {
        e.dtype = d.type;
        known = true;
      }
    }
    if (!known) fail("tensor '" + shown + "' has unsupported dtype '" + printable(dtype->as_string()) + "'");
    uint64_t numel = 1;
    if (shape->items().size() > 16) fail("tensor '" + shown + "' has more than 16 dimensions");
    for (const JsonValue& dim : shape->items()) {
      if (!dim.is_integer() || dim.as_int() < 0) fail("tensor '" + shown + "' has a dimension that is not a non-negative integer");
      e.shape.push_back(dim.as_int());
      numel = checked_mul(numel, static_cast<uint64_t>(dim.as_int()), shown);
    }
    const JsonValue& b = offsets->items()[0];
    const JsonValue& en = offsets->items()[1];
    if (!b.is_integer() || !en.is_integer() || b.as_int() < 0 || en.as_int() < b.as_int()) {
      fail("tensor '" + shown + "' has bad data_offsets");
    }
    e.begin = static_cast<uint64_t>(b.as_int());
    e.end = static_cast<uint64_t>(en.as_int());
    if (e.end > data_bytes) {
      fail("tensor '" + shown + "' ends at byte " + std::to_string(e.end) + " but the data section has " + std::to_string(data_bytes));
    }
    const uint64_t expected = checked_mul(numel, c10::elementSize(e.dtype), shown);
    if (e.end - e.begin != expected) {
      fail("tensor '" + shown + "' has " + std::to_string(e.end - e.begin) + " bytes of data but its dtype and shape need " +
           std::to_string(expected));
    }
    h.tensors.push_back(std::move(e));
  }
  // No two tensors may share bytes.
  std::vector<const TensorEntry*> sorted;
  for (const auto& e : h.tensors) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const TensorEntry* a, const TensorEntry* b) { return a->begin < b->begin; });
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->begin < sorted[i - 1]->end) {
      fail("tensors '" + printable(sorted[i - 1]->name) + "' and '" + printable(sorted[i]->name) + "' overlap");
    }
  }
  return h;
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  try {
    file_ = open_regular_file(path);  // a FIFO or a device is refused, never waited on
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
  const int fd = file_.fd();
  const uint64_t size = file_.size();
  if (size < 8) fail(path + ": too short to be a safetensors file (" + std::to_string(size) + " bytes)");
  unsigned char len_bytes[8];
  read_exact(fd, len_bytes, 8, 0, path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  if (header_len > size - 8) {
    fail(path + ": header length " + std::to_string(header_len) + " exceeds the file (" + std::to_string(size) + " bytes)");
  }
  if (header_len > kMaxSafetensorsHeaderBytes) fail(path + ": header length " + std::to_string(header_len) + " exceeds 100 MiB");
  std::string json(header_len, '\0');
  read_exact(fd, &json[0], header_len, 8, path);
  data_start_ = 8 + header_len;
  try {
    header_ = parse_safetensors_header(json, size - data_start_);
  } catch (const SafetensorsError& e) {
    fail(path + ": " + e.what());
  }
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

SafetensorsReader::~SafetensorsReader() = default;

const TensorEntry* SafetensorsReader::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

namespace {

// From this size a loaded tensor gets pages of its own.
constexpr uint64_t kOwnPagesBytes = uint64_t{1} << 20;

// An uninitialised CPU tensor for `bytes` read from a file. Loaders mostly copy what they read into
// place and drop it, while keeping smaller blocks they make meanwhile (an 8-bit state's scales): from
// the C heap, the dropped tensors leave holes below those blocks that stay resident (resuming the 7B
// recipe held 1.4 GiB of them). In pages of their own they go back to the system when dropped. The
// tracker is told of them as of the allocator's blocks.
at::Tensor empty_for_reading(const std::vector<int64_t>& shape, at::ScalarType dtype, uint64_t bytes) {
  const auto options = at::TensorOptions().dtype(dtype);
  if (bytes < kOwnPagesBytes) return at::empty(shape, options);
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return at::empty(shape, options);  // the allocator's own error, if it fails too
  const c10::Device cpu(c10::kCPU);
  c10::reportMemoryUsageToProfiler(p, static_cast<int64_t>(bytes), 0, 0, cpu);
  return at::from_blob(
      p, shape,
      [bytes, cpu](void* q) {
        c10::reportMemoryUsageToProfiler(q, -static_cast<int64_t>(bytes), 0, 0, cpu);
        ::munmap(q, bytes);
      },
      options);
}

}  // namespace

at::Tensor SafetensorsReader::load(const std::string& name) const {
  const TensorEntry* e = find(name);
  if (!e) fail(path_ + ": no tensor named '" + name + "'");
  at::Tensor t = empty_for_reading(e->shape, e->dtype, e->end - e->begin);
  if (e->end > e->begin) read_exact(file_.fd(), t.data_ptr(), e->end - e->begin, data_start_ + e->begin, path_);
  return t;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata, const std::function<void(size_t)>& written) {
  std::set<std::string> names;
  std::ostringstream header;
  JsonWriter w(header, 0);
  w.begin_object();
  if (!metadata.empty()) {
    w.key("__metadata__").begin_object();
    for (const auto& [k, v] : metadata) w.key(k).value(v);
    w.end_object();
  }
  uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    if (name == "__metadata__" || !names.insert(name).second) {
      throw SafetensorsError("cannot write tensor name '" + name + "' twice or as __metadata__");
    }
    const uint64_t bytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    w.key(name).begin_object().key("dtype").value(safetensors_dtype_name(t.scalar_type())).key("shape").begin_array();
    for (int64_t s : t.sizes()) w.value(s);
    w.end_array().key("data_offsets").begin_array().value(static_cast<int64_t>(offset)).value(static_cast<int64_t>(offset + bytes));
    w.end_array().end_object();
    offset += bytes;
  }
  w.end_object();
  std::string json = header.str();
  json.append((8 - json.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>((json.size() >> (8 * i)) & 0xFF);
  AtomicFileWriter out(path);
  out.write(len_bytes, 8);
  out.write(json.data(), json.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor cpu = tensors[i].second.detach().to(at::kCPU).contiguous();
    out.write(cpu.data_ptr(), static_cast<size_t>(cpu.numel()) * cpu.element_size());
    if (written) written(i);
  }
  out.commit();
}

}  // namespace io
}  // namespace frugal
