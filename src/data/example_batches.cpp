// The examples file (memory-mapped, checked) and the batches made from it (see examples.h).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "frugal/data/examples.h"
#include "frugal/io/files.h"
#include "examples_format.h"

namespace frugal {
namespace data {
namespace {

uint64_t align8(uint64_t n) { return (n + 7) & ~uint64_t(7); }

// splitmix64: a small generator whose sequence is fixed by its seed on every platform.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

// Fisher-Yates over v with a generator seeded by (seed, stream); draws below n by the high half of
// a 128-bit product (Lemire), so no modulo bias and no library distribution.
template <typename T>
void shuffle(std::vector<T>& v, uint64_t seed, uint64_t stream) {
  SplitMix64 g{seed ^ (stream * 0xd1b54a32d192ed03ull)};
  g.next();
  for (size_t i = v.size(); i > 1; --i) {
    const auto j = static_cast<size_t>((static_cast<unsigned __int128>(g.next()) * i) >> 64);
    std::swap(v[i - 1], v[j]);
  }
}

constexpr uint64_t kPackingStream = 0x7061636b696e67ull;  // "packing": the one shuffle rows are packed in

}  // namespace

ExampleFile::ExampleFile(const std::string& path) {
  const io::ReadableFile f = io::open_regular_file(path, "examples file");
  const uint64_t size = f.size();
  if (size < examples_format::kHeaderBytes) throw std::invalid_argument("examples file " + path + " is too short to have a header");
  map_bytes_ = static_cast<size_t>(size);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, f.fd(), 0);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::invalid_argument("examples file " + path + " cannot be mapped");
  }
  auto fail = [&](const std::string& why) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw std::invalid_argument("examples file " + path + " " + why);
  };
  const char* p = static_cast<const char*>(map_);
  uint32_t version = 0, fp = 0;
  uint64_t vocab = 0, count = 0, total = 0, labels = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&fp, p + 12, 4);
  std::memcpy(&vocab, p + 16, 8);
  std::memcpy(&count, p + 24, 8);
  std::memcpy(&total, p + 32, 8);
  std::memcpy(&labels, p + 40, 8);
  if (std::memcmp(p, examples_format::kMagic, 8) != 0) fail("is not a frugal examples file (bad magic)");
  if (version != examples_format::kVersion) fail("has version " + std::to_string(version) + " (this frugal reads 1)");
  if (vocab == 0 || vocab > (uint64_t(1) << 31)) fail("has a bad vocabulary size");
  // Each section's place from the header, every sum checked against the file's size before it is
  // formed, so no count can wrap around.
  const uint64_t room = size - examples_format::kHeaderBytes;
  if (fp > room) fail("says its fingerprint is longer than the file");
  const uint64_t tokens_at = examples_format::kHeaderBytes + align8(fp);
  if (tokens_at > size || total > (size - tokens_at) / 5)
    fail("says it holds " + std::to_string(total) + " tokens, more than its size allows");
  const uint64_t flags_at = tokens_at + align8(total * 4);
  const uint64_t offsets_at = flags_at + align8(total);
  if (offsets_at > size || count >= (size - offsets_at) / 8 + 1 || offsets_at + (count + 1) * 8 != size) {
    fail("says it holds " + std::to_string(count) + " examples but its size says otherwise");
  }
  if (count == 0) fail("holds no examples");
  tokens_ = reinterpret_cast<const int32_t*>(p + tokens_at);
  flags_ = reinterpret_cast<const uint8_t*>(p + flags_at);
  offsets_ = reinterpret_cast<const uint64_t*>(p + offsets_at);
  if (offsets_[0] != 0 || offsets_[count] != total) fail("has offsets that do not run from 0 to its token count");
  for (uint64_t i = 0; i < count; ++i) {
    if (offsets_[i + 1] < offsets_[i] + 2)
      fail("has an example (" + std::to_string(i) + ") of fewer than two tokens, or offsets that go back");
  }
  uint64_t counted = 0;
  for (uint64_t i = 0; i < total; ++i) {
    if (tokens_[i] < 0 || static_cast<uint64_t>(tokens_[i]) >= vocab)
      fail("holds token " + std::to_string(tokens_[i]) + ", outside its vocabulary");
    if (flags_[i] > 1) fail("holds a loss flag other than 0 or 1");
    counted += flags_[i];
  }
  if (counted != labels) fail("says it has " + std::to_string(labels) + " answer tokens but its flags count " + std::to_string(counted));
  fingerprint_.assign(p + examples_format::kHeaderBytes, fp);
  count_ = static_cast<int64_t>(count);
  vocab_ = static_cast<int64_t>(vocab);
  tokens_total_ = static_cast<int64_t>(total);
  labels_total_ = static_cast<int64_t>(labels);
}

ExampleFile::~ExampleFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

int64_t ExampleFile::length(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < count_, "example ", i, " is outside [0, ", count_, ")");
  return static_cast<int64_t>(offsets_[i + 1] - offsets_[i]);
}

