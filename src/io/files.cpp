#include "frugal/io/files.h"

#include <sys/stat.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace frugal {
namespace io {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::invalid_argument(path + " cannot be read");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool is_regular_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool path_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void make_directories(const std::string& dir) {
  if (dir.empty()) return;
  std::string partial = dir[0] == '/' ? "/" : "";
  std::stringstream parts(dir);
  std::string piece;
  while (std::getline(parts, piece, '/')) {
    if (piece.empty()) continue;
    partial += piece + "/";
    ::mkdir(partial.c_str(), 0755);
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw std::runtime_error("cannot create folder " + dir);
}

std::string parent_path(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace io
}  // namespace frugal
