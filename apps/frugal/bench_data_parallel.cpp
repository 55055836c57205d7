// frugal bench data-parallel — one recipe trained by one process and by N ranks on this machine,
// the cores split evenly (N ranks of cores/N threads against one process of all of them):
// tokens/s of each, the bytes the ranks really put on the wire per step (the loopback interface's
// counter, two runs of different lengths so start-up and the final gathering cancel out) against
// the theoretical minimum of sharded data parallelism, and each rank's peak by category.
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "args.h"
#include "commands.h"
#include "frugal/dist/group.h"
#include "frugal/dist/launch.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/units.h"
#include "frugal/memory/category.h"
#include "frugal/train/recipe.h"

namespace frugal {
namespace cli {
namespace {

// Bytes sent through the loopback interface since boot (every local TCP byte, headers included).
int64_t loopback_bytes() {
  std::ifstream in("/sys/class/net/lo/statistics/tx_bytes");
  long long v = -1;
  in >> v;
  return in ? v : -1;
}

struct DataParallelRun {
  io::JsonValue json;
  int64_t wire_bytes = 0;
};

}  // namespace

int bench_data_parallel(int argc, char** argv) {
  std::string recipe_path = "default", json_out = "-";
  int64_t steps = 6, nproc = 2;
  std::vector<std::string> overrides;
  Args args("bench data-parallel",
            "Trains a recipe (default: default) for --steps steps in one process and over --nproc ranks with the\n"
            "machine's cores split between them, and reports tokens/s of each, the bytes on the wire per step\n"
            "against the minimum, and every rank's peak memory by category.");
  args.add_string("recipe", &recipe_path, "the recipe: a file or a shipped recipe's name", "RECIPE");
  args.add_int("steps", &steps, "steps of the shorter run (the longer has twice as many)", 2, kMaxSteps / 2);
  args.add_int("nproc", &nproc, "ranks", 2, kMaxRanks);
  args.add_rest(&overrides, "section.key=value");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  dist::master_port_variable();  // the runs' launcher reads it: refused before any work
  recipe_path = resolve_recipe(recipe_path);
  train::Recipe recipe;
  try {
    recipe = train::load_recipe(recipe_path, overrides);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  try {
    recipe.rows_per_rank(nproc);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  check_recipe_inputs(recipe, /*data=*/true);
  warn_if_slow_blas();
  if (loopback_bytes() < 0) throw std::runtime_error("cannot read /sys/class/net/lo/statistics/tx_bytes, which measures the wire bytes");
  // The runs' folders, JSON and logs: removed on every way out, SIGINT, SIGTERM and SIGHUP included
  // (while the ranks run, the launcher's handler forwards those to them and the failure unwinds here).
  const io::TempDir tmp("frugal-bench-dp");
  const std::string& dir = tmp.path();
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  const std::string exe = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string(argv[0]);
  const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  // The data files where the recipe keeps them (made once); each run its own out_dir.
  auto run = [&](int64_t ranks, int64_t run_steps, const std::string& name) {
    std::vector<std::string> cmd = {exe, "train", recipe_path};
    cmd.insert(cmd.end(), overrides.begin(), overrides.end());
    for (const std::string& o :
         {"train.steps=" + std::to_string(run_steps), std::string("schedule.warmup_steps=1"), std::string("train.checkpoint_interval=0"),
          std::string("train.eval_interval=0"), std::string("train.sample_tokens=0"), std::string("train.log_interval=1000000"),
          "data.tokenizer=" + recipe.tokenizer, "data.tokens=" + recipe.tokens, "train.out_dir=" + dir + "/" + name}) {
      cmd.push_back(o);
    }
    cmd.insert(cmd.end(), {"--progress", "lines", "--json-out", dir + "/" + name + ".json"});
    dist::LaunchOptions o;
    o.nproc = ranks;
    o.argv = cmd;
    o.log_dir = dir + "/" + name + "-logs";
    o.threads_per_rank = std::max<int64_t>(1, cores / ranks);
    o.rank0_to_log = true;
    std::cerr << "frugal bench data-parallel: " << recipe.name << ", " << run_steps << " steps on " << ranks
              << (ranks == 1 ? " rank" : " ranks") << " of " << o.threads_per_rank << (o.threads_per_rank == 1 ? " thread" : " threads")
              << "\n";
    const int64_t before = loopback_bytes();
    const dist::LaunchResult r = dist::launch_local(o, [](const std::string&) {});
    DataParallelRun out;
    out.wire_bytes = loopback_bytes() - before;
    if (r.exit_code != 0) {
      throw std::runtime_error("the " + name + " run failed (" + r.failure + "); its logs are in " + o.log_dir);
    }
    out.json = io::parse_json(io::read_file(dir + "/" + name + ".json", io::kMetadataFileBytes));
    return out;
  };
  if (!io::path_exists(recipe.tokens) || !io::path_exists(recipe.tokenizer)) run(1, 2, "data");  // tokenizer and tokens, once
  const DataParallelRun one = run(1, 2 * steps, "one");
  const DataParallelRun short_run = run(nproc, steps, "ranks-short");
  const DataParallelRun ranks = run(nproc, 2 * steps, "ranks");
  const int64_t tokens_per_step = recipe.tokens_per_step();
  auto tokens_per_s = [&](const DataParallelRun& r) { return static_cast<double>(tokens_per_step) / r.json.at("step_time_s").as_double(); };
  const int64_t param_bytes = one.json.at("by_category").at("parameter").as_int();
  // Per rank and step: the wire bytes of the extra `steps` steps, shared by the ranks.
  const double wire =
      static_cast<double>(ranks.wire_bytes - short_run.wire_bytes) / static_cast<double>(steps) / static_cast<double>(nproc);
  // Sharded data parallelism needs at least a reduce-scatter of the gradients and an all-gather of
  // the parameters: each rank sends (N-1)/N of each (gradients as large as the parameters).
  const double minimum = 2.0 * static_cast<double>(nproc - 1) / static_cast<double>(nproc) * static_cast<double>(param_bytes);
  const double t1 = tokens_per_s(one), tn = tokens_per_s(ranks);

  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("data-parallel").key("recipe").value(recipe.name).key("nproc").value(nproc);
  w.key("cores").value(cores).key("threads_per_rank").value(std::max<int64_t>(1, cores / nproc)).key("steps").value(2 * steps);
  w.key("tokens_per_step").value(tokens_per_step);
  w.key("tokens_per_s_1rank").value(t1).key("tokens_per_s_nranks").value(tn).key("speedup").value(tn / t1);
  w.key("step_time_s_1rank")
      .value(one.json.at("step_time_s").as_double())
      .key("step_time_s_nranks")
      .value(ranks.json.at("step_time_s").as_double());
  w.key("parameter_bytes").value(param_bytes);
  w.key("wire_bytes_per_step_per_rank").value(wire).key("minimum_bytes_per_step_per_rank").value(minimum);
  w.key("wire_over_minimum").value(wire / minimum);
  const io::JsonValue& payload = ranks.json.at("collective_bytes_per_step");
  w.key("payload_bytes_per_step_rank0").begin_object();
  for (const char* k : {"reduce", "broadcast", "allreduce"}) w.key(k).value(payload.at(k).as_int());
  w.end_object();
  w.key("by_category_1rank").begin_object();
  for (memory::Category c : memory::kAllCategories)
    w.key(memory::category_name(c)).value(one.json.at("by_category").at(memory::category_name(c)).as_int());
  w.end_object().key("peak_bytes_1rank").value(one.json.at("peak_bytes").as_int());
  w.key("by_category_by_rank").begin_array();
  const auto& by_rank = ranks.json.at("by_category_by_rank").items();
  for (const auto& r : by_rank) {
    w.begin_object();
    for (memory::Category c : memory::kAllCategories) w.key(memory::category_name(c)).value(r.at(memory::category_name(c)).as_int());
    w.end_object();
  }
  w.end_array().key("peak_bytes_by_rank").begin_array();
  for (const auto& b : ranks.json.at("peak_bytes_by_rank").items()) w.value(b.as_int());
  const int64_t state1 = one.json.at("by_category").at("optimizer_state").as_int();
  w.end_array().key("optimizer_state_by_rank_over_1rank").begin_array();
  for (const auto& r : by_rank)
    w.value(static_cast<double>(r.at("optimizer_state").as_int()) / static_cast<double>(std::max<int64_t>(1, state1)));
  w.end_array().end_object();
  std::fprintf(stderr,
               "tokens/s %.0f on 1 rank, %.0f on %lld ranks (%.2fx); wire %s per rank and step against a minimum of %s (%.2fx); "
               "optimizer state per rank %s of 1 rank's %s\n",
               t1, tn, static_cast<long long>(nproc), tn / t1, io::human_bytes(static_cast<int64_t>(wire)).c_str(),
               io::human_bytes(static_cast<int64_t>(minimum)).c_str(), wire / minimum,
               io::human_bytes(by_rank.front().at("optimizer_state").as_int()).c_str(), io::human_bytes(state1).c_str());
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
