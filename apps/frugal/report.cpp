// frugal report — turn allocation traces (--trace-out) into files people open: a self-contained
// HTML page of one or more traces side by side (-o), and a snapshot for PyTorch's memory viewer
// (--memory-viz).
#include <iostream>
#include <stdexcept>

#include "args.h"
#include "commands.h"
#include "frugal/io/files.h"
#include "frugal/memory/html_report.h"
#include "frugal/memory/memory_viz.h"

namespace frugal {
namespace cli {
namespace {

memory::Trace load_trace(const std::string& path) {
  std::string text;
  try {
    text = io::read_file(path, io::kWholeDataFileBytes, "trace");  // a FIFO or a device is refused by name
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  try {
    return memory::read_trace(text);
  } catch (const std::invalid_argument& e) {
    throw UsageError(path + ": " + e.what());
  }
}

}  // namespace

int run_report(int argc, char** argv) {
  std::string first_trace, html_out, viz_out;
  std::vector<std::string> more_traces;
  Args args("report",
            "Turns allocation traces written with --trace-out into files to open. -o writes one HTML page\n"
            "(no network needed) with each trace's live memory by category over time, its peak and per-step\n"
            "peaks; several traces sit side by side on one scale, e.g. techniques on vs off. --memory-viz\n"
            "writes the pickle that PyTorch's memory viewer (pytorch.org/memory_viz) opens.");
  args.add_positional("TRACE", &first_trace, "a trace written by frugal account or frugal train with --trace-out");
  args.add_rest(&more_traces, "TRACE");
  args.add_output("out", &html_out, "write the HTML report here", "FILE");
  args.add_short('o', "out");
  args.add_output("memory-viz", &viz_out, "write a snapshot pickle for PyTorch's memory viewer (one trace only)", "FILE");
  if (!args.parse(argc, argv, 2)) return 0;
  if (html_out.empty() && viz_out.empty()) throw UsageError("nothing to write: give -o FILE.html or --memory-viz FILE");
  std::vector<std::string> paths{first_trace};
  paths.insert(paths.end(), more_traces.begin(), more_traces.end());
  if (!viz_out.empty() && paths.size() > 1) {
    throw UsageError("--memory-viz takes exactly one trace, got " + std::to_string(paths.size()));
  }

  std::vector<memory::NamedTrace> traces;
  size_t n_events = 0;
  for (const std::string& path : paths) {
    traces.push_back({path, load_trace(path)});
    n_events += traces.back().trace.events.size();
  }
  std::ostream& log = html_out == "-" || viz_out == "-" ? std::cerr : std::cout;  // keep stdout for the file
  if (!viz_out.empty()) {
    write_output(viz_out, memory::memory_viz_pickle(traces.front().trace));
    log << "wrote " << viz_out << " from " << n_events << " events\n";
  }
  if (!html_out.empty()) {
    write_output(html_out, memory::html_report(traces));
    log << "wrote " << html_out << " (" << traces.size() << (traces.size() == 1 ? " trace, " : " traces, ") << n_events << " events)\n";
  }
  return 0;
}

}  // namespace cli
}  // namespace frugal
