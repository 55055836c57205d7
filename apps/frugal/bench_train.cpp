// frugal bench train — the default recipe with every memory technique on and off, and with each
// one alone off: throughput (the median step), achieved model FLOP/s against this machine's
// matrix-product speed in fp32 and bf16, the peak-memory ratio, and what each technique costs.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/hardware.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"
#include "frugal/train/trainer.h"
#include "train_progress.h"

namespace frugal {
namespace cli {

int bench_train(int argc, char** argv) {
  std::string recipe_path = "default", json_out = "-";
  int64_t steps = 8;
  std::vector<std::string> overrides;
  Args args("bench train",
            "Runs a few steps of a recipe (a path or a shipped recipe's name; default: default) with its memory techniques on, then with\n"
            "every technique off, and reports tokens/s, achieved model GFLOP/s against the matrix-product GFLOP/s\n"
            "measured in the same run, and peak_bytes_all_on / peak_bytes_all_off.");
  args.add_string("recipe", &recipe_path, "the recipe: a file or a shipped recipe's name (tiny, default, ...)", "RECIPE");
  args.add_int("steps", &steps, "steps per configuration (the first one is not timed)", 2);
  args.add_rest(&overrides, "section.key=value");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
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
  char tmp[] = "/tmp/frugal-bench-train-XXXXXX";
  if (!::mkdtemp(tmp)) throw std::runtime_error("cannot create a temporary folder");
  overrides.push_back("train.steps=" + std::to_string(steps));
  overrides.push_back("schedule.warmup_steps=1");
  overrides.push_back("train.checkpoint_interval=0");
  overrides.push_back("train.eval_interval=0");
  overrides.push_back("train.log_interval=1000000");
  overrides.push_back(std::string("train.out_dir=") + tmp);
  train::Recipe on;
  try {
    on = train::load_recipe(recipe_path, overrides);
  } catch (const train::RecipeError& e) {
    ::rmdir(tmp);
    throw UsageError(e.what());
  }
  check_recipe_inputs(on, /*data=*/true);
  warn_if_slow_blas();
  const train::Recipe off = train::without_techniques(on);
  TrainProgress shown("frugal bench train: ", /*bar=*/false);
  const train::LogFn log = shown.log();
  log("all techniques on: checkpointing " + on.checkpointing.name() + ", chunked loss " + (on.loss.chunked() ? "on" : "off") +
      ", optimizer " + (on.in_backward() ? "inside backward" : "after backward"));
  const auto r_on = train::run_training(on, train::TrainOptions().sample(false).on_progress(shown.on_progress()), log);
  log("all techniques off");
  const auto r_off = train::run_training(off, train::TrainOptions().sample(false).on_progress(shown.on_progress()), log);
  // Where the techniques' time goes: the recipe with one technique at a time turned off.
  struct Without {
    const char* name;
    train::Recipe recipe;
    train::TrainResult result;
  };
  std::vector<Without> without;
  if (on.checkpointing.name() != "none" || on.activation_budget > 0) {
    train::Recipe r = on;
    r.checkpointing = checkpoint::CheckpointPolicy::none();
    r.activation_budget = 0;
    without.push_back({"checkpointing", r, {}});
  }
  if (on.loss.chunked()) {
    train::Recipe r = on;
    r.loss.chunked(false);
    without.push_back({"chunked_loss", r, {}});
  }
  if (on.in_backward()) {
    train::Recipe r = on;
    r.optimizer.mode(optim::Mode::standard);
    without.push_back({"in_backward", r, {}});
  }
  for (Without& w : without) {
    log(std::string("all techniques on but ") + w.name);
    w.result = train::run_training(w.recipe, train::TrainOptions().sample(false).on_progress(shown.on_progress()), log);
  }
  const double matmul = bench::measure_matmul_gflops(1024, 0.5);
  const double matmul_bf16 = bench::measure_bf16_matmul_gflops(1024, 0.5);
  // Tokens/s of the median step after the first (which warms the allocator and the kernels up).
  auto median_tokens_per_s = [&](const train::TrainResult& r) {
    std::vector<double> t;
    for (size_t i = 1; i < r.timings.size(); ++i) t.push_back(r.timings[i].total_s);
    if (t.empty()) return r.tokens_per_s;
    return static_cast<double>(on.batch_size * on.optimizer.accumulation_steps() * on.seq_len) / median(t);
  };
  const auto& c = on.model;
  const double flops_per_token = 6.0 * static_cast<double>(r_on.n_params) +
                                 12.0 * static_cast<double>(c.n_layers * c.dim * on.seq_len);
  const double achieved = flops_per_token * r_on.tokens_per_s / 1e9;
  const double ratio = static_cast<double>(r_on.peak.peak_bytes) / static_cast<double>(r_off.peak.peak_bytes);
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("train").key("recipe").value(on.name).key("steps").value(steps);
  w.key("n_params").value(r_on.n_params);
  w.key("tokens_per_s").value(r_on.tokens_per_s);
  w.key("tokens_per_s_all_off").value(r_off.tokens_per_s);
  w.key("model_flops_per_token").value(flops_per_token);
  w.key("achieved_gflops").value(achieved);
  w.key("matmul_gflops").value(matmul);
  w.key("achieved_over_matmul").value(achieved / matmul);
  w.key("matmul_gflops_bf16").value(matmul_bf16);
  w.key("tokens_per_s_all_on").value(median_tokens_per_s(r_on)).key("tokens_per_s_all_off_median").value(median_tokens_per_s(r_off));
  w.key("all_on_over_all_off").value(median_tokens_per_s(r_on) / median_tokens_per_s(r_off));
  w.key("peak_bytes_all_on").value(r_on.peak.peak_bytes);
  w.key("peak_bytes_all_off").value(r_off.peak.peak_bytes);
  // One technique off at a time: its tokens/s and peak, and what turning it on costs in speed.
  w.key("without").begin_object();
  for (const Without& x : without) {
    w.key(x.name).begin_object().key("tokens_per_s").value(median_tokens_per_s(x.result)).key("peak_bytes").value(x.result.peak.peak_bytes);
    w.key("all_on_over_this").value(median_tokens_per_s(r_on) / median_tokens_per_s(x.result)).end_object();
  }
  w.end_object();
  w.key("peak_ratio").value(ratio);
  w.key("estimated_peak_all_on").value(r_on.estimate.peak_bytes);
  w.key("estimated_peak_all_off").value(r_off.estimate.peak_bytes);
  w.end_object();
  std::fprintf(stderr, "tokens/s %.0f (all off %.0f); achieved %.1f GFLOP/s vs matmul %.1f GFLOP/s; peak %s on vs %s off (ratio %.3f)\n",
               r_on.tokens_per_s, r_off.tokens_per_s, achieved, matmul, io::human_bytes(r_on.peak.peak_bytes).c_str(),
               io::human_bytes(r_off.peak.peak_bytes).c_str(), ratio);
  for (const Without& x : without) {
    std::fprintf(stderr, "  without %s: %.0f tokens/s (all on is %.2fx of it), peak %s\n", x.name, median_tokens_per_s(x.result),
                 median_tokens_per_s(r_on) / median_tokens_per_s(x.result), io::human_bytes(x.result.peak.peak_bytes).c_str());
  }
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
