// frugal bench train — the default recipe with every memory technique on and off, each with fp32
// and with bf16 products (bf16 where the CPU multiplies it in hardware, unless --bf16 says), and
// with each technique alone off: throughput (the median step of each corner's fastest of a few
// interleaved runs), achieved FLOP/s against this machine's matrix-product speed at the same
// precision, the peak-memory ratios, and the techniques' targets, all measured in one run.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <sstream>

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

int bench_train(int argc, char** argv) {
  std::string recipe_path = "default", json_out = "-";
  int64_t steps = 8, rounds = 3;
  std::vector<std::string> overrides;
  Args args("bench train",
            "Runs a few steps of a recipe (a path or a shipped recipe's name; default: default) with its memory techniques on and\n"
            "off, each with fp32 and with bf16 matrix products, and with each technique alone off; reports tokens/s of the\n"
            "median step, peaks, achieved GFLOP/s against the matrix-product GFLOP/s of the same precision measured in the\n"
            "same run, and whether the techniques' targets are met (all on in bf16 at least all off's fp32 speed at most\n"
            "0.35 of its peak; all on in fp32 at least 0.85 of its speed).");
  args.add_string("recipe", &recipe_path, "the recipe: a file or a shipped recipe's name (tiny, default, ...)", "RECIPE");
  args.add_int("steps", &steps, "steps per configuration (the first one is not timed)", 2, kMaxSteps);
  args.add_int("rounds", &rounds,
               "runs of each of the four corners, interleaved; each reports its fastest run (a shared machine's slow spells "
               "fall on single runs)",
               1, 100);
  std::string bf16 = "auto";
  args.add_string("bf16", &bf16,
                  "the two bf16 corners: auto (run them where the CPU multiplies bf16 in hardware; elsewhere bf16 products "
                  "are emulated, slower than fp32 and not what the recipe's compute_dtype auto picks), on, off",
                  "WHEN");
  args.add_rest(&overrides, "section.key=value");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  if (bf16 != "auto" && bf16 != "on" && bf16 != "off") throw UsageError("--bf16 must be auto, on or off, not '" + bf16 + "'");
  recipe_path = resolve_recipe(recipe_path);
  try {
    // The runs write into a temporary folder; the data files stay where the recipe puts them, so
    // the tokenizer is trained once, not per run.
    const train::Recipe base = train::load_recipe(recipe_path, overrides);
    overrides.push_back("data.tokenizer=" + base.tokenizer);
    overrides.push_back("data.tokens=" + base.tokens);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  overrides.push_back("train.steps=" + std::to_string(steps));
  overrides.push_back("schedule.warmup_steps=1");
  overrides.push_back("train.checkpoint_interval=0");
  overrides.push_back("train.eval_interval=0");
  overrides.push_back("train.log_interval=1000000");
  // A folder that exists while the inputs are checked; the runs' own is made after.
  overrides.push_back("train.out_dir=" + io::TempDir::base());
  train::Recipe on;
  try {
    on = train::load_recipe(recipe_path, overrides);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  check_recipe_inputs(on, /*data=*/true);
  // The runs' checkpoints and metrics: removed on every way out, SIGINT, SIGTERM and SIGHUP included.
  const io::TempDir out_dir("frugal-bench-train");
  on.out_dir = out_dir.path();
  warn_if_slow_blas();
  // The four corners: the recipe's techniques on and off, each with fp32 and with bf16 products
  // (autocast over fp32 parameters; a bf16-parameter recipe computes in bf16 either way).
  auto with_compute = [](train::Recipe r, train::ComputeDtype c) {
    r.compute_dtype = c;
    return r;
  };
  const train::Recipe on32 = with_compute(on, train::ComputeDtype::fp32), on16 = with_compute(on, train::ComputeDtype::bf16);
  const train::Recipe off32 = train::without_techniques(on32), off16 = train::without_techniques(on16);
  std::string bf16_why;
  const bool fast_bf16 = precision::fast_bf16(on.device.type(), &bf16_why);
  const bool with_bf16 = bf16 == "on" || (bf16 == "auto" && fast_bf16);
  TrainProgress shown("frugal bench train: ", /*bar=*/false);
  const train::LogFn log = shown.log();
  auto train_run = [&](const train::Recipe& r) {
    return train::run_training(r, train::TrainOptions().sample(false).on_progress(shown.on_progress()), log);
  };
  const std::string techniques =
      std::string("checkpointing ") +
      (on.activation_budget > 0 ? "planned for " + io::human_bytes(on.activation_budget) : on.checkpointing.name()) + ", chunked loss " +
      (on.loss.chunked() ? "on" : "off") + ", optimizer " + (on.in_backward() ? "inside backward" : "after backward");
  // Off before on, fp32 before bf16, alternating, so a slow spell of a shared machine falls on
  // both sides of a ratio rather than on one.
  // Each corner reports its fastest run of `rounds` (by the median step after the first, which
  // warms the allocator and the kernels up): on a shared machine a neighbour's burst slows whole
  // runs, and the fastest of a few interleaved runs is what the code costs.
  const double tokens_per_step = static_cast<double>(on.tokens_per_step());
  auto median_step_s = [&](const train::TrainResult& r) {
    std::vector<double> t;
    for (size_t i = 1; i < r.timings.size(); ++i) t.push_back(r.timings[i].total_s);
    if (t.empty()) return tokens_per_step / std::max(r.tokens_per_s, 1e-9);
    return median(t);
  };
  train::TrainResult r_off, r_on16, r_on, r_off16;
  if (!with_bf16) log("bf16 corners skipped (" + bf16_why + "; --bf16 on runs them)");
  auto keep_fastest = [&](train::TrainResult& best, train::TrainResult run, int64_t round) {
    if (round == 0 || median_step_s(run) < median_step_s(best)) best = std::move(run);
  };
  for (int64_t round = 0; round < rounds; ++round) {
    const std::string of = rounds > 1 ? " (round " + std::to_string(round + 1) + " of " + std::to_string(rounds) + ")" : "";
    log("all techniques off, fp32 products" + of);
    keep_fastest(r_off, train_run(off32), round);
    if (with_bf16) {
      log("all techniques on (" + techniques + "), bf16 products" + of);
      keep_fastest(r_on16, train_run(on16), round);
    }
    log("all techniques on" + std::string(with_bf16 ? "" : " (" + techniques + ")") + ", fp32 products" + of);
    keep_fastest(r_on, train_run(on32), round);
    if (with_bf16) {
      log("all techniques off, bf16 products" + of);
      keep_fastest(r_off16, train_run(off16), round);
    }
  }
  // Where the techniques' time goes (fp32): the recipe with one technique at a time turned off.
  struct Without {
    const char* name;
    train::Recipe recipe;
    train::TrainResult result;
  };
  std::vector<Without> without;
  if (on32.checkpointing.name() != "none" || on32.activation_budget > 0) {
    train::Recipe r = on32;
    r.checkpointing = checkpoint::CheckpointPolicy::none();
    r.activation_budget = 0;
    without.push_back({"checkpointing", r, {}});
  }
  if (on32.loss.chunked()) {
    train::Recipe r = on32;
    r.loss.chunked(false);
    without.push_back({"chunked_loss", r, {}});
  }
  if (on32.in_backward()) {
    train::Recipe r = on32;
    r.optimizer.mode(optim::Mode::standard);
    without.push_back({"in_backward", r, {}});
  }
  for (Without& w : without) {
    log(std::string("all techniques on but ") + w.name + ", fp32 products");
    w.result = train_run(w.recipe);
  }
  const double matmul = bench::measure_matmul_gflops(1024, 0.5);
  const double matmul_bf16 = with_bf16 ? bench::measure_compute_matmul_gflops(at::kBFloat16, 1024, 0.5) : 0.0;
  auto tps = [&](const train::TrainResult& r) { return tokens_per_step / median_step_s(r); };
  // Matrix products executed per second (recompute included), and the model's own (3x forward).
  auto achieved = [&](const train::Recipe& recipe, const train::TrainResult& r) {
    return train::step_matmul_flops(recipe, r) / median_step_s(r) / 1e9;
  };
  auto model_gflops = [&](const train::Recipe& recipe, const train::TrainResult& r) {
    return train::step_matmul_flops(recipe, r, /*with_recompute=*/false) / median_step_s(r) / 1e9;
  };
  const double off_peak = static_cast<double>(r_off.peak.peak_bytes);
  const double bf16_speed = with_bf16 ? tps(r_on16) / tps(r_off) : 0.0;
  const double bf16_peak = with_bf16 ? static_cast<double>(r_on16.peak.peak_bytes) / off_peak : 0.0;
  const double fp32_speed = tps(r_on) / tps(r_off);
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("train").key("recipe").value(on.name).key("steps").value(steps).key("rounds").value(rounds);
  w.key("n_params").value(r_on.n_params);
  w.key("techniques").value(techniques);
  w.key("recomputed_blocks").value(r_on.recomputed_blocks);
  if (with_bf16) w.key("recomputed_blocks_bf16").value(r_on16.recomputed_blocks);
  w.key("fast_bf16").value(fast_bf16).key("fast_bf16_reason").value(bf16_why);
  w.key("bf16_corners").value(with_bf16);  // false: every *_bf16 key and bf16 target below is left out
  // fp32 products (all off is the reference every ratio divides by), then bf16 products.
  w.key("tokens_per_s_all_on").value(tps(r_on)).key("tokens_per_s_all_off").value(tps(r_off));
  w.key("peak_bytes_all_on").value(r_on.peak.peak_bytes).key("peak_bytes_all_off").value(r_off.peak.peak_bytes);
  w.key("all_on_over_all_off").value(fp32_speed);
  w.key("matmul_gflops").value(matmul);
  w.key("achieved_gflops").value(achieved(on32, r_on)).key("achieved_over_matmul").value(achieved(on32, r_on) / matmul);
  w.key("achieved_gflops_all_off").value(achieved(off32, r_off)).key("model_gflops").value(model_gflops(on32, r_on));
  w.key("peak_ratio").value(static_cast<double>(r_on.peak.peak_bytes) / off_peak);
  w.key("estimated_peak_all_on").value(r_on.estimate.peak_bytes).key("estimated_peak_all_off").value(r_off.estimate.peak_bytes);
  if (with_bf16) {
    w.key("tokens_per_s_all_on_bf16").value(tps(r_on16)).key("tokens_per_s_all_off_bf16").value(tps(r_off16));
    w.key("peak_bytes_all_on_bf16").value(r_on16.peak.peak_bytes).key("peak_bytes_all_off_bf16").value(r_off16.peak.peak_bytes);
    w.key("matmul_gflops_bf16").value(matmul_bf16);
    w.key("achieved_gflops_bf16")
        .value(achieved(on16, r_on16))
        .key("achieved_over_matmul_bf16")
        .value(achieved(on16, r_on16) / matmul_bf16);
    w.key("achieved_gflops_all_off_bf16").value(achieved(off16, r_off16)).key("model_gflops_bf16").value(model_gflops(on16, r_on16));
    w.key("estimated_peak_all_on_bf16").value(r_on16.estimate.peak_bytes);
  }
  // The targets, each against all off in fp32 measured in this run.
  w.key("targets").begin_object();
  if (with_bf16) {
    w.key("bf16_all_on_speed")
        .begin_object()
        .key("value")
        .value(bf16_speed)
        .key("at_least")
        .value(1.0)
        .key("met")
        .value(bf16_speed >= 1.0)
        .end_object();
    w.key("bf16_all_on_peak")
        .begin_object()
        .key("value")
        .value(bf16_peak)
        .key("at_most")
        .value(0.35)
        .key("met")
        .value(bf16_peak <= 0.35)
        .end_object();
  }
  w.key("fp32_all_on_speed")
      .begin_object()
      .key("value")
      .value(fp32_speed)
      .key("at_least")
      .value(0.85)
      .key("met")
      .value(fp32_speed >= 0.85)
      .end_object();
  w.end_object();
  // One technique off at a time: its tokens/s and peak, and what turning it on costs in speed.
  w.key("without").begin_object();
  for (const Without& x : without) {
    w.key(x.name).begin_object().key("tokens_per_s").value(tps(x.result)).key("peak_bytes").value(x.result.peak.peak_bytes);
    w.key("all_on_over_this").value(tps(r_on) / tps(x.result)).end_object();
  }
  w.end_object();
  w.end_object();
  auto row = [&](const char* name, const train::Recipe& recipe, const train::TrainResult& r, double mm) {
    std::fprintf(stderr, "  %-26s %7.0f tokens/s  %6.3fx  peak %10s  %5.3f  %6.1f GFLOP/s (%3.0f%% of matmul)  %lld blocks recomputed\n",
                 name, tps(r), tps(r) / tps(r_off), io::human_bytes(r.peak.peak_bytes).c_str(),
                 static_cast<double>(r.peak.peak_bytes) / off_peak, achieved(recipe, r), 100 * achieved(recipe, r) / mm,
                 static_cast<long long>(r.recomputed_blocks));
  };
  std::fprintf(stderr, "against all off in fp32 (speed, peak; each corner its fastest of %lld runs):\n", static_cast<long long>(rounds));
  row("all off, fp32", off32, r_off, matmul);
  row("all on, fp32", on32, r_on, matmul);
  if (with_bf16) {
    row("all off, bf16", off16, r_off16, matmul_bf16);
    row("all on, bf16", on16, r_on16, matmul_bf16);
  }
  for (const Without& x : without) {
    std::fprintf(stderr, "  without %s (fp32): %.0f tokens/s (all on is %.2fx of it), peak %s\n", x.name, tps(x.result),
                 tps(r_on) / tps(x.result), io::human_bytes(x.result.peak.peak_bytes).c_str());
  }
  if (with_bf16) {
    std::fprintf(stderr,
                 "matmul %.1f GFLOP/s fp32, %.1f bf16 (%s); targets: bf16 all on %.2fx of all off (>= 1: %s), peak %.3f (<= 0.35: %s); ",
                 matmul, matmul_bf16, bf16_why.c_str(), bf16_speed, bf16_speed >= 1.0 ? "met" : "not met", bf16_peak,
                 bf16_peak <= 0.35 ? "met" : "not met");
  } else {
    std::fprintf(stderr, "matmul %.1f GFLOP/s fp32; bf16 corners skipped (%s); targets: ", matmul, bf16_why.c_str());
  }
  std::fprintf(stderr, "fp32 all on %.2fx (>= 0.85: %s)\n", fp32_speed, fp32_speed >= 0.85 ? "met" : "not met");
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