const int32_t* ExampleFile::tokens(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < count_, "example ", i, " is outside [0, ", count_, ")");
  return tokens_ + offsets_[i];
}

const uint8_t* ExampleFile::loss(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < count_, "example ", i, " is outside [0, ", count_, ")");
  return flags_ + offsets_[i];
}

ExampleBatches::ExampleBatches(std::shared_ptr<const ExampleFile> file, int64_t first, int64_t end, Options o)
    : file_(std::move(file)), opt_(o) {
  if (!file_) throw std::invalid_argument("ExampleBatches: no examples file");
  if (opt_.micro_rows < 1 || opt_.rows_per_step < 1 || opt_.rows_per_step % opt_.micro_rows != 0) {
    throw std::invalid_argument("rows per step (" + std::to_string(opt_.rows_per_step) +
                                ") must be a positive multiple of the rows of a micro-batch (" + std::to_string(opt_.micro_rows) + ")");
  }
  if (opt_.seq_len < 1) throw std::invalid_argument("seq_len must be at least 1");
  if (first < 0 || end > file_->size() || first >= end) {
    throw std::invalid_argument("the example range [" + std::to_string(first) + ", " + std::to_string(end) +
                                ") is empty or outside the file's " + std::to_string(file_->size()) + " examples");
  }
  for (int64_t i = first; i < end; ++i) {
    if (file_->length(i) - 1 > opt_.seq_len) {
      if (opt_.drop_overlong) {
        ++dropped_;
        continue;
      }
      ++truncated_;
    }
    eval_examples_.push_back(i);
  }
  if (eval_examples_.empty()) {
    throw std::invalid_argument("every example of [" + std::to_string(first) + ", " + std::to_string(end) + ") is longer than seq_len " +
                                std::to_string(opt_.seq_len) + " and drop_overlong leaves it out");
  }
  // Rows: one example each, or examples packed greedily in order (a new row when the next does not fit).
  auto make_rows = [&](const std::vector<int64_t>& list, std::vector<Row>& rows) {
    int64_t begin = 0, used = 0;
    for (int64_t k = 0; k < static_cast<int64_t>(list.size()); ++k) {
      const int64_t p = positions(list[static_cast<size_t>(k)]);
      if (!opt_.packing || (k > begin && used + p > opt_.seq_len)) {
        if (k > begin) rows.push_back({begin, k});
        begin = k;
        used = 0;
      }
      used += p;
    }
    rows.push_back({begin, static_cast<int64_t>(list.size())});
  };
  examples_ = eval_examples_;
  if (opt_.packing) {
    shuffle(examples_, opt_.seed, kPackingStream);
    pack_best_fit();
  } else {
    make_rows(examples_, rows_);
  }
  make_rows(eval_examples_, eval_rows_);
}

int64_t ExampleBatches::positions(int64_t example) const { return std::min(file_->length(example) - 1, opt_.seq_len); }

// Best-fit decreasing: the examples, longest first (ties in the packing shuffle's order), each into
// the row whose free positions fit it most tightly, or a new row; then examples_ is rewritten row
// by row so each row is a range of it. Rows fill to within a few percent of seq_len where greedy
// packing in arrival order leaves a row's tail empty whenever the next example does not fit.
// O(n log n): the rows' free positions live in an ordered multimap.
void ExampleBatches::pack_best_fit() {
  std::vector<size_t> order(examples_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return positions(examples_[a]) > positions(examples_[b]); });
  std::vector<std::vector<int64_t>> rows;
  std::multimap<int64_t, size_t> free;  // free positions -> row
  for (const size_t i : order) {
    const int64_t p = positions(examples_[i]);
    auto it = free.lower_bound(p);
    size_t row = rows.size();
    int64_t left = opt_.seq_len - p;
    if (it != free.end()) {
      row = it->second;
      left = it->first - p;
      free.erase(it);
    } else {
      rows.emplace_back();
    }
    rows[row].push_back(examples_[i]);
    if (left > 0) free.emplace(left, row);
  }
  examples_.clear();
  rows_.clear();
  for (const auto& row : rows) {
    const auto begin = static_cast<int64_t>(examples_.size());
    examples_.insert(examples_.end(), row.begin(), row.end());
    rows_.push_back({begin, static_cast<int64_t>(examples_.size())});
  }
}

std::vector<int64_t> ExampleBatches::epoch_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(cache_->mutex);
  if (epoch != cache_->epoch) {
    cache_->order.resize(rows_.size());
    for (size_t i = 0; i < rows_.size(); ++i) cache_->order[i] = static_cast<int64_t>(i);
    shuffle(cache_->order, opt_.seed, static_cast<uint64_t>(epoch));
    cache_->epoch = epoch;
  }
  return cache_->order;
}

