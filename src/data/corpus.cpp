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
#include "frugal/io/files.h"

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

// Reads the file in 64 KiB pieces, handing each to `piece`, up to the size it had when opened (a
// file that grows while it is read is not followed); a file that cannot be opened or read is an
// error with the system's reason (iostreams would report a read error as end of file).
template <typename Piece>
void read_pieces(const std::string& path, Piece&& piece) {
  io::ReadableFile f = io::open_regular_file(path, "corpus file");
  std::vector<char> buf(1 << 16);
  for (;;) {
    const size_t n = f.read(buf.data(), buf.size());
    if (n == 0) break;
    piece(buf.data(), n);
  }
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\n'; }

// What a first pass finds: a NUL byte (binary, e.g. fortune's .dat index files: skipped), and
// whether the file is in the fortune format (starts with "%\n" or holds "\n%\n").
struct FileKind {
  bool binary = false, fortune = false;
};

FileKind scan_file(const std::string& path) {
  FileKind kind;
  // Starting with "%\n" or holding "\n%\n" is holding "\n%\n" after a "\n" put in front. The
  // last two bytes of each piece go in front of the next, for a separator across two pieces.
  std::string window = "\n";
  read_pieces(path, [&](const char* p, size_t n) {
    if (std::memchr(p, '\0', n)) kind.binary = true;
    if (kind.fortune || kind.binary) return;
    window.append(p, n);
    kind.fortune = window.find("\n%\n") != std::string::npos;
    window.erase(0, window.size() - std::min<size_t>(window.size(), 2));
  });
  return kind;
}

// Every document of a corpus, streamed: sink.text(p, n) with the document's bytes in order, then
// sink.end(has_text), has_text false for a document of whitespace only (which is not one). A file
// in the fortune format is split at lines holding only "%" (each kept line ends with "\n"); any
// other text file is one document, byte for byte. Memory stays at one 64 KiB read.
template <typename Sink>
void stream_documents(const std::vector<std::string>& files, Sink& sink) {
  for (const std::string& f : files) {
    const FileKind kind = scan_file(f);
    if (kind.binary) continue;
    bool has_text = false;
    std::string out;  // the bytes of this read going to the current document
    auto emit = [&] {
      if (out.empty()) return;
      if (!has_text) has_text = std::any_of(out.begin(), out.end(), [](char c) { return !is_space(c); });
      sink.text(out.data(), out.size());
      out.clear();
    };
    auto end_document = [&] {
      emit();
      sink.end(has_text);
      has_text = false;
    };
    if (!kind.fortune) {
      read_pieces(f, [&](const char* p, size_t n) {
        out.assign(p, n);
        emit();
      });
      end_document();
      continue;
    }
    bool line_start = true, held_percent = false;  // a "%" opening a line, until the next byte says what it is
    read_pieces(f, [&](const char* p, size_t n) {
      for (size_t i = 0; i < n; ++i) {
        const char c = p[i];
        if (held_percent) {
          held_percent = false;
          if (c == '\n') {  // a "%" line: the document ends
            end_document();
            line_start = true;
            continue;
          }
          out += '%';
          line_start = false;
        }
        if (line_start && c == '%') {
          held_percent = true;
          continue;
        }
        out += c;
        line_start = c == '\n';
      }
      emit();
    });
    if (!held_percent && !line_start) out += '\n';  // the last line ends with "\n", as every kept line does
    end_document();                                 // a "%" at the very end closes the document too
  }
}

// The files of a corpus path in reading order, each real file once.
std::vector<std::string> corpus_files(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) throw std::invalid_argument("corpus " + path + " does not exist");
  if (!S_ISDIR(st.st_mode)) io::open_regular_file(path, "corpus");  // a FIFO or a device is refused by name
  std::vector<std::string> files, unique;
  std::set<std::pair<dev_t, ino_t>> seen_dirs;
  collect_files(path, files, seen_dirs);
  std::set<std::string> seen;
  for (const auto& f : files) {
    char real[PATH_MAX];
    if (::realpath(f.c_str(), real) && seen.insert(real).second) unique.push_back(f);  // skips links to a file already read
  }
  return unique;
}

