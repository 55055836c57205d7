// frugal/io/atomic_file.h — write a file so that a crash never leaves it half-written.
//
// The bytes go to a temporary file next to the target, are fsync'ed, and the temporary is renamed
// over the target (then the folder is fsync'ed): readers see the old file or the new one, never a mix.
//
//   frugal::io::write_file_atomic("out/account.json", json_text);
#pragma once

#include <string>

namespace frugal {
namespace io {

// Throws std::runtime_error naming the path and the system error when any step fails.
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace io
}  // namespace frugal
