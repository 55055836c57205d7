#include "train_progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <vector>

#include "frugal/io/numbers.h"
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
  drawn_ = 0;
}

int terminal_columns(int fd) {
  struct winsize ws {};
  if (::ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  // As terminals do, a COLUMNS that is not a width is ignored (never half-read: "80x" is not 80).
  if (const char* c = std::getenv("COLUMNS")) {
    const std::optional<int64_t> n = io::to_int(c);
    if (n && *n >= 1 && *n <= 100000) return static_cast<int>(*n);
  }
  return 80;
}

std::string format_bar(const train::StepProgress& p, int columns) {
  char step[48], loss[32], lr[32], speed[32];
  std::snprintf(step, sizeof(step), "step %lld/%lld", static_cast<long long>(p.step), static_cast<long long>(p.total_steps));
  std::snprintf(loss, sizeof(loss), "loss %.4f", p.loss);
  std::snprintf(lr, sizeof(lr), "lr %.2e", p.lr);
  std::snprintf(speed, sizeof(speed), "%.0f tok/s", p.tokens_per_s);
  // In display order; `rank` is the order of dropping (1 goes first, 0 never goes).
  struct Field {
    std::string text;
    int rank;
  };
  std::vector<Field> fields = {
      {"", 5},  // the bar, filled in below at the width left over
      {step, 0},
      {loss, 0},
      {lr, 4},
      {speed, 1},
      {"mem " + io::human_bytes(p.live_bytes), 3},
      {"(peak " + io::human_bytes(p.peak_bytes) + ")", 2},
      {"ETA " + format_duration(p.eta_s), 6},
  };
  const int room = std::max(columns - 1, 1);
  constexpr int kMinBar = 12, kMaxBar = 26;  // "[" + cells + "]"
  auto join = [&](size_t from) {
    std::string line;
    for (size_t i = from; i < fields.size(); ++i) {
      if (fields[i].text.empty()) continue;
      if (!line.empty()) line += fields[i].text[0] == '(' ? " " : "  ";  // "mem X (peak Y)"
      line += fields[i].text;
    }
    return line;
  };
  for (int rank = 1; rank <= 6; ++rank) {
    const bool bar = fields[0].rank > 0;
    if (static_cast<int>(join(1).size()) + (bar ? kMinBar + 2 : 0) <= room) break;
    for (Field& f : fields) {
      if (f.rank == rank) f.text.clear(), f.rank = -1;
    }
  }
  if (fields[0].rank > 0) {
    const int cells = std::min(kMaxBar, room - static_cast<int>(join(1).size()) - 2) - 2;
    const int filled = static_cast<int>(cells * p.step / std::max<int64_t>(1, p.total_steps));
    fields[0].text = std::string("[").append(static_cast<size_t>(filled), '#').append(static_cast<size_t>(cells - filled), '.').append("]");
  }
  const std::string line = join(0);
  return line.substr(0, static_cast<size_t>(room));
}

void TrainProgress::step(const train::StepProgress& p) {
  const std::string live = io::human_bytes(p.live_bytes), peak = io::human_bytes(p.peak_bytes);
  const std::string eta = format_duration(p.eta_s);
  if (bar_) {
    // Fitted to the width now, so a narrowed window does not turn the bar into a scroll of lines.
    const std::string line = format_bar(p, terminal_columns(STDERR_FILENO));
    const size_t blank = drawn_ > line.size() ? drawn_ - line.size() : 0;
    std::fprintf(stderr, "\r%s%s", line.c_str(), std::string(blank, ' ').c_str());
    if (blank) std::fprintf(stderr, "\r%s", line.c_str());
    drawn_ = line.size();
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
