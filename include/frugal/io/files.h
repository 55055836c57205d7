// frugal/io/files.h — small file-system helpers shared by the checkpoint and data code.
//
//   std::string text = frugal::io::read_file("config.json");   // std::invalid_argument if unreadable
//   frugal::io::make_directories("out/run/step-00000010");
#pragma once

#include <string>
#include <utility>

namespace frugal {
namespace io {

// The whole file; throws std::invalid_argument naming the path when it cannot be read.
std::string read_file(const std::string& path);
bool is_regular_file(const std::string& path);
bool path_exists(const std::string& path);
// Creates the folder and its missing parents; throws std::runtime_error when it cannot.
void make_directories(const std::string& dir);
// Removes a file or a folder and everything under it (symlinks themselves, never what they point
// at); what is already gone is no error.
void remove_tree(const std::string& path);
// Removes `path` when destroyed (every way out of a scope, exceptions included).
class TempPath {
 public:
  explicit TempPath(std::string path) : path_(std::move(path)) {}
  ~TempPath() { remove_tree(path_); }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};
// The folder part of a path ("" for a bare name).
std::string parent_path(const std::string& path);

}  // namespace io
}  // namespace frugal