// rows: (R) rows, nullptr for a padding row. tokens/targets/segments: (R, T), T = seq_len with
// packing, else the longest row (at least 1).
ExampleBatch ExampleBatches::make_batch(const std::vector<const Row*>& rows, const std::vector<int64_t>& list) const {
  const auto R = static_cast<int64_t>(rows.size());
  auto row_positions = [&](const Row* row) {
    int64_t n = 0;
    if (row)
      for (int64_t k = row->begin; k < row->end; ++k) n += positions(list[static_cast<size_t>(k)]);
    return n;
  };
  int64_t T = opt_.packing ? opt_.seq_len : 1;
  if (!opt_.packing)
    for (const Row* row : rows) T = std::max(T, row_positions(row));
  std::vector<int64_t> tokens(static_cast<size_t>(R * T), 0), targets(static_cast<size_t>(R * T), -100), segments;
  if (opt_.packing) segments.assign(static_cast<size_t>(R * T), 0);
  ExampleBatch b;
  for (int64_t r = 0; r < R; ++r) {
    int64_t pos = 0, segment = 0;
    const Row* row = rows[static_cast<size_t>(r)];
    for (int64_t k = row ? row->begin : 0; row && k < row->end; ++k, ++segment) {
      const int64_t e = list[static_cast<size_t>(k)];
      const int64_t p = positions(e);
      const int32_t* ids = file_->tokens(e);
      const uint8_t* loss = file_->loss(e);
      const size_t at = static_cast<size_t>(r * T + pos);
      for (int64_t t = 0; t < p; ++t) {
        tokens[at + t] = ids[t];
        if (loss[t + 1]) {
          targets[at + t] = ids[t + 1];
          ++b.label_tokens;
        }
        if (opt_.packing) segments[at + t] = segment;
      }
      pos += p;
    }
    if (opt_.packing) std::fill(segments.begin() + r * T + pos, segments.begin() + (r + 1) * T, segment);
    b.real_tokens += pos;
  }
  b.padding_tokens = R * T - b.real_tokens;
  auto to_tensor = [&](std::vector<int64_t>& v) { return at::from_blob(v.data(), {R, T}, at::kLong).clone(); };
  b.tokens = to_tensor(tokens);
  b.targets = to_tensor(targets);
  if (opt_.packing) b.segments = to_tensor(segments);
  return b;
}

std::vector<ExampleBatch> ExampleBatches::step(int64_t step) const {
  TORCH_CHECK(step >= 0, "step must be >= 0, got ", step);
  const int64_t spe = steps_per_epoch();
  const std::vector<int64_t> order = epoch_order(step / spe);
  const int64_t first_row = (step % spe) * opt_.rows_per_step;
  std::vector<ExampleBatch> out;
  for (int64_t m = 0; m < opt_.rows_per_step / opt_.micro_rows; ++m) {
    std::vector<const Row*> rows;
    for (int64_t k = 0; k < opt_.micro_rows; ++k) {
      const int64_t i = first_row + m * opt_.micro_rows + k;
      rows.push_back(i < rows_per_epoch() ? &rows_[static_cast<size_t>(order[static_cast<size_t>(i)])] : nullptr);
    }
    out.push_back(make_batch(rows, examples_));
  }
  return out;
}

int64_t ExampleBatches::eval_batches() const { return (static_cast<int64_t>(eval_rows_.size()) + opt_.micro_rows - 1) / opt_.micro_rows; }

ExampleBatch ExampleBatches::eval_batch(int64_t index) const {
  TORCH_CHECK(index >= 0, "index must be >= 0, got ", index);
  const int64_t group = index % eval_batches();
  std::vector<const Row*> rows;
  for (int64_t k = 0; k < opt_.micro_rows; ++k) {
    const size_t i = static_cast<size_t>(group * opt_.micro_rows + k);
    rows.push_back(i < eval_rows_.size() ? &eval_rows_[i] : nullptr);
  }
  return make_batch(rows, eval_examples_);
}

double ExampleBatches::padding_share() const {
  // Epoch 0's micro-batches, counted without building them.
  const std::vector<int64_t> order = epoch_order(0);
  int64_t all = 0, real = 0;
  const int64_t rows_total = steps_per_epoch() * opt_.rows_per_step;
  for (int64_t first = 0; first < rows_total; first += opt_.micro_rows) {
    int64_t widest = opt_.packing ? opt_.seq_len : 1;
    for (int64_t i = first; i < first + opt_.micro_rows && i < rows_per_epoch(); ++i) {
      const Row& row = rows_[static_cast<size_t>(order[static_cast<size_t>(i)])];
      int64_t n = 0;
      for (int64_t k = row.begin; k < row.end; ++k) n += positions(examples_[static_cast<size_t>(k)]);
      real += n;
      widest = std::max(widest, n);
    }
    all += widest * opt_.micro_rows;
  }
  return all == 0 ? 0.0 : static_cast<double>(all - real) / static_cast<double>(all);
}

}  // namespace data
}  // namespace frugal
