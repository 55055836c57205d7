// frugal/io/files.h — the one way frugal opens a file to read it, the one owner of temporary
// folders, and small file-system helpers shared by the checkpoint and data code.
//
//   std::string text = frugal::io::read_file("config.json", frugal::io::kMetadataFileBytes);
//   frugal::io::ReadableFile f = frugal::io::open_regular_file("data.tokens", "token file");  // f.fd(), f.size()
//   frugal::io::TempDir tmp("frugal-bench");   // $TMPDIR/frugal-bench-<pid>-XXXXXX, gone on every way out
//
// Every file a command reads is opened by open_regular_file: without blocking (a FIFO would wait
// for a writer forever), refused unless it is a regular file (a FIFO, a device such as /dev/zero,
// a folder or a socket is named as such), and its size taken at open, so a file that grows while
// it is read is read to that size only. Errors are std::invalid_argument (the input's fault).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>
#include <utility>

namespace frugal {
namespace io {

// Bounds for files read whole, by what they are. A larger file is refused naming the bound.
constexpr uint64_t kPointerFileBytes = 4ull << 10;    // a one-line pointer such as a run's `latest`
constexpr uint64_t kMetadataFileBytes = 16ull << 20;  // config.json, generation_config.json, trainer_state.json,
                                                      // optimizer_index.json, *.index.json, tokenizer_config.json,
                                                      // chat_template.jinja, recipes, stamps
constexpr uint64_t kTokenizerFileBytes = 1ull << 30;  // tokenizer.json (tens of MB), tokenizer.model
constexpr uint64_t kWholeDataFileBytes = 4ull << 30;  // data read whole: eval texts and ids, traces

// A regular file open for reading (O_CLOEXEC, blocking reads), closed when destroyed.
class ReadableFile {
 public:
  ReadableFile() = default;
  ~ReadableFile();
  ReadableFile(ReadableFile&& other) noexcept;             // takes over other's descriptor; other is left closed
  ReadableFile& operator=(ReadableFile&& other) noexcept;  // closes this file, then takes over other's
  ReadableFile(const ReadableFile&) = delete;
  ReadableFile& operator=(const ReadableFile&) = delete;

  // The file descriptor, -1 when closed (or default-constructed).
  int fd() const { return fd_; }
  // The size in bytes at open: reads stop there even if the file grows.
  uint64_t size() const { return size_; }
  // The path it was opened with.
  const std::string& path() const { return path_; }
  // Up to n bytes from the current position, never past size(); 0 at size() (or at an earlier end
  // of a file that shrank). Throws std::invalid_argument naming the path on a read error.
  size_t read(void* buf, size_t n);
  void close();  // closes the descriptor now (read() then returns 0); closing twice is harmless

 private:
  friend ReadableFile open_regular_file(const std::string& path, const std::string& what);
  int fd_ = -1;
  uint64_t size_ = 0, offset_ = 0;
  std::string path_, what_;
};

// Opens `path` (symbolic links followed) for reading. Refuses, with one sentence naming the path
// (after `what`, e.g. "token file") and what it is, anything that is not a regular file; never
// blocks in open. Throws std::invalid_argument.
ReadableFile open_regular_file(const std::string& path, const std::string& what = "");

// The whole file through open_regular_file, at most max_bytes (one of the bounds above): a larger
// one is refused with a sentence naming the bound. Throws std::invalid_argument.
std::string read_file(const std::string& path, uint64_t max_bytes, const std::string& what = "");

// File content fit to quote in a message: at most max_bytes of it, a control byte (C0, DEL, C1) or
// a byte that is no part of valid UTF-8 written as \xNN, "..." when cut.
// Error messages quote file content (and paths) only through this.
std::string printable(const std::string& bytes, size_t max_bytes = 64);

bool is_regular_file(const std::string& path);
bool path_exists(const std::string& path);
// The bytes an unprivileged writer may still add to the file system holding `path` or, while it
// does not exist yet, its nearest existing parent folder; -1 when none can be asked.
int64_t free_space(const std::string& path);
// Creates the folder and its missing parents; throws std::runtime_error when it cannot.
void make_directories(const std::string& dir);
// Removes a file or a folder and everything under it (symlinks themselves, never what they point
// at); what is already gone is no error. Uses system calls only (no allocation), so the signal
// handler of TempDir runs the same code.
void remove_tree(const std::string& path);
// Removes `path` when destroyed (every way out of a scope, exceptions included; not signals:
// a temporary folder is a TempDir).
class TempPath {
 public:
  // Takes charge of `path` (which need not exist yet).
  explicit TempPath(std::string path) : path_(std::move(path)) {}
  ~TempPath() { remove_tree(path_); }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  // The path it removes.
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The one owner of temporary folders: makes <base>/<prefix>-<pid>-XXXXXX (base: $TMPDIR, or /tmp)
// with mkdtemp and removes it with everything in it on every way out: when destroyed (exceptions
// included), and when the process is ended by SIGINT, SIGTERM or SIGHUP (a handler removes every
// live TempDir of this process, then re-raises the signal with its default action). The handler
// is installed for a signal only while its disposition is the default one (an ignored SIGHUP stays
// ignored; a handler someone else installed wins while it is installed). Only the process that
// made a folder removes it (a forked child leaves its parent's alone). SIGKILL cannot be caught:
// making a TempDir removes the folders of the same prefix whose PID is dead.
// Make one only after the inputs are checked. Throws std::runtime_error when it cannot.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);  // makes the folder (after removing stale ones of `prefix`)
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  // The folder made.
  const std::string& path() const { return path_; }
  // $TMPDIR when set and not empty, else /tmp.
  static std::string base();
  // Removes <dir>/<prefix>-<pid>-XXXXXX folders whose PID is no live process; returns how many.
  static int remove_stale(const std::string& prefix, const std::string& dir = base());

 private:
  std::string path_;
  int slot_ = -1;
  pid_t owner_ = 0;
};

// The folder part of a path ("" for a bare name).
std::string parent_path(const std::string& path);

// Where frugal looks for a helper file it loads at run time (libfrugal_spm.so, libfrugal_cuda.so...),
// in order: $<env> when set, next to the running executable, in frugal's build folder (a build
// tree's own programs; absent from installed copies of frugal).
std::vector<std::string> helper_candidates(const char* env, const std::string& file);

}  // namespace io
}  // namespace frugal
