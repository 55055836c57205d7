// frugal report — turn an allocation trace (--trace-out) into files people open: a snapshot for
// PyTorch's memory viewer (--memory-viz).
#include <fstream>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/memory/memory_viz.h"

namespace frugal {
namespace cli {

int run_report(int argc, char** argv) {
  std::string trace_path, viz_out;
  Args args("report",
            "Converts an allocation trace written with --trace-out. --memory-viz writes the pickle that\n"
            "PyTorch's memory viewer (pytorch.org/memory_viz) opens: every allocation with its category.");
  args.add_positional("TRACE", &trace_path, "a trace written by frugal account or frugal train with --trace-out");
  args.add_string("memory-viz", &viz_out, "write a snapshot pickle for PyTorch's memory viewer", "FILE");
  if (!args.parse(argc, argv, 2)) return 0;
  if (viz_out.empty()) throw UsageError("nothing to write: give --memory-viz FILE");
  std::ifstream in(trace_path, std::ios::binary);
  if (!in) throw UsageError("trace " + trace_path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  std::vector<memory::MemoryEvent> events;
  try {
    events = memory::read_timeline_json(text.str());
  } catch (const std::invalid_argument& e) {
    throw UsageError(trace_path + ": " + e.what());
  }
  write_output(viz_out, memory::memory_viz_pickle(events));
  std::cout << "wrote " << viz_out << " from " << events.size() << " events\n";
  return 0;
}

}  // namespace cli
}  // namespace frugal
