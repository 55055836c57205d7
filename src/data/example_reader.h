// Reading example datasets: the files a dataset path names, and their records (JSON Lines, or the
// items of one JSON array), a record at a time (src/data only; examples.cpp uses it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "frugal/io/files.h"

namespace frugal {
namespace data {

// Every *.jsonl / *.json file below the paths (folders walked in sorted order, each real file
// once). std::invalid_argument for a missing path, a non-regular file (a FIFO), or no files.
std::vector<std::string> dataset_files(const std::vector<std::string>& paths);

struct Record {
  std::string text;
  int64_t line = 0, bytes = 0;  // where it starts (1-based); its length
  bool overlong = false;        // longer than the reader's max_bytes: text is empty
};

// The records of one file, read in 64 KiB pieces: its lines (blank ones skipped, a trailing "\r"
// dropped; a UTF-8 byte-order mark at the start skipped), or, when the file's first byte other than
// whitespace is '[', the items of that array. A record longer than max_bytes is not kept, only
// counted. Opened by io::open_regular_file (a regular file only, never waited on) and read up to its
// size at open. Structural errors of
// an array (which no skipping can step over) and read errors throw std::invalid_argument naming
// file and line.
class RecordReader {
 public:
  RecordReader(const std::string& path, int64_t max_bytes);
  ~RecordReader();
  RecordReader(const RecordReader&) = delete;
  RecordReader& operator=(const RecordReader&) = delete;
  bool next(Record& r);                        // false at the end
  bool saw_anything() const { return seen_; }  // a record (or an array item) was found

 private:
  bool fill();
  int peek();
  int get();
  void skip_space();
  void keep(Record& r, const char* p, size_t n);
  [[noreturn]] void fail(const std::string& why) const;
  bool next_line(Record& r);
  bool next_item(Record& r);
  std::string path_;
  size_t max_;
  io::ReadableFile file_;  // read up to its size at open
  std::vector<char> buf_;
  size_t pos_ = 0, len_ = 0;
  int64_t line_ = 1, items_ = 0;
  bool array_ = false, after_comma_ = false, seen_ = false;
};

// Where the first byte that is not UTF-8 lies (overlong forms and surrogates included), or npos.
size_t invalid_utf8_at(const std::string& s);

}  // namespace data
}  // namespace frugal
