// frugal bench NAME — benchmarks that print memory and time against the plain version as ratios,
// measured in one run. NAME: checkpoint, chunked-loss, optim-in-backward, train, optim-state,
// data-parallel, packing.
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"

namespace frugal {
namespace cli {
namespace {

const char* kBenchUsage =
    "usage: frugal bench NAME [flags] [--json-out FILE]\n"
    "\n"
    "benchmarks:\n"
    "  checkpoint   forward+backward time and kept activation bytes of each checkpointing policy\n"
    "               against none (time_ratio, memory_ratio), on a 12-layer d=256 stack, and the\n"
    "               budget planner's plans at 25%, 50% and 75% of the plain activation peak\n"
    "  chunked-loss peak memory and time of the chunked cross-entropy against the plain one (the\n"
    "               logits made whole), 8192 tokens, hidden 512, vocabulary 32000\n"
    "  optim-in-backward  peak memory and time of a training step with AdamW stepped inside backward\n"
    "               against the standard step (12 layers, d 512, batch 1, seq 64)\n"
    "  train        the default recipe with every memory technique on and off: tokens/s, achieved\n"
    "               GFLOP/s against matmul GFLOP/s, peak_bytes_all_on / peak_bytes_all_off\n"
    "  optim-state  AdamW state in fp32, bf16, 8-bit, 4-bit: bytes per parameter, step time vs fp32,\n"
    "               and with --steps N the default recipe's final loss per precision\n"
    "  data-parallel  a recipe on 1 rank and on N ranks with the cores split between them: tokens/s,\n"
    "               bytes on the wire per step against the minimum, each rank's peak by category\n"
    "  packing      an examples recipe (alpaca-tiny) one example a row against packed: tokens/s of real\n"
    "               tokens, padding share, steps and seconds an epoch\n"
    "\n"
    "'frugal bench NAME --help' describes its flags.\n";

}  // namespace

int run_bench(int argc, char** argv) {
  if (argc < 3)
    throw UsageError(
        "bench needs a benchmark name (checkpoint, chunked-loss, optim-in-backward, train, optim-state, data-parallel, packing); 'frugal "
        "bench --help' lists them");
  if (std::string(argv[2]) == "--help" || std::string(argv[2]) == "-h") {
    std::cout << kBenchUsage;
    return 0;
  }
  const std::string name = argv[2];
  if (name == "checkpoint") return bench_checkpoint(argc, argv);
  if (name == "chunked-loss") return bench_chunked_loss(argc, argv);
  if (name == "optim-in-backward") return bench_optim_in_backward(argc, argv);
  if (name == "train") return bench_train(argc, argv);
  if (name == "optim-state") return bench_optim_state(argc, argv);
  if (name == "data-parallel") return bench_data_parallel(argc, argv);
  if (name == "packing") return bench_packing(argc, argv);
  throw UsageError("unknown benchmark '" + name +
                   "' (allowed: checkpoint, chunked-loss, optim-in-backward, train, optim-state, data-parallel, packing)");
}

}  // namespace cli
}  // namespace frugal
