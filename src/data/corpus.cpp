#include "frugal/data/corpus.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>

#include "frugal/io/atomic_file.h"

namespace frugal {
namespace data {
namespace {

constexpr char kMagic[8] = {'F', 'R', 'U', 'G', 'A', 'L', 'T', 'K'};
constexpr size_t kHeaderBytes = 32;

// Each real folder is entered once (by device and inode), so symlink loops end.
void collect_files(const std::string& path, std::vector<std::string>& out, std::set<std::pair<dev_t, ino_t>>& seen_dirs) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return;
  if (S_ISREG(st.st_mode)) {
    out.push_back(path);
    return;
  }
  if (!S_ISDIR(st.st_mode) || !seen_dirs.insert({st.st_dev, st.st_ino}).second) return;
  DIR* dir = ::opendir(path.c_str());
  if (!dir) throw std::invalid_argument("corpus folder " + path + " cannot be read: " + std::strerror(errno));
  std::vector<std::string> names;
  while (dirent* e = ::readdir(dir)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(dir);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) collect_files(path + "/" + n, out, seen_dirs);
}

// The whole file; a file that cannot be opened or read is an error with the system's reason
// (iostreams would report a read error as end of file, or throw with their internals' name).
std::string read_text(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::invalid_argument("corpus file " + path + " cannot be read: " + std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw std::invalid_argument("corpus file " + path + " cannot be read: " + std::strerror(err));
    }
    if (n == 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return text;
}

// Splits fortune-format text at lines holding only "%"; other text is one document.
void split_documents(const std::string& text, std::vector<std::string>& docs) {
  if (text.find("\n%\n") == std::string::npos && text.rfind("%\n", 0) != 0) {
    if (text.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(text);
    return;
  }
  std::istringstream in(text);
  std::string line, doc;
  auto flush = [&] {
    if (doc.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(doc);
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (line == "%") {
      flush();
    } else {
      doc += line + "\n";
    }
  }
  flush();
}

}  // namespace

std::vector<std::string> read_corpus(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw std::invalid_argument("corpus " + path + " does not exist");
  std::vector<std::string> files;
  std::set<std::pair<dev_t, ino_t>> seen_dirs;
  collect_files(path, files, seen_dirs);
  std::set<std::string> seen;
  std::vector<std::string> docs;
  for (const auto& f : files) {
    char real[PATH_MAX];
    if (!::realpath(f.c_str(), real) || !seen.insert(real).second) continue;  // a link to a file already read
    const std::string text = read_text(f);
    if (text.find('\0') != std::string::npos) continue;  // binary (e.g. fortune's .dat index files)
    split_documents(text, docs);
  }
  if (docs.empty()) throw std::invalid_argument("corpus " + path + " holds no text");
  return docs;
}

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab_size) {
  char header[kHeaderBytes] = {};
  std::memcpy(header, kMagic, 8);
  const uint32_t version = 1, width = 4;
  const uint64_t vocab = static_cast<uint64_t>(vocab_size), count = tokens.size();
  std::memcpy(header + 8, &version, 4);
  std::memcpy(header + 12, &width, 4);
  std::memcpy(header + 16, &vocab, 8);
  std::memcpy(header + 24, &count, 8);
  io::AtomicFileWriter out(path);
  out.write(header, kHeaderBytes);
  out.write(tokens.data(), tokens.size() * sizeof(int32_t));
  out.commit();
}

namespace {

void encode_in_pieces(const std::string& doc, const Tokenizer& tokenizer, std::vector<int32_t>& out, size_t piece_bytes) {
  // One encode call over a long line costs many times its size; pieces keep it bounded. A piece
  // ends before whitespace in its second half (SentencePiece starts each word at a space, so the
  // tokens are those of the whole text), else at a UTF-8 character boundary.
  piece_bytes = std::max<size_t>(piece_bytes, 2);
  size_t pos = 0;
  while (pos < doc.size()) {
    size_t end = std::min(doc.size(), pos + piece_bytes);
    if (end < doc.size()) {
      const size_t cut = doc.find_last_of(" \t\r\n", end);
      if (cut != std::string::npos && cut > pos + piece_bytes / 2) {
        end = cut;
      } else {
        while (end > pos + 1 && (static_cast<unsigned char>(doc[end]) & 0xC0) == 0x80) --end;
      }
    }
    const auto ids = tokenizer.encode(doc.substr(pos, end - pos));
    out.insert(out.end(), ids.begin(), ids.end());
    pos = end;
  }
}

}  // namespace

int64_t tokenize_corpus(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& path,
                        size_t piece_bytes) {
  std::vector<int32_t> tokens;
  for (const std::string& doc : documents) {
    encode_in_pieces(doc, tokenizer, tokens, piece_bytes);
    tokens.push_back(tokenizer.eos_id());
  }
  write_token_file(path, tokens, tokenizer.vocab_size());
  return static_cast<int64_t>(tokens.size());
}

TokenFile::TokenFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::invalid_argument("token file " + path + " cannot be opened: " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kHeaderBytes) {
    ::close(fd);
    throw std::invalid_argument("token file " + path + " is too short to have a header");
  }
  map_bytes_ = static_cast<size_t>(st.st_size);
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    throw std::invalid_argument("token file " + path + " cannot be mapped");
  }
  const char* p = static_cast<const char*>(map_);
  uint32_t version = 0, width = 0;
  uint64_t vocab = 0, count = 0;
  std::memcpy(&version, p + 8, 4);
  std::memcpy(&width, p + 12, 4);
  std::memcpy(&vocab, p + 16, 8);
  std::memcpy(&count, p + 24, 8);
  auto fail = [&](const std::string& why) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw std::invalid_argument("token file " + path + " " + why);
  };
  if (std::memcmp(p, kMagic, 8) != 0) fail("is not a frugal token file (bad magic)");
  if (version != 1 || width != 4) fail("has an unsupported version or token width");
  if (vocab == 0 || vocab > (1ull << 31)) fail("has a bad vocabulary size");
  if (count > (map_bytes_ - kHeaderBytes) / 4 || count * 4 != map_bytes_ - kHeaderBytes) {
    fail("says it holds " + std::to_string(count) + " tokens but its size says otherwise");
  }
  count_ = static_cast<int64_t>(count);
  vocab_ = static_cast<int64_t>(vocab);
  tokens_ = at::from_blob(const_cast<char*>(p) + kHeaderBytes, {count_}, at::TensorOptions().dtype(at::kInt));
  if (count_ > 0 && ((tokens_ < 0) | (tokens_ >= vocab_)).any().item<bool>()) fail("holds tokens outside its vocabulary");
}

