// Reading example datasets a record at a time (see example_reader.h).
#include "example_reader.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <set>
#include <stdexcept>

namespace frugal {
namespace data {
namespace {

bool has_example_suffix(const std::string& name) {
  auto ends = [&](const char* s) {
    const size_t n = std::strlen(s);
    return name.size() >= n && name.compare(name.size() - n, n, s) == 0;
  };
  return ends(".jsonl") || ends(".json");
}

void collect(const std::string& path, std::vector<std::string>& out, std::set<std::pair<dev_t, ino_t>>& seen) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    throw std::invalid_argument("dataset " + path +
                                (errno == ENOENT ? " does not exist" : " cannot be read: " + std::string(std::strerror(errno))));
  }
  if (S_ISDIR(st.st_mode)) {
    if (!seen.insert({st.st_dev, st.st_ino}).second) return;
    DIR* dir = ::opendir(path.c_str());
    if (!dir) throw std::invalid_argument("dataset folder " + path + " cannot be read: " + std::strerror(errno));
    std::vector<std::string> names;
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(dir);
    std::sort(names.begin(), names.end());
    for (const auto& n : names) {
      const std::string child = path + "/" + n;
      struct stat cs {};
      if (::stat(child.c_str(), &cs) != 0) continue;  // a dangling link
      if (S_ISDIR(cs.st_mode) || has_example_suffix(n)) collect(child, out, seen);
    }
    return;
  }
  if (!S_ISREG(st.st_mode)) {
    throw std::invalid_argument("dataset file " + path + " is not a regular file (" +
                                (S_ISFIFO(st.st_mode)   ? "a FIFO"
                                 : S_ISSOCK(st.st_mode) ? "a socket"
                                                        : "a device") +
                                "); example files must be regular files");
  }
  out.push_back(path);
}

}  // namespace

std::vector<std::string> dataset_files(const std::vector<std::string>& paths) {
  if (paths.empty()) throw std::invalid_argument("no dataset files given");
  std::vector<std::string> files, unique;
  std::set<std::pair<dev_t, ino_t>> seen_dirs;
  for (const auto& p : paths) collect(p, files, seen_dirs);
  std::set<std::string> seen;
  for (const auto& f : files) {
    char real[PATH_MAX];
    if (!::realpath(f.c_str(), real) || seen.insert(real).second) unique.push_back(f);
  }
  if (unique.empty())
    throw std::invalid_argument("no *.jsonl or *.json files in the dataset (" + paths[0] + (paths.size() > 1 ? ", ..." : "") + ")");
  return unique;
}

RecordReader::RecordReader(const std::string& path, int64_t max_bytes)
    : path_(path), max_(static_cast<size_t>(std::max<int64_t>(max_bytes, 1))) {
  file_ = io::open_regular_file(path, "dataset file");  // a FIFO or a device is refused, never waited on
  buf_.resize(1 << 16);
  if (fill() && len_ >= 3 && std::memcmp(buf_.data(), "\xEF\xBB\xBF", 3) == 0) pos_ = 3;  // a UTF-8 byte-order mark
  skip_space();
  array_ = peek() == '[';
  if (array_) get();
}

RecordReader::~RecordReader() = default;

bool RecordReader::next(Record& r) { return array_ ? next_item(r) : next_line(r); }

bool RecordReader::fill() {
  len_ = file_.read(buf_.data(), buf_.size());
  pos_ = 0;
  return len_ > 0;
}

int RecordReader::peek() { return pos_ < len_ || fill() ? static_cast<unsigned char>(buf_[pos_]) : -1; }

int RecordReader::get() {
  const int c = peek();
  if (c >= 0) ++pos_;
  if (c == '\n') ++line_;
  return c;
}

void RecordReader::skip_space() {
  for (int c = peek(); c == ' ' || c == '\t' || c == '\r' || c == '\n'; c = peek()) get();
}

void RecordReader::keep(Record& r, const char* p, size_t n) {
  r.bytes += static_cast<int64_t>(n);
  if (r.overlong) return;
  if (r.text.size() + n > max_) {
    r.overlong = true;
    std::string().swap(r.text);
    return;
  }
  r.text.append(p, n);
}

void RecordReader::fail(const std::string& why) const {
  throw std::invalid_argument(path_ + " line " + std::to_string(line_) + ": not valid JSON: " + why);
}

bool RecordReader::next_line(Record& r) {
  for (;;) {
    r.text.clear();
    r.bytes = 0;
    r.overlong = false;
    r.line = line_;
    bool any = false, newline = false;
    while (!newline && (pos_ < len_ || fill())) {
      any = true;
      const char* p = buf_.data() + pos_;
      const void* nl = std::memchr(p, '\n', len_ - pos_);
      const size_t n = nl ? static_cast<size_t>(static_cast<const char*>(nl) - p) : len_ - pos_;
      keep(r, p, n);
      pos_ += n;
      if (nl) ++pos_, ++line_, newline = true;
    }
    if (!any) return false;
    if (!r.overlong && !r.text.empty() && r.text.back() == '\r') r.text.pop_back();
    if (r.overlong || r.text.find_first_not_of(" \t\r") != std::string::npos) {
      seen_ = true;
      return true;
    }
  }
}

bool RecordReader::next_item(Record& r) {
  skip_space();
  int c = peek();
  if (c < 0) fail("the array is not closed with ']'");
  if (c == ']') {
    if (items_ > 0 && after_comma_) fail("a ',' before ']'");
    get();
    skip_space();
    if (peek() >= 0) fail("bytes after the array's closing ']'");
    return false;
  }
  if (items_ > 0) {
    if (!after_comma_) {
      if (c != ',') fail("expected ',' or ']' after an item");
      get();
      after_comma_ = true;
      return next_item(r);
    }
  }
  after_comma_ = false;
  ++items_;
  seen_ = true;
  r.text.clear();
  r.bytes = 0;
  r.overlong = false;
  r.line = line_;
  // One value: nested brackets counted outside strings; a scalar ends at ',', ']' or whitespace.
  int depth = 0;
  bool in_string = false, escape = false;
  for (;;) {
    c = peek();
    if (c < 0) fail("the array is not closed with ']'");
    if (!in_string && depth == 0 && (c == ',' || c == ']' || c == ' ' || c == '\t' || c == '\r' || c == '\n') && r.bytes > 0) break;
    get();
    const char ch = static_cast<char>(c);
    keep(r, &ch, 1);
    if (in_string) {
      if (escape)
        escape = false;
      else if (ch == '\\')
        escape = true;
      else if (ch == '"')
        in_string = false;
      if (!in_string && depth == 0) break;
      continue;
    }
    if (ch == '"')
      in_string = true;
    else if (ch == '{' || ch == '[')
      ++depth;
    else if (ch == '}' || ch == ']') {
      if (--depth < 0) fail("unbalanced brackets");
      if (depth == 0) break;
    }
  }
  return true;
}

size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t n = 0;
    uint32_t cp = 0, min = 0;
    if ((c >> 5) == 6)
      n = 2, cp = c & 0x1F, min = 0x80;
    else if ((c >> 4) == 14)
      n = 3, cp = c & 0x0F, min = 0x800;
    else if ((c >> 3) == 30)
      n = 4, cp = c & 0x07, min = 0x10000;
    else
      return i;
    if (i + n > s.size()) return i;
    for (size_t k = 1; k < n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if ((b & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return i;
    i += n;
  }
  return std::string::npos;
}

}  // namespace data
}  // namespace frugal
