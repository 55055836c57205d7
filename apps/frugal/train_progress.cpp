#include "train_progress.h"

#include <algorithm>
#include <cstdio>

#include "frugal/io/units.h"

namespace frugal {
namespace cli {

std::string format_duration(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s);
  if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(t / 3600), static_cast<long long>(t / 60 % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(t / 60), static_cast<long long>(t % 60));
  }
  return buf;
}

train::LogFn TrainProgress::log() {
  return [this](const std::string& line) { message(line); };
}

train::ProgressFn TrainProgress::on_progress() {
  return [this](const train::StepProgress& p) { step(p); };
}

void TrainProgress::message(const std::string& line) {
  end_line();
  std::fprintf(stderr, "%s%s\n", prefix_.c_str(), line.c_str());
}

void TrainProgress::end_line() {
  if (mid_line_) std::fprintf(stderr, "\n");
  mid_line_ = false;
}

void TrainProgress::step(const train::StepProgress& p) {
  const std::string live = io::human_bytes(p.live_bytes), peak = io::human_bytes(p.peak_bytes);
  const std::string eta = format_duration(p.eta_s);
  if (bar_) {
    const int width = 24;
    const int filled = static_cast<int>(width * p.step / std::max<int64_t>(1, p.total_steps));
    std::fprintf(stderr, "\r[%s%s] step %lld/%lld  loss %.4f  %.0f tok/s  mem %s (peak %s)  ETA %s   ",
                 std::string(static_cast<size_t>(filled), '#').c_str(), std::string(static_cast<size_t>(width - filled), '.').c_str(),
                 static_cast<long long>(p.step), static_cast<long long>(p.total_steps), p.loss, p.tokens_per_s, live.c_str(),
                 peak.c_str(), eta.c_str());
    mid_line_ = true;
    if (p.step == p.total_steps) end_line();
  } else if (p.at_log_interval) {
    char line[256];
    std::snprintf(line, sizeof(line), "step %lld/%lld  loss %.4f  lr %.3g  %.0f tok/s  mem %s (peak %s)  ETA %s",
                  static_cast<long long>(p.step), static_cast<long long>(p.total_steps), p.loss, p.lr, p.interval_tokens_per_s,
                  live.c_str(), peak.c_str(), eta.c_str());
    message(line);
  }
}

}  // namespace cli
}  // namespace frugal
