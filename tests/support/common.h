// tests/support/common.h — how far apart two results are, and where a test's files go.
//
//   EXPECT_LE(frugal::testing::max_diff(a, b), 1e-6);          // tensors of any floating dtype
//   EXPECT_EQ(frugal::testing::max_param_diff(m1, m2), 0.0);    // same-shaped modules
//   const std::string path = frugal::testing::temp_path("x.safetensors");  // this process's own
//   frugal::testing::write_file(path, bytes);
#pragma once

#include <gtest/gtest.h>
#include <torch/nn/module.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <string>

#include "frugal/models/generation.h"

namespace frugal {
namespace testing {

// Largest absolute difference, computed in fp32; 0 when both are undefined, +inf when one is.
inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined()) return a.defined() == b.defined() ? 0.0 : INFINITY;
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

// Largest absolute difference between the parameters of two modules of the same structure.
inline double max_param_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double m = 0;
  const auto pa = a.parameters(), pb = b.parameters();
  EXPECT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size() && i < pb.size(); ++i) m = std::max(m, max_diff(pa[i], pb[i]));
  return m;
}

// A path in GoogleTest's temporary folder that no other test process uses: frugal_<pid>_<name>.
inline std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/frugal_" + std::to_string(::getpid()) + "_" + name;
}

// Writes `bytes` to `path` as they are (a test's fixture file).
inline void write_file(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Generation that always takes the most likely token: n new tokens, temperature 0.
inline models::GenerationOptions greedy(int64_t n) { return models::GenerationOptions().max_new_tokens(n).temperature(0); }

// A progress callback that prints nothing.
inline void quiet(const std::string& /*line*/) {}

// Runs `body` in a child process (for process-wide settings, such as glibc's heap thresholds) and
// returns its exit status (100 when it did not exit).
template <typename Body>
int in_child(Body body) {
  const pid_t pid = ::fork();
  if (pid == 0) std::_Exit(body());
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 100;
}

}  // namespace testing
}  // namespace frugal
