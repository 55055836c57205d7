// frugal/io/atomic_file.h — write a file so that a crash never leaves it half-written.
//
// The bytes go to a temporary file next to the target, are fsync'ed, and the temporary is renamed
// over the target (then the folder is fsync'ed): readers see the old file or the new one, never a mix.
//
//   frugal::io::write_file_atomic("out/account.json", json_text);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace frugal {
namespace io {

// Throws std::runtime_error naming the path and the system error when any step fails.
void write_file_atomic(const std::string& path, const std::string& contents);

// The same for large files written piece by piece. Until commit() the target is untouched; a
// writer destroyed without commit() removes its temporary file.
//
// For tests of crash safety, commit() kills the process (SIGKILL) right after it has put a file in
// place whose path contains $FRUGAL_TEST_KILL_AFTER_WRITING, if that is set and not empty.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path);  // creates the temporary file next to `path`; std::runtime_error if it cannot
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  void write(const void* data, size_t bytes);                      // appends at the current end
  void write_at(uint64_t offset, const void* data, size_t bytes);  // overwrites (a header's count)
  void truncate(uint64_t bytes);                                   // drops everything after the first `bytes`; writes continue there
  void commit();                                                   // fsync, rename onto the target, fsync the folder

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

// fsyncs a folder (after files were created or renamed in it).
void sync_directory(const std::string& dir);

}  // namespace io
}  // namespace frugal
