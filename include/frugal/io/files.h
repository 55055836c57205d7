// frugal/io/files.h — small file-system helpers shared by the checkpoint and data code.
//
//   std::string text = frugal::io::read_file("config.json");   // std::invalid_argument if unreadable
//   frugal::io::make_directories("out/run/step-00000010");
#pragma once

#include <string>

namespace frugal {
namespace io {

// The whole file; throws std::invalid_argument naming the path when it cannot be read.
std::string read_file(const std::string& path);
bool is_regular_file(const std::string& path);
bool path_exists(const std::string& path);
// Creates the folder and its missing parents; throws std::runtime_error when it cannot.
void make_directories(const std::string& dir);
// The folder part of a path ("" for a bare name).
std::string parent_path(const std::string& path);

}  // namespace io
}  // namespace frugal
