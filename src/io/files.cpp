#include "frugal/io/files.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <stdexcept>

namespace frugal {
namespace io {

std::string read_file(const std::string& path) {
  struct stat st {};
  // A folder opens as a stream and fails inside the library's reader: say what it is.
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) throw std::invalid_argument(path + " is a folder, not a file");
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

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* dir = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(dir)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") remove_tree(path + "/" + name);
      }
      ::closedir(dir);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

std::string parent_path(const std::string& path) {
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "" : path.substr(0, slash);
}

}  // namespace io
}  // namespace frugal
