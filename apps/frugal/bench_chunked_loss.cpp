// frugal bench chunked-loss — peak memory and time of the chunked cross-entropy against the plain
// one, and how far their gradients are from ATen's Linear + cross_entropy.
#include <ATen/Parallel.h>

#include <cstdio>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/loss_benchmark.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"

namespace frugal {
namespace cli {

int bench_chunked_loss(int argc, char** argv) {
  bench::ChunkedLossConfig config;
  int64_t runs = config.timing_runs;
  std::string json_out = "-";
  Args args("bench chunked-loss",
            "Forward+backward of the loss over a final Linear (hidden -> vocabulary), plain (the logits made\n"
            "whole and kept) and chunked: peak bytes above the inputs (allocation tracker), median time, and\n"
            "the largest relative gap of either's gradients from ATen's Linear + cross_entropy.");
  args.add_int("tokens", &config.tokens, "tokens (rows of hidden states)", 1, int64_t{1} << 24);
  args.add_int("hidden", &config.hidden, "hidden size", 1, int64_t{1} << 24);
  args.add_int("vocab", &config.vocab, "vocabulary size", 2, (int64_t{1} << 31) - 1);
  args.add_int("chunk", &config.chunk, "tokens per chunk", 1, int64_t{1} << 24);
  args.add_int("runs", &runs, "timed runs (after one warm-up)", 1, kMaxRuns);
  args.add_device("device", &config.device, "where the tensors live");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  config.timing_runs = static_cast<int>(runs);
  warn_if_slow_blas();
  std::fprintf(stderr, "frugal bench chunked-loss: %lld tokens, hidden %lld, vocabulary %lld, chunks of %lld\n",
               static_cast<long long>(config.tokens), static_cast<long long>(config.hidden), static_cast<long long>(config.vocab),
               static_cast<long long>(config.chunk));
  const bench::ChunkedLossResult r = bench::run_chunked_loss_benchmark(config);
  const double memory_ratio = static_cast<double>(r.peak_bytes_chunked) / static_cast<double>(r.peak_bytes_plain);
  const double time_ratio = r.time_s_chunked / r.time_s_plain;
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("chunked-loss");
  w.key("config")
      .begin_object()
      .key("tokens")
      .value(config.tokens)
      .key("hidden")
      .value(config.hidden)
      .key("vocab")
      .value(config.vocab)
      .key("chunk")
      .value(config.chunk)
      .key("device")
      .value(config.device.str())
      .key("runs")
      .value(config.timing_runs)
      .key("threads")
      .value(at::get_num_threads())
      .end_object();
  w.key("peak_bytes_plain").value(r.peak_bytes_plain);
  w.key("peak_bytes_chunked").value(r.peak_bytes_chunked);
  w.key("memory_ratio").value(memory_ratio);
  w.key("time_s_plain").value(r.time_s_plain);
  w.key("time_s_chunked").value(r.time_s_chunked);
  w.key("time_ratio").value(time_ratio);
  w.key("max_rel_grad_diff").value(r.max_rel_grad_diff);
  w.key("loss_plain").value(r.loss_plain);
  w.key("loss_chunked").value(r.loss_chunked);
  w.end_object();
  std::fprintf(stderr, "peak: plain %s, chunked %s (memory_ratio %.3f); time_ratio %.3f; max_rel_grad_diff %.2e\n",
               io::human_bytes(r.peak_bytes_plain).c_str(), io::human_bytes(r.peak_bytes_chunked).c_str(), memory_ratio, time_ratio,
               r.max_rel_grad_diff);
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
