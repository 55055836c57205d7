#include "frugal/io/pickle.h"

#include <cstring>
#include <stdexcept>

namespace frugal {
namespace io {
namespace {

constexpr char PROTO = '\x80', MARK = '(', EMPTY_DICT = '}', SETITEMS = 'u', EMPTY_LIST = ']', APPENDS = 'e', BININT = 'J', LONG1 = '\x8a',
               BINUNICODE = 'X', BINFLOAT = 'G', NONE = 'N', NEWTRUE = '\x88', NEWFALSE = '\x89', TUPLE2 = '\x86', STOP = '.';
constexpr int64_t kBatch = 1000;

void put_le32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

}  // namespace

PickleWriter::PickleWriter() {
  out_ += PROTO;
  out_ += '\x02';
}

void PickleWriter::item_written() {
  if (stack_.empty()) return;
  Level& l = stack_.back();
  // A dict item is complete after its value (key + value = 2 pushes).
  ++l.pending;
  const int64_t per_item = l.is_dict ? 2 : 1;
  if (l.pending == kBatch * per_item) {
    out_ += l.is_dict ? SETITEMS : APPENDS;
    out_ += MARK;
    l.pending = 0;
  }
}

PickleWriter& PickleWriter::begin_dict() {
  out_ += EMPTY_DICT;
  out_ += MARK;
  stack_.push_back({true, 0});
  return *this;
}

PickleWriter& PickleWriter::end_dict() {
  if (stack_.empty() || !stack_.back().is_dict) throw std::logic_error("PickleWriter: end_dict outside a dict");
  if (stack_.back().pending % 2) throw std::logic_error("PickleWriter: a key without a value");
  out_ += SETITEMS;
  stack_.pop_back();
  item_written();
  return *this;
}

PickleWriter& PickleWriter::begin_list() {
  out_ += EMPTY_LIST;
  out_ += MARK;
  stack_.push_back({false, 0});
  return *this;
}

PickleWriter& PickleWriter::end_list() {
  if (stack_.empty() || stack_.back().is_dict) throw std::logic_error("PickleWriter: end_list outside a list");
  out_ += APPENDS;
  stack_.pop_back();
  item_written();
  return *this;
}

PickleWriter& PickleWriter::key(const std::string& k) {
  if (stack_.empty() || !stack_.back().is_dict || stack_.back().pending % 2) throw std::logic_error("PickleWriter: key outside a dict");
  return value(k);
}

PickleWriter& PickleWriter::value(const std::string& s) {
  out_ += BINUNICODE;
  put_le32(out_, static_cast<uint32_t>(s.size()));
  out_ += s;
  item_written();
  return *this;
}

PickleWriter& PickleWriter::value(int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX) {
    out_ += BININT;
    put_le32(out_, static_cast<uint32_t>(static_cast<int32_t>(v)));
  } else {
    // LONG1: a byte count, then two's-complement little-endian bytes
    std::string bytes;
    uint64_t u = static_cast<uint64_t>(v);
    for (int i = 0; i < 8; ++i) bytes += static_cast<char>((u >> (8 * i)) & 0xFF);
    out_ += LONG1;
    out_ += static_cast<char>(8);
    out_ += bytes;
  }
  item_written();
  return *this;
}

PickleWriter& PickleWriter::value(double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  out_ += BINFLOAT;
  for (int i = 7; i >= 0; --i) out_ += static_cast<char>((bits >> (8 * i)) & 0xFF);  // big-endian
  item_written();
  return *this;
}

PickleWriter& PickleWriter::value(bool v) {
  out_ += v ? NEWTRUE : NEWFALSE;
  item_written();
  return *this;
}

PickleWriter& PickleWriter::none() {
  out_ += NONE;
  item_written();
  return *this;
}

PickleWriter& PickleWriter::pair(int64_t a, int64_t b) {
  // Both elements are pushed, then TUPLE2 replaces them with one tuple.
  std::vector<Level> saved;
  saved.swap(stack_);
  value(a);
  value(b);
  stack_.swap(saved);
  out_ += TUPLE2;
  item_written();
  return *this;
}

std::string PickleWriter::finish() {
  if (!stack_.empty()) throw std::logic_error("PickleWriter: unclosed dict or list");
  out_ += STOP;
  return std::move(out_);
}

}  // namespace io
}  // namespace frugal
