// apps/frugal/train_progress.h — how `frugal train` and the training benchmarks show a run: a bar
// redrawn on one line (a terminal) or a plain line every train.log_interval steps, and the run's
// messages, all on stderr, each message line starting with a prefix.
//
//   TrainProgress progress("frugal train: ", /*bar=*/::isatty(STDERR_FILENO));
//   auto result = train::run_training(recipe, train::TrainOptions().on_progress(progress.on_progress()), progress.log());
//   // on an error: progress.end_line(); then print it
#pragma once

#include <string>

#include "frugal/train/trainer.h"

namespace frugal {
namespace cli {

class TrainProgress {
 public:
  TrainProgress(std::string prefix, bool bar) : prefix_(std::move(prefix)), bar_(bar) {}
  TrainProgress(const TrainProgress&) = delete;
  TrainProgress& operator=(const TrainProgress&) = delete;

  // Callbacks for run_training; they refer to this object, which must outlive the run.
  train::LogFn log();
  train::ProgressFn on_progress();

  void message(const std::string& line);    // "<prefix><line>", on a line of its own
  void step(const train::StepProgress& p);  // the bar, or a line at the log interval
  void end_line();                          // ends a half-drawn bar line

 private:
  std::string prefix_;
  bool bar_;
  bool mid_line_ = false;  // the bar is drawn and its line not ended
  size_t drawn_ = 0;       // characters of the bar now on the line, to blank a longer one
};

// "4m05s", or "1h07m" from an hour on.
std::string format_duration(double seconds);

// The bar for one step in at most columns - 1 characters (the last column would wrap on some
// terminals): fields are dropped, least important first (tok/s, peak, memory, lr, the bar itself,
// ETA), until it fits; step and loss always stay.
std::string format_bar(const train::StepProgress& p, int columns);

// The width of the terminal on fd (TIOCGWINSZ), else $COLUMNS, else 80.
int terminal_columns(int fd);

}  // namespace cli
}  // namespace frugal
