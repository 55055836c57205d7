// out_dir/metrics.jsonl, the training run's metrics: one JSON object per line. Private to src/train.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace frugal {
namespace train {

// Keeps the metrics lines of steps <= last_step (a resumed run rewrites what came after).
void truncate_metrics(const std::string& path, int64_t last_step);

// One JSON object per line, each flushed as written (a killed run keeps every line it wrote).
// Closed when destroyed, so every way out of the run closes it.
class MetricsFile {
 public:
  // A fresh file for a run from step 0; a resumed run keeps the lines of steps <= first_step.
  MetricsFile(const std::string& path, int64_t first_step);
  void step(int64_t step, double loss, double lr, double tokens_per_s, int64_t live_bytes, int64_t peak_bytes);
  void validation(int64_t step, double val_loss);

 private:
  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, Close> file_;
};

}  // namespace train
}  // namespace frugal