// The token file, written as it is made: the header's count is filled in at the end, and a bounded
// buffer of tokens is all that is held. Tokens after a mark can be taken back.
class TokenFileWriter {
 public:
  TokenFileWriter(const std::string& path, int64_t vocab_size) : out_(path) {
    char header[kHeaderBytes] = {};
    std::memcpy(header, kMagic, 8);
    const uint32_t version = 1, width = 4;
    const uint64_t vocab = static_cast<uint64_t>(vocab_size);
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &width, 4);
    std::memcpy(header + 16, &vocab, 8);
    out_.write(header, kHeaderBytes);
  }
  void append(const int32_t* ids, size_t n) {
    buffer_.insert(buffer_.end(), ids, ids + n);
    if (buffer_.size() >= kBufferTokens) flush();
  }
  uint64_t count() const { return written_ + buffer_.size(); }
  void take_back_to(uint64_t count) {
    if (count >= written_) {
      buffer_.resize(count - written_);
    } else {
      buffer_.clear();
      out_.truncate(kHeaderBytes + count * sizeof(int32_t));
      written_ = count;
    }
  }
  void commit() {
    flush();
    const uint64_t n = written_;
    out_.write_at(24, &n, 8);
    out_.commit();
  }

 private:
  static constexpr size_t kBufferTokens = 1 << 16;
  void flush() {
    out_.write(buffer_.data(), buffer_.size() * sizeof(int32_t));
    written_ += buffer_.size();
    buffer_.clear();
  }
  io::AtomicFileWriter out_;
  std::vector<int32_t> buffer_;
  uint64_t written_ = 0;
};

// Encodes a document as it streams in. One encode call over a long line costs many times its
// size, so text is encoded in pieces of about piece_bytes: a piece ends before a space that follows
// a word in its second half (each tokenizer starts a word there, so the tokens are those of the
// whole text), else inside a run of spaces, else at a UTF-8 character boundary. Only a piece's
// worth of text waits at a time.
class DocumentEncoder {
 public:
  DocumentEncoder(const Tokenizer& tokenizer, TokenFileWriter& out, size_t piece_bytes)
      : tokenizer_(tokenizer), out_(out), piece_bytes_(std::max<size_t>(piece_bytes, 2)) {}
  void text(const char* p, size_t n) {
    pending_.append(p, n);
    size_t pos = 0;
    while (pending_.size() - pos > piece_bytes_) pos = encode_piece(pos);  // the text goes on past this piece
    pending_.erase(0, pos);
  }
  // Encodes what is left, then EOS; a document of whitespace only leaves no tokens.
  void end(bool has_text) {
    if (has_text) {
      if (!pending_.empty()) encode(pending_.data(), pending_.size());
      const int32_t eos = tokenizer_.eos_id();
      out_.append(&eos, 1);
      ++documents_;
    } else {
      out_.take_back_to(document_start_);
    }
    pending_.clear();
    continued_ = false;
    document_start_ = out_.count();
  }
  int64_t documents() const { return documents_; }

 private:
  size_t encode_piece(size_t pos) {  // pending_ holds more than piece_bytes_ from pos
    size_t end = pos + piece_bytes_;
    // A space right after a word's last character: SentencePiece (and a tokenizer.json with no
    // pre-tokenizer, Llama-2's) starts a word at a space that follows no space, and a regex
    // pre-tokenizer (GPT-2's, Llama-3's) starts a token where a run of whitespace begins. Any
    // other whitespace is no word start for SentencePiece ("a\nb" is one word), and a space after
    // other whitespace is none for the regexes ("\n  b" splits as "\n ", " b").
    // Else the last space of a run of spaces in the second half (the regexes give a run's last space
    // to the word after it; SentencePiece gives the whole text's ids unless it merges spaces), which
    // beats cutting a word.
    const size_t half = pos + piece_bytes_ / 2;
    size_t cut = end, in_run = 0;
    for (; cut > half; --cut) {
      if (pending_[cut] != ' ') continue;
      if (!is_space(pending_[cut - 1])) break;
      if (!in_run && pending_[cut - 1] == ' ') in_run = cut;
    }
    if (cut > half) {
      end = cut;
    } else if (in_run) {
      end = in_run;
    } else {
      while (end > pos + 1 && (static_cast<unsigned char>(pending_[end]) & 0xC0) == 0x80) --end;
    }
    encode(pending_.data() + pos, end - pos);
    return end;
  }
  void encode(const char* p, size_t n) {
    // A later piece of a text: the tokenizer's own word-start mark stands for its first space.
    if (continued_ && tokenizer_.prepends_space() && n > 0 && *p == ' ') ++p, --n;
    continued_ = true;
    const auto ids = tokenizer_.encode(std::string(p, n));
    out_.append(ids.data(), ids.size());
  }
  const Tokenizer& tokenizer_;
  TokenFileWriter& out_;
  size_t piece_bytes_;
  std::string pending_;
  bool continued_ = false;  // a piece of this document was encoded already
  uint64_t document_start_ = 0;
  int64_t documents_ = 0;
};

}  // namespace

