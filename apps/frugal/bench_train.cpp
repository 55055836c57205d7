// frugal bench train — the default recipe with every memory technique on and off, each with fp32
// and with bf16 products (bf16 where the CPU multiplies it in hardware, unless --bf16 says), and
// with each technique alone off: throughput (the median step of each corner's fastest of a few
// interleaved runs), achieved FLOP/s against this machine's matrix-product speed at the same
// precision, the peak-memory ratios, and the techniques' targets, all measured in one run.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <iostream>
#include <sstream>
#include <utility>

#include "args.h"
#include "commands.h"
#include "frugal/bench/hardware.h"
#include "frugal/precision/autocast.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"
#include "frugal/train/trainer.h"
#include "train_progress.h"

namespace frugal {
namespace cli {

namespace {

// The flags of `frugal bench train`.
struct BenchTrainFlags {
  std::string recipe_path = "default", json_out = "-", bf16 = "auto";
  int64_t steps = 8, rounds = 3;
  std::vector<std::string> overrides;
};

// Reads the flags; false for --help.
bool parse_bench_train_flags(int argc, char** argv, BenchTrainFlags& f) {
  Args args("bench train",
            "Runs a few steps of a recipe (a path or a shipped recipe's name; default: default) with its memory techniques on and\n"
            "off, each with fp32 and with bf16 matrix products, and with each technique alone off; reports tokens/s of the\n"
            "median step, peaks, achieved GFLOP/s against the matrix-product GFLOP/s of the same precision measured in the\n"
            "same run, and whether the techniques' targets are met (all on in bf16 at least all off's fp32 speed at most\n"
            "0.35 of its peak; all on in fp32 at least 0.85 of its speed).");
  args.add_string("recipe", &f.recipe_path, "the recipe: a file or a shipped recipe's name (tiny, default, ...)", "RECIPE");
  args.add_int("steps", &f.steps, "steps per configuration (the first one is not timed)", 2, kMaxSteps);
  args.add_int("rounds", &f.rounds,
               "runs of each of the four corners, interleaved; each reports its fastest run (a shared machine's slow spells "
               "fall on single runs)",
               1, 100);
  args.add_string("bf16", &f.bf16,
                  "the two bf16 corners: auto (run them where the CPU multiplies bf16 in hardware; elsewhere bf16 products "
                  "are emulated, slower than fp32 and not what the recipe's compute_dtype auto picks), on, off",
                  "WHEN");
  args.add_rest(&f.overrides, "section.key=value");
  args.add_output("json-out", &f.json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return false;
  if (f.bf16 != "auto" && f.bf16 != "on" && f.bf16 != "off") throw UsageError("--bf16 must be auto, on or off, not '" + f.bf16 + "'");
  f.recipe_path = resolve_recipe(f.recipe_path);
  return true;
}

// The recipe with every technique on, as the runs use it: a few steps, no checkpoints, evaluation
// or logging, the data files where the recipe puts them (so the tokenizer is trained once, not per
// run), and out_dir a folder that exists while the inputs are checked (the runs' own is set after).
train::Recipe bench_recipe(const BenchTrainFlags& f) {
  std::vector<std::string> overrides = f.overrides;
  try {
    const train::Recipe base = train::load_recipe(f.recipe_path, overrides);
    overrides.push_back("data.tokenizer=" + base.tokenizer);
    overrides.push_back("data.tokens=" + base.tokens);
    for (const std::string& o :
         {"train.steps=" + std::to_string(f.steps), std::string("schedule.warmup_steps=1"), std::string("train.checkpoint_interval=0"),
          std::string("train.eval_interval=0"), std::string("train.log_interval=1000000"), "train.out_dir=" + io::TempDir::base()}) {
      overrides.push_back(o);
    }
    train::Recipe on = train::load_recipe(f.recipe_path, overrides);
    check_recipe_inputs(on, /*data=*/true);
    return on;
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
}

// One configuration: its name in the table, its recipe, and the result of its fastest round.
struct Run {
  std::string name;
  train::Recipe recipe;
  train::TrainResult result;
};

// The runs of a benchmark and the figures computed from them, each in one place so the JSON and
// the table print the same numbers.
struct TrainBench {
  TrainBench(const BenchTrainFlags& f, train::Recipe recipe) : flags(f), on(std::move(recipe)) {}

  const BenchTrainFlags& flags;
  train::Recipe on;
  std::string techniques;  // what "all on" turns on, in words
  bool fast_bf16 = false, with_bf16 = false;
  std::string bf16_why;
  // The four corners: the recipe's techniques on and off, each with fp32 and with bf16 products
  // (autocast over fp32 parameters; a bf16-parameter recipe computes in bf16 either way).
  Run off32, on32, off16, on16;
  std::vector<Run> without;  // the recipe with one technique at a time turned off (fp32)
  double matmul = 0, matmul_bf16 = 0;

  // The median step after the first (which warms the allocator and the kernels up).
  double median_step_s(const train::TrainResult& r) const {
    std::vector<double> t;
    for (size_t i = 1; i < r.timings.size(); ++i) t.push_back(r.timings[i].total_s);
    const double tokens = static_cast<double>(on.tokens_per_step());
    if (t.empty()) return tokens / std::max(r.tokens_per_s, 1e-9);
    return median(t);
  }
  double tps(const Run& r) const { return static_cast<double>(on.tokens_per_step()) / median_step_s(r.result); }
  // Matrix products executed per second (recompute included), and the model's own (3x forward).
  double achieved(const Run& r) const { return train::step_matmul_flops(r.recipe, r.result) / median_step_s(r.result) / 1e9; }
  double model_gflops(const Run& r) const {
    return train::step_matmul_flops(r.recipe, r.result, /*with_recompute=*/false) / median_step_s(r.result) / 1e9;
  }
  // Peaks against all off in fp32, the reference every ratio divides by.
  double peak_ratio(const Run& r) const {
    return static_cast<double>(r.result.peak.peak_bytes) / static_cast<double>(off32.result.peak.peak_bytes);
  }
  double fp32_speed() const { return tps(on32) / tps(off32); }
  double bf16_speed() const { return with_bf16 ? tps(on16) / tps(off32) : 0.0; }
  double bf16_peak() const { return with_bf16 ? peak_ratio(on16) : 0.0; }
};

// Off before on, fp32 before bf16, alternating, so a slow spell of a shared machine falls on both
// sides of a ratio rather than on one; each corner keeps its fastest of `rounds` runs (a
// neighbour's burst slows whole runs, and the fastest of a few interleaved runs is what the code
// costs). Then each technique alone off, once.
void run_configurations(TrainBench& b, const train::LogFn& log, const std::function<train::TrainResult(const train::Recipe&)>& train_run) {
  if (!b.with_bf16) log("bf16 corners skipped (" + b.bf16_why + "; --bf16 on runs them)");
  auto keep_fastest = [&](Run& best, int64_t round) {
    train::TrainResult run = train_run(best.recipe);
    if (round == 0 || b.median_step_s(run) < b.median_step_s(best.result)) best.result = std::move(run);
  };
  const int64_t rounds = b.flags.rounds;
  for (int64_t round = 0; round < rounds; ++round) {
    const std::string of = rounds > 1 ? " (round " + std::to_string(round + 1) + " of " + std::to_string(rounds) + ")" : "";
    log("all techniques off, fp32 products" + of);
    keep_fastest(b.off32, round);
    if (b.with_bf16) {
      log("all techniques on (" + b.techniques + "), bf16 products" + of);
      keep_fastest(b.on16, round);
    }
    log("all techniques on" + std::string(b.with_bf16 ? "" : " (" + b.techniques + ")") + ", fp32 products" + of);
    keep_fastest(b.on32, round);
    if (b.with_bf16) {
      log("all techniques off, bf16 products" + of);
      keep_fastest(b.off16, round);
    }
  }
  const train::Recipe& on32 = b.on32.recipe;
  if (on32.checkpointing.name() != "none" || on32.activation_budget > 0) {
    train::Recipe r = on32;
    r.checkpointing = checkpoint::CheckpointPolicy::none();
    r.activation_budget = 0;
    b.without.push_back({"checkpointing", r, {}});
  }
  if (on32.loss.chunked()) {
    train::Recipe r = on32;
    r.loss.chunked(false);
    b.without.push_back({"chunked_loss", r, {}});
  }
  if (on32.in_backward()) {
    train::Recipe r = on32;
    r.optimizer.mode(optim::Mode::standard);
    b.without.push_back({"in_backward", r, {}});
  }
  for (Run& w : b.without) {
    log("all techniques on but " + w.name + ", fp32 products");
    w.result = train_run(w.recipe);
  }
}

// {"value": v, "at_least"/"at_most": bound, "met": ...}
void write_target(io::JsonWriter& w, const char* name, double value, const char* relation, double bound) {
  const bool met = std::string(relation) == "at_least" ? value >= bound : value <= bound;
  w.key(name).begin_object().key("value").value(value).key(relation).value(bound).key("met").value(met).end_object();
}

std::string bench_train_json(const TrainBench& b) {
  std::ostringstream json;
  io::JsonWriter w(json);
  const BenchTrainFlags& f = b.flags;
  w.begin_object().key("benchmark").value("train").key("recipe").value(b.on.name).key("steps").value(f.steps).key("rounds").value(f.rounds);
  w.key("n_params").value(b.on32.result.n_params);
  w.key("techniques").value(b.techniques);
  w.key("recomputed_blocks").value(b.on32.result.recomputed_blocks);
  if (b.with_bf16) w.key("recomputed_blocks_bf16").value(b.on16.result.recomputed_blocks);
  w.key("fast_bf16").value(b.fast_bf16).key("fast_bf16_reason").value(b.bf16_why);
  w.key("bf16_corners").value(b.with_bf16);  // false: every *_bf16 key and bf16 target below is left out
  // fp32 products (all off is the reference every ratio divides by), then bf16 products.
  w.key("tokens_per_s_all_on").value(b.tps(b.on32)).key("tokens_per_s_all_off").value(b.tps(b.off32));
  w.key("peak_bytes_all_on").value(b.on32.result.peak.peak_bytes).key("peak_bytes_all_off").value(b.off32.result.peak.peak_bytes);
  w.key("all_on_over_all_off").value(b.fp32_speed());
  w.key("matmul_gflops").value(b.matmul);
  w.key("achieved_gflops").value(b.achieved(b.on32)).key("achieved_over_matmul").value(b.achieved(b.on32) / b.matmul);
  w.key("achieved_gflops_all_off").value(b.achieved(b.off32)).key("model_gflops").value(b.model_gflops(b.on32));
  w.key("peak_ratio").value(b.peak_ratio(b.on32));
  w.key("estimated_peak_all_on")
      .value(b.on32.result.estimate.peak_bytes)
      .key("estimated_peak_all_off")
      .value(b.off32.result.estimate.peak_bytes);
  if (b.with_bf16) {
    w.key("tokens_per_s_all_on_bf16").value(b.tps(b.on16)).key("tokens_per_s_all_off_bf16").value(b.tps(b.off16));
    w.key("peak_bytes_all_on_bf16")
        .value(b.on16.result.peak.peak_bytes)
        .key("peak_bytes_all_off_bf16")
        .value(b.off16.result.peak.peak_bytes);
    w.key("matmul_gflops_bf16").value(b.matmul_bf16);
    w.key("achieved_gflops_bf16").value(b.achieved(b.on16)).key("achieved_over_matmul_bf16").value(b.achieved(b.on16) / b.matmul_bf16);
    w.key("achieved_gflops_all_off_bf16").value(b.achieved(b.off16)).key("model_gflops_bf16").value(b.model_gflops(b.on16));
    w.key("estimated_peak_all_on_bf16").value(b.on16.result.estimate.peak_bytes);
  }
  // The targets, each against all off in fp32 measured in this run.
  w.key("targets").begin_object();
  if (b.with_bf16) {
    write_target(w, "bf16_all_on_speed", b.bf16_speed(), "at_least", 1.0);
    write_target(w, "bf16_all_on_peak", b.bf16_peak(), "at_most", 0.35);
  }
  write_target(w, "fp32_all_on_speed", b.fp32_speed(), "at_least", 0.85);
  w.end_object();
  // One technique off at a time: its tokens/s and peak, and what turning it on costs in speed.
  w.key("without").begin_object();
  for (const Run& x : b.without) {
    w.key(x.name).begin_object().key("tokens_per_s").value(b.tps(x)).key("peak_bytes").value(x.result.peak.peak_bytes);
    w.key("all_on_over_this").value(b.tps(b.on32) / b.tps(x)).end_object();
  }
  w.end_object();
  w.end_object();
  return json.str();
}

void print_bench_train_table(const TrainBench& b) {
  auto row = [&](const Run& r, double mm) {
    std::fprintf(stderr, "  %-26s %7.0f tokens/s  %6.3fx  peak %10s  %5.3f  %6.1f GFLOP/s (%3.0f%% of matmul)  %lld blocks recomputed\n",
                 r.name.c_str(), b.tps(r), b.tps(r) / b.tps(b.off32), io::human_bytes(r.result.peak.peak_bytes).c_str(), b.peak_ratio(r),
                 b.achieved(r), 100 * b.achieved(r) / mm, static_cast<long long>(r.result.recomputed_blocks));
  };
  std::fprintf(stderr, "against all off in fp32 (speed, peak; each corner its fastest of %lld runs):\n",
               static_cast<long long>(b.flags.rounds));
  row(b.off32, b.matmul);
  row(b.on32, b.matmul);
  if (b.with_bf16) {
    row(b.off16, b.matmul_bf16);
    row(b.on16, b.matmul_bf16);
  }
  for (const Run& x : b.without) {
    std::fprintf(stderr, "  without %s (fp32): %.0f tokens/s (all on is %.2fx of it), peak %s\n", x.name.c_str(), b.tps(x),
                 b.tps(b.on32) / b.tps(x), io::human_bytes(x.result.peak.peak_bytes).c_str());
  }
  const double bf16_speed = b.bf16_speed(), bf16_peak = b.bf16_peak(), fp32_speed = b.fp32_speed();
  if (b.with_bf16) {
    std::fprintf(stderr,
                 "matmul %.1f GFLOP/s fp32, %.1f bf16 (%s); targets: bf16 all on %.2fx of all off (>= 1: %s), peak %.3f (<= 0.35: %s); ",
                 b.matmul, b.matmul_bf16, b.bf16_why.c_str(), bf16_speed, bf16_speed >= 1.0 ? "met" : "not met", bf16_peak,
                 bf16_peak <= 0.35 ? "met" : "not met");
  } else {
    std::fprintf(stderr, "matmul %.1f GFLOP/s fp32; bf16 corners skipped (%s); targets: ", b.matmul, b.bf16_why.c_str());
  }
  std::fprintf(stderr, "fp32 all on %.2fx (>= 0.85: %s)\n", fp32_speed, fp32_speed >= 0.85 ? "met" : "not met");
}

}  // namespace

int bench_train(int argc, char** argv) {
  BenchTrainFlags flags;
  if (!parse_bench_train_flags(argc, argv, flags)) return 0;
  TrainBench b(flags, bench_recipe(flags));
  // The runs' checkpoints and metrics: removed on every way out, SIGINT, SIGTERM and SIGHUP included.
  const io::TempDir out_dir("frugal-bench-train");
  b.on.out_dir = out_dir.path();
  warn_if_slow_blas();
  auto with_compute = [](train::Recipe r, train::ComputeDtype c) {
    r.compute_dtype = c;
    return r;
  };
  b.on32.name = "all on, fp32";
  b.on32.recipe = with_compute(b.on, train::ComputeDtype::fp32);
  b.on16.name = "all on, bf16";
  b.on16.recipe = with_compute(b.on, train::ComputeDtype::bf16);
  b.off32.name = "all off, fp32";
  b.off32.recipe = train::without_techniques(b.on32.recipe);
  b.off16.name = "all off, bf16";
  b.off16.recipe = train::without_techniques(b.on16.recipe);
  b.fast_bf16 = precision::fast_bf16(b.on.device.type(), &b.bf16_why);
  b.with_bf16 = flags.bf16 == "on" || (flags.bf16 == "auto" && b.fast_bf16);
  b.techniques = std::string("checkpointing ") +
                 (b.on.activation_budget > 0 ? "planned for " + io::human_bytes(b.on.activation_budget) : b.on.checkpointing.name()) +
                 ", chunked loss " + (b.on.loss.chunked() ? "on" : "off") + ", optimizer " +
                 (b.on.in_backward() ? "inside backward" : "after backward");
  TrainProgress shown("frugal bench train: ", /*bar=*/false);
  const train::LogFn log = shown.log();
  run_configurations(b, log, [&](const train::Recipe& r) {
    return train::run_training(r, train::TrainOptions().sample(false).on_progress(shown.on_progress()), log);
  });
  b.matmul = bench::measure_matmul_gflops(1024, 0.5);
  b.matmul_bf16 = b.with_bf16 ? bench::measure_compute_matmul_gflops(at::kBFloat16, 1024, 0.5) : 0.0;
  const std::string json = bench_train_json(b);
  print_bench_train_table(b);
  write_output(flags.json_out, json);
  return 0;
}

}  // namespace cli
}  // namespace frugal