TokenFile::~TokenFile() {
  tokens_ = at::Tensor();
  if (map_) ::munmap(map_, map_bytes_);
}

TokenDataset::TokenDataset(const std::string& token_file, double val_fraction)
    : file_(std::make_shared<TokenFile>(token_file)) {
  if (!(val_fraction >= 0 && val_fraction < 1)) throw std::invalid_argument("val_fraction must be in [0, 1)");
  train_end_ = file_->size() - static_cast<int64_t>(val_fraction * static_cast<double>(file_->size()));
}

std::pair<at::Tensor, at::Tensor> TokenDataset::gather(const std::vector<int64_t>& starts, int64_t seq) const {
  const at::Tensor s = at::tensor(starts, at::kLong).unsqueeze(1);      // (B, 1)
  const at::Tensor idx = s + at::arange(seq + 1, at::kLong).unsqueeze(0);  // (B, T+1)
  const at::Tensor windows = file_->tokens().index_select(0, idx.reshape({-1})).reshape(idx.sizes()).to(at::kLong);
  return {windows.narrow(1, 0, seq).contiguous(), windows.narrow(1, 1, seq).contiguous()};
}

std::pair<at::Tensor, at::Tensor> TokenDataset::train_batch(int64_t step, int64_t batch, int64_t seq, uint64_t seed) const {
  if (train_end_ < seq + 1) {
    throw std::invalid_argument("the training split has " + std::to_string(train_end_) + " tokens, fewer than seq_len + 1 = " +
                                std::to_string(seq + 1));
  }
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(step));
  std::uniform_int_distribution<int64_t> pick(0, train_end_ - seq - 1);
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  for (auto& s : starts) s = pick(rng);
  return gather(starts, seq);
}

std::pair<at::Tensor, at::Tensor> TokenDataset::val_batch(int64_t index, int64_t batch, int64_t seq) const {
  const int64_t n = val_tokens();
  if (n < seq + 1) {
    throw std::invalid_argument("the validation split has " + std::to_string(n) + " tokens, fewer than seq_len + 1 = " +
                                std::to_string(seq + 1));
  }
  const int64_t windows = (n - 1) / seq;
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) starts[static_cast<size_t>(b)] = train_end_ + ((index * batch + b) % windows) * seq;
  return gather(starts, seq);
}

}  // namespace data
}  // namespace frugal