std::vector<std::string> read_corpus(const std::string& path) {
  struct Collect {
    std::vector<std::string> docs;
    std::string doc;
    void text(const char* p, size_t n) { doc.append(p, n); }
    void end(bool has_text) {
      if (has_text) docs.push_back(doc);
      doc.clear();
    }
  } sink;
  stream_documents(corpus_files(path), sink);
  if (sink.docs.empty()) throw std::invalid_argument("corpus " + path + " holds no text");
  return std::move(sink.docs);
}

void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab_size) {
  TokenFileWriter out(path, vocab_size);
  out.append(tokens.data(), tokens.size());
  out.commit();
}

CorpusTokens tokenize_corpus(const std::string& corpus_path, const Tokenizer& tokenizer, const std::string& path, size_t piece_bytes) {
  const std::vector<std::string> files = corpus_files(corpus_path);
  TokenFileWriter out(path, tokenizer.vocab_size());
  DocumentEncoder encoder(tokenizer, out, piece_bytes);
  stream_documents(files, encoder);
  if (encoder.documents() == 0) throw std::invalid_argument("corpus " + corpus_path + " holds no text");
  CorpusTokens result;
  result.documents = encoder.documents();
  result.tokens = static_cast<int64_t>(out.count());
  out.commit();
  return result;
}

int64_t tokenize_documents(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& path,
                           size_t piece_bytes) {
  TokenFileWriter out(path, tokenizer.vocab_size());
  DocumentEncoder encoder(tokenizer, out, piece_bytes);
  for (const std::string& doc : documents) {
    encoder.text(doc.data(), doc.size());
    encoder.end(true);
  }
  const auto n = static_cast<int64_t>(out.count());
  out.commit();
  return n;
}

TokenFile::TokenFile(const std::string& path) {
  const io::ReadableFile f = io::open_regular_file(path, "token file");
  if (f.size() < kHeaderBytes) throw std::invalid_argument("token file " + path + " is too short to have a header");
  map_bytes_ = static_cast<size_t>(f.size());
  map_ = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, f.fd(), 0);
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

TokenDataset::TokenDataset(const std::string& token_file, double val_fraction) : file_(std::make_shared<TokenFile>(token_file)) {
  if (!(val_fraction >= 0 && val_fraction < 1)) throw std::invalid_argument("val_fraction must be in [0, 1)");
  train_end_ = file_->size() - static_cast<int64_t>(val_fraction * static_cast<double>(file_->size()));
}

std::pair<at::Tensor, at::Tensor> TokenDataset::gather(const std::vector<int64_t>& starts, int64_t seq) const {
  const at::Tensor s = at::tensor(starts, at::kLong).unsqueeze(1);         // (B, 1)
  const at::Tensor idx = s + at::arange(seq + 1, at::kLong).unsqueeze(0);  // (B, T+1)
  const at::Tensor windows = file_->tokens().index_select(0, idx.reshape({-1})).reshape(idx.sizes()).to(at::kLong);
  return {windows.narrow(1, 0, seq).contiguous(), windows.narrow(1, 1, seq).contiguous()};
}

std::pair<at::Tensor, at::Tensor> TokenDataset::train_batch(int64_t step, int64_t batch, int64_t seq, uint64_t seed) const {
  if (train_end_ < seq + 1) {
    throw std::invalid_argument("the training split has " + std::to_string(train_end_) +
                                " tokens, fewer than seq_len + 1 = " + std::to_string(seq + 1));
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
    throw std::invalid_argument("the validation split has " + std::to_string(n) +
                                " tokens, fewer than seq_len + 1 = " + std::to_string(seq + 1));
  }
  const int64_t windows = (n - 1) / seq;
  std::vector<int64_t> starts(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) starts[static_cast<size_t>(b)] = train_end_ + ((index * batch + b) % windows) * seq;
  return gather(starts, seq);
}

}  // namespace data
}  // namespace frugal
