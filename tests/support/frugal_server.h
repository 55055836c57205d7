// tests/support/frugal_server.h — the wire format between frugal_test_client and
// frugal_test_server (tests/support/frugal_server.sh says why they exist).
//
// One connection per command. The client sends one message: its standard input, output and error
// as SCM_RIGHTS descriptors, then a payload of NUL-terminated strings: the working folder, the
// umask, each resource limit (soft, hard; RLIM_NLIMITS of them), the ignored and the blocked
// signals (bit s for signal s), the argument count and the arguments (argv[0] first), the
// environment entries; its length comes first as a uint32_t. The server answers with the worker's
// pid (int32_t: the client forwards the signals it receives to it), then its wait status (int32_t)
// once it has ended. A client that goes away (killed) gets its worker SIGKILLed.
#pragma once

#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>

namespace frugal {
namespace testing {

constexpr uint32_t kServerMaxPayload = 16u << 20;  // arguments and environment, at most

// Reads exactly n bytes from fd (through interruptions); false at the end of the stream or an error.
inline bool read_all(int fd, void* buf, size_t n) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::read(fd, p, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    p += got, n -= static_cast<size_t>(got);
  }
  return true;
}

}  // namespace testing
}  // namespace frugal
