#include "metrics_file.h"

#include <sstream>
#include <stdexcept>

#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json_value.h"

namespace frugal {
namespace train {

void truncate_metrics(const std::string& path, int64_t last_step) {
  if (!io::path_exists(path)) return;
  std::istringstream in(io::read_file(path, io::kWholeDataFileBytes, "metrics file"));
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      const io::JsonValue j = io::parse_json(line);
      if (j.at("step").as_int() <= last_step) kept += line + "\n";
    } catch (const std::exception&) {
      // a line cut by a kill: dropped
    }
  }
  io::write_file_atomic(path, kept);
}

MetricsFile::MetricsFile(const std::string& path, int64_t first_step) {
  io::make_directories(io::parent_path(path));
  if (first_step == 0) {
    io::write_file_atomic(path, "");
  } else {
    truncate_metrics(path, first_step);
  }
  file_.reset(std::fopen(path.c_str(), "a"));
  if (!file_) throw std::runtime_error("cannot open " + path);
}

void MetricsFile::step(int64_t step, double loss, double lr, double tokens_per_s, int64_t live_bytes, int64_t peak_bytes) {
  std::fprintf(
      file_.get(), "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6g, \"tokens_per_s\": %.1f, \"live_bytes\": %lld, \"peak_bytes\": %lld}\n",
      static_cast<long long>(step), loss, lr, tokens_per_s, static_cast<long long>(live_bytes), static_cast<long long>(peak_bytes));
  std::fflush(file_.get());
}

void MetricsFile::validation(int64_t step, double val_loss) {
  std::fprintf(file_.get(), "{\"step\": %lld, \"val_loss\": %.6f}\n", static_cast<long long>(step), val_loss);
  std::fflush(file_.get());
}

}  // namespace train
}  // namespace frugal
