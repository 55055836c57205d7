// frugal bench packing — instruction examples one a row (padded to the longest of each micro-batch)
// against packed several a row: tokens/s of real (not padding) tokens, the share of padding, steps
// and seconds an epoch, measured in one run on the same recipe, data and model.
#include <unistd.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/train/trainer.h"

namespace frugal {
namespace cli {

int bench_packing(int argc, char** argv) {
  std::string recipe_path = "alpaca-tiny", json_out = "-";
  int64_t steps = 0;
  std::vector<std::string> overrides;
  Args args("bench packing",
            "Trains an examples recipe (default: alpaca-tiny) with its examples one a row and packed several a row, from the\n"
            "same model, and reports for each: tokens/s of the tokens that are not padding (after the first step), the share of\n"
            "padding over an epoch, steps an epoch, and the seconds an epoch takes at the measured speed.");
  args.add_string("recipe", &recipe_path, "an examples recipe: a file or a shipped recipe's name", "RECIPE");
  args.add_int("steps", &steps, "steps of each run (0: one epoch each)", 0, kMaxSteps);
  args.add_rest(&overrides, "section.key=value");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  recipe_path = resolve_recipe(recipe_path);
  try {  // the recipe checked before the temporary folder is made
    if (train::load_recipe(recipe_path, overrides).text_data()) {
      throw UsageError("bench packing needs an examples recipe (data.format alpaca, prompt_completion or messages)");
    }
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  const io::TempDir tmp("frugal-bench-packing");  // removed on every way out, signals included
  const std::string& out_dir = tmp.path();
  auto run = [&](bool packing) {
    std::vector<std::string> o = overrides;
    o.push_back(std::string("data.packing=") + (packing ? "true" : "false"));
    o.push_back("train.out_dir=" + out_dir + (packing ? "/packed" : "/rows"));
    o.push_back("data.tokens=" + out_dir + "/train.examples");  // tokenized once, for both runs
    o.push_back("train.checkpoint_interval=0");
    o.push_back("train.eval_interval=0");
    o.push_back("train.log_interval=1000000");
    o.push_back("train.sample_tokens=0");
    o.push_back("train.sample_prompt=");
    train::Recipe r;
    try {
      r = train::load_recipe(recipe_path, o);
    } catch (const train::RecipeError& e) {
      throw UsageError(e.what());
    }
    if (r.text_data()) throw UsageError("bench packing needs an examples recipe (data.format alpaca, prompt_completion or messages)");
    if (steps > 0) {
      o.push_back("train.epochs=0");
      o.push_back("train.steps=" + std::to_string(steps));
      o.push_back("schedule.warmup_steps=0");
      r = train::load_recipe(recipe_path, o);
    } else {
      o.push_back("train.epochs=1");
      r = train::load_recipe(recipe_path, o);
      r.schedule.warmup_steps(0);  // one epoch may be shorter than the recipe's warm-up
    }
    std::cerr << "frugal bench packing: " << (packing ? "packed" : "one example a row") << "...\n";
    try {
      return train::run_training(r, train::TrainOptions().sample(false), [](const std::string&) {});
    } catch (const train::RecipeError& e) {
      throw UsageError(e.what());
    }
  };
  const train::TrainResult rows = run(false), packed = run(true);
  // Real tokens a second over the steps after the first (which warms the allocator and kernels up).
  auto tokens_per_s = [](const train::TrainResult& r) {
    double tokens = 0, seconds = 0;
    for (size_t i = r.timings.size() > 1 ? 1 : 0; i < r.timings.size(); ++i) {
      tokens += static_cast<double>(r.timings[i].tokens);
      seconds += r.timings[i].total_s;
    }
    return tokens / std::max(seconds, 1e-9);
  };
  auto epoch_s = [&](const train::TrainResult& r) {
    double tokens = 0;
    for (const auto& t : r.timings) tokens += static_cast<double>(t.tokens);
    const double per_step = tokens / static_cast<double>(std::max<size_t>(1, r.timings.size()));
    return static_cast<double>(r.examples.steps_per_epoch) * per_step / std::max(tokens_per_s(r), 1e-9);
  };
  const double tps_rows = tokens_per_s(rows), tps_packed = tokens_per_s(packed);
  std::printf("%-18s %12s %10s %10s %12s %12s\n", "", "tokens/s", "padding", "steps/ep", "epoch s", "final loss");
  for (const auto* r : {&rows, &packed}) {
    std::printf("%-18s %12.0f %9.1f%% %10lld %12.1f %12.4f\n", r == &rows ? "one example a row" : "packed", tokens_per_s(*r),
                100 * r->examples.padding_share, static_cast<long long>(r->examples.steps_per_epoch), epoch_s(*r),
                r->losses.empty() ? 0.0 : r->losses.back());
  }
  std::printf("packed / one a row: tokens/s %.2fx, epoch time %.2fx\n", tps_packed / std::max(tps_rows, 1e-9),
              epoch_s(packed) / std::max(epoch_s(rows), 1e-9));
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("packing").key("recipe").value(recipe_path);
  for (const auto* r : {&rows, &packed}) {
    w.key(r == &rows ? "one_a_row" : "packed").begin_object();
    w.key("tokens_per_s").value(tokens_per_s(*r)).key("padding_share").value(r->examples.padding_share);
    w.key("steps_per_epoch").value(r->examples.steps_per_epoch).key("epoch_s").value(epoch_s(*r));
    w.key("steps").value(static_cast<int64_t>(r->timings.size())).key("train_examples").value(r->examples.train_examples);
    w.key("truncated").value(r->examples.truncated).key("dropped").value(r->examples.dropped);
    w.key("peak_bytes").value(r->peak.peak_bytes).key("estimate_peak_bytes").value(r->estimate.peak_bytes);
    w.key("final_loss").value(r->losses.empty() ? 0.0 : r->losses.back()).end_object();
  }
  w.key("tokens_per_s_ratio").value(tps_packed / std::max(tps_rows, 1e-9));
  w.key("epoch_time_ratio").value(epoch_s(packed) / std::max(epoch_s(rows), 1e-9)).end_object();
  json << "\n";
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
