// frugal train — train or fine-tune a language model from a YAML recipe, with every memory
// technique the recipe asks for; --dry-run estimates the peak memory without allocating the model.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <optional>
#include <sstream>

#include "args.h"
#include "commands.h"
#include <torch/cuda.h>

#include "frugal/bench/hardware.h"
#include "frugal/data/tokenizer.h"
#include "frugal/dist/group.h"
#include "frugal/dist/launch.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/numbers.h"
#include "frugal/memory/cuda_stats.h"
#include "frugal/io/units.h"
#include "frugal/memory/process.h"
#include "frugal/memory/trace.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/train/trainer.h"
#include "train_progress.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

namespace frugal {
namespace cli {
namespace {

bool is_file(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

void write_estimate(io::JsonWriter& w, const train::MemoryEstimate& e) {
  w.begin_object().key("peak_bytes").value(e.peak_bytes).key("peak_at").value(e.peak_at).key("by_category").begin_object();
  for (memory::Category c : memory::kAllCategories) w.key(memory::category_name(c)).value(e.by_category[static_cast<int>(c)]);
  w.end_object().key("state_in_files_bytes").value(e.state_in_files_bytes).key("state_window_bytes").value(e.state_window_bytes);
  w.key("state_off_device_bytes").value(e.state_off_device_bytes);
  w.key("state_fp32_fallback").begin_object().key("tensors").value(e.state_fp32_fallback_tensors);
  w.key("params").value(e.state_fp32_fallback_params).end_object().end_object();
}

// Where the optimizer state lives, when that is not plainly the device's memory.
void print_state_placement(std::ostream& out, const train::Recipe& r, const train::MemoryEstimate& e) {
  const auto placement = r.optimizer.state().placement();
  if (e.state_off_device_bytes > 0) {
    out << "optimizer state: " << io::human_bytes(e.state_off_device_bytes) << " in host memory"
        << (placement == optim::StatePlacement::mmap ? " (mapped files)" : "") << ", not in the GPU's peak above\n";
  } else if (placement == optim::StatePlacement::file && e.state_in_files_bytes > 0) {
    out << "optimizer state: " << io::human_bytes(e.state_in_files_bytes) << " in files under " << r.optimizer.state().mmap_dir()
        << ", streamed through a window of " << io::human_bytes(e.state_window_bytes)
        << " (counted above as optimizer_state: " << optim::kStateWindowSlots << " buffers of the largest chunk, which chunks are read "
        << "into ahead of their update and written back from); the rest (block scales, small tensors' state) stays in memory\n";
  } else if (e.state_in_files_bytes > 0) {
    out << "optimizer state: " << io::human_bytes(e.state_in_files_bytes) << " of its "
        << io::human_bytes(e.by_category[static_cast<int>(memory::Category::optimizer_state)]) << " in files under "
        << r.optimizer.state().mmap_dir() << ", counted as memory: the kernel keeps the pages each step touches resident "
        << "and may write them back to the files under pressure; the rest (block scales, small tensors) stays in memory\n";
  } else if (placement == optim::StatePlacement::host) {
    out << "optimizer state: in host memory, which on the CPU is the device's: counted above\n";
  }
  if (e.state_fp32_fallback_tensors > 0) {
    out << "optimizer state: " << e.state_fp32_fallback_tensors << " tensors (" << e.state_fp32_fallback_params
        << " parameters) keep fp32 state instead of " << optim::precision_name(r.optimizer.state().precision()) << ": under "
        << r.optimizer.state().min_quantized_numel() << " elements each, their block scales would cost more than the codes save\n";
  }
}

void print_estimate_table(std::ostream& out, const char* title, const train::MemoryEstimate& e, const memory::PeakReport* measured) {
  out << title << "\n";
  auto row = [&](const char* name, int64_t estimated, int64_t real) {
    char line[160];
    if (measured) {
      std::snprintf(line, sizeof(line), "  %-16s %14s %14s\n", name, io::human_bytes(estimated).c_str(), io::human_bytes(real).c_str());
    } else {
      std::snprintf(line, sizeof(line), "  %-16s %14s\n", name, io::human_bytes(estimated).c_str());
    }
    out << line;
  };
  char head[160];
  std::snprintf(head, sizeof(head), measured ? "  %-16s %14s %14s\n" : "  %-16s %14s\n", "category", "estimated", "measured");
  out << head;
  for (memory::Category c : memory::kAllCategories) {
    const int i = static_cast<int>(c);
    row(memory::category_name(c), e.by_category[i], measured ? measured->breakdown[i] : 0);
  }
  row("peak", e.peak_bytes, measured ? measured->peak_bytes : 0);
  out << "  (estimated at: " << e.peak_at << ")\n";
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), s < 10 ? "%.2f s" : "%.1f s", s);
  return buf;
}

}  // namespace

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

namespace {

// The median step and its parts, one value per part (medians of each).
train::StepTiming median_timing(const std::vector<train::StepTiming>& t) {
  auto part = [&](double train::StepTiming::*field) {
    std::vector<double> v;
    for (const auto& s : t) v.push_back(s.*field);
    return median(v);
  };
  train::StepTiming m;
  m.forward_s = part(&train::StepTiming::forward_s);
  m.backward_s = part(&train::StepTiming::backward_s);
  m.optimizer_s = part(&train::StepTiming::optimizer_s);
  m.state_io_s = part(&train::StepTiming::state_io_s);
  m.update_wait_s = part(&train::StepTiming::update_wait_s);
  m.updates_overlapped = !t.empty() && t.front().updates_overlapped;
  m.total_s = part(&train::StepTiming::total_s);
  return m;
}

bool is_dir(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

// Data parallel: each rank's measured peak, its optimizer state and gradients, and what it handed
// to collectives per step (rank 0's figures; the payload, not the wire bytes).
// Rank 0's collectives per step of this run: what the terminal and the JSON both print.
dist::Traffic traffic_per_step(const train::TrainResult& r) {
  const int64_t steps = std::max<int64_t>(1, r.last_step - r.first_step);
  dist::Traffic t;
  t.reduce_bytes = r.traffic.reduce_bytes / steps;
  t.broadcast_bytes = r.traffic.broadcast_bytes / steps;
  t.allreduce_bytes = r.traffic.allreduce_bytes / steps;
  t.calls = r.traffic.calls / steps;
  return t;
}

std::string describe_ranks(const train::TrainResult& r) {
  std::ostringstream out;
  const int opt = static_cast<int>(memory::Category::optimizer_state), grad = static_cast<int>(memory::Category::gradient);
  out << "data parallel over " << r.world_size << " ranks, per rank (peak / optimizer state / gradients):";
  for (size_t i = 0; i < r.peak_by_rank.size(); ++i) {
    out << (i ? ";" : "") << " rank " << i << " " << io::human_bytes(r.peak_bytes_by_rank[i]) << " / "
        << io::human_bytes(r.peak_by_rank[i][opt]) << " / " << io::human_bytes(r.peak_by_rank[i][grad]);
  }
  const dist::Traffic t = traffic_per_step(r);
  out << "\ncollectives of rank 0 per step: gradients reduced to their owners " << io::human_bytes(t.reduce_bytes)
      << ", parameters broadcast " << io::human_bytes(t.broadcast_bytes) << " (payload, sent or received)\n";
  return out.str();
}

void write_ranks(io::JsonWriter& w, const train::TrainResult& r) {
  w.key("world_size").value(r.world_size).key("peak_bytes_by_rank").begin_array();
  for (int64_t b : r.peak_bytes_by_rank) w.value(b);
  w.end_array().key("by_category_by_rank").begin_array();
  for (const auto& b : r.peak_by_rank) {
    w.begin_object();
    for (memory::Category c : memory::kAllCategories) w.key(memory::category_name(c)).value(b[static_cast<int>(c)]);
    w.end_object();
  }
  const dist::Traffic t = traffic_per_step(r);
  w.end_array().key("collective_bytes_per_step").begin_object();
  w.key("reduce").value(t.reduce_bytes).key("broadcast").value(t.broadcast_bytes).key("allreduce").value(t.allreduce_bytes).end_object();
}

// --nproc N: this command again as N ranks (without --nproc), supervised; the launcher's exit code
// is the first failed rank's.
int launch_ranks(int argc, char** argv, int64_t nproc, const std::string& out_dir) {
  dist::LaunchOptions o;
  o.nproc = nproc;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  o.argv.push_back(n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string(argv[0]));
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    o.argv.push_back(a);
  }
  o.log_dir = out_dir + "/logs";
  const dist::LaunchResult r = dist::launch_local(o, [](const std::string& m) { std::cerr << "frugal train: " << m << "\n"; });
  if (r.failed_rank >= 0) std::cerr << "frugal train: stopped: " << r.failure << "\n";
  return r.exit_code;
}

}  // namespace

// The recipes shipped in recipes/, for messages (one list, so the two places that name them agree).
const char* const kShippedRecipes = "tiny, default, finetune, alpaca-tiny, llama2-7b, llama2-7b-cpu, llama2-7b-cpu-8bit";

std::string resolve_recipe(const std::string& arg) {
  struct stat st {};
  if (::stat(arg.c_str(), &st) == 0 && !S_ISDIR(st.st_mode)) return arg;  // not a regular file: load_recipe says what it is
  if (arg.find('/') == std::string::npos) {
    for (const std::string& dir : {std::string("recipes"), std::string(FRUGAL_SOURCE_DIR) + "/recipes"}) {
      const std::string p = dir + "/" + arg + ".yaml";
      if (is_file(p)) return p;
    }
  }
  throw UsageError("recipe '" + arg + "' is neither a file nor a shipped recipe (" + kShippedRecipes + ")");
}

void check_recipe_inputs(const train::Recipe& r, bool data) {
  if (r.device.is_cuda()) {
    const int64_t n = torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
    if (n == 0) throw UsageError("train.device " + r.device.str() + " is not available: this machine or LibTorch build has no CUDA device");
    if (r.device.has_index() && r.device.index() >= n) {
      throw UsageError("train.device " + r.device.str() + " is not available: this machine has " + std::to_string(n) + " CUDA device(s)");
    }
  }
  if (!r.init_from.empty() && !is_dir(r.init_from)) {
    throw UsageError("model.init_from " + r.init_from + " is not a folder (a Hugging Face checkpoint folder is needed)");
  }
  if (exists(r.out_dir) && !is_dir(r.out_dir)) throw UsageError("train.out_dir " + r.out_dir + " exists and is not a folder");
  if (!data) return;
  for (const auto& [key, path] : {std::pair<const char*, std::string>{"data.tokenizer", r.tokenizer}, {"data.tokens", r.tokens}}) {
    if (!exists(path) || is_file(path)) continue;
    try {
      io::open_regular_file(path, key);  // says what it is: a folder, a FIFO, a device...
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
  if (!is_file(r.tokenizer) || !is_file(r.tokens)) {
    const std::string needed = !is_file(r.tokenizer) ? r.tokenizer : r.tokens;
    if (r.corpus.empty()) throw UsageError("data.corpus must be set to make " + needed);
    if (!exists(r.corpus)) throw UsageError("data.corpus " + r.corpus + " does not exist (it is needed to make " + needed + ")");
  }
}

namespace {

// frugal train's flags.
struct TrainFlags {
  std::string recipe_arg, json_out;
  std::vector<std::string> overrides;
  bool resume = false, dry_run = false, list_keys = false;
  std::string progress = "auto";
  int64_t memory_limit = -1;
  int64_t stop_after = -1;
  std::string trace_out, trace_steps;
  std::vector<int64_t> capture;  // --trace-steps, parsed
  int64_t nproc = 1;
  double dist_timeout = 300;
};

// --trace-steps "0,1,100": step numbers, refused before any work.
std::vector<int64_t> parse_trace_steps(const std::string& text) {
  std::vector<int64_t> steps;
  if (text.empty()) return steps;
  std::stringstream list(text + ",");  // "1," is an empty item, as ",1" is
  std::string item;
  while (std::getline(list, item, ',')) {
    const std::optional<int64_t> step = io::to_int(item);
    if (!step || *step < 0 || *step > kMaxSteps) {
      throw UsageError("--trace-steps takes step numbers (" + io::int_range(0, kMaxSteps) + " each) separated by commas, not " +
                       io::quote_text(text));
    }
    steps.push_back(*step);
  }
  return steps;
}

// The flags parsed and checked; nullopt when the command is done (--help, --list-keys).
std::optional<TrainFlags> parse_train_flags(int argc, char** argv) {
  TrainFlags f;
  Args args("train", std::string("Train or fine-tune a decoder language model from a YAML recipe (a path, or a shipped recipe:\n") +
                         kShippedRecipes + "). Any recipe key can be overridden as section.key=value.");
  args.add_positional("RECIPE", &f.recipe_arg, "recipe file or shipped recipe name");
  args.add_rest(&f.overrides, "section.key=value");
  args.add_flag("resume", &f.resume, "continue from the last checkpoint in train.out_dir (exactly as if never stopped)");
  args.add_flag("dry-run", &f.dry_run, "estimate the peak memory per category without allocating the model, then stop");
  args.add_output("json-out", &f.json_out, "also write the summary (or the dry-run estimate) as JSON", "FILE");
  args.add_string("progress", &f.progress, "auto (a bar on a terminal), bar or lines", "MODE");
  args.add_flag("list-keys", &f.list_keys, "print every recipe key with its type, default and meaning, and stop");
  args.add_output("trace-out", &f.trace_out,
                  "write the allocation timeline (JSON, for frugal report); bound it on long runs with --trace-steps", "FILE");
  args.add_bytes("memory-limit", &f.memory_limit,
                 "stop cleanly once live memory exceeds this, saying what holds it and which techniques would fit", 1);
  args.add_int("stop-after", &f.stop_after,
               "stop at this step of train.steps (counted from step 0, also when resumed), with a checkpoint "
               "(the schedule stays train.steps long); --resume continues",
               1, kMaxSteps);
  args.add_string("trace-steps", &f.trace_steps,
                  "with --trace-out: full events only for these steps (e.g. 0,1,100); every step still gets a summary", "LIST");
  args.add_int("nproc", &f.nproc,
               "data parallel: start this many local ranks (processes), each training on train.batch_size / N rows of every "
               "batch with 1/N of the optimizer state; under torchrun (WORLD_SIZE set) leave it out",
               1, kMaxRanks);
  args.add_double("dist-timeout", &f.dist_timeout,
                  "data parallel: seconds joining the ranks or one collective may take before the run stops with an error", 1,
                  kMaxTimeoutSeconds, "SECONDS");
  // RECIPE is optional with --list-keys
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) == "--list-keys") {
      for (const auto& k : train::recipe_key_docs()) {
        std::cout << k.key << "  (" << k.type << "; default " << (k.default_value.empty() ? "\"\"" : k.default_value) << ")\n    "
                  << k.meaning << "\n";
      }
      return std::nullopt;
    }
  }
  if (!args.parse(argc, argv, 2)) return std::nullopt;
  f.capture = parse_trace_steps(f.trace_steps);
  if (f.progress != "auto" && f.progress != "bar" && f.progress != "lines") {
    throw UsageError("--progress must be auto, bar or lines, got '" + f.progress + "'");
  }
  return f;
}

// --dry-run: the estimate with the recipe's techniques and with every technique off, printed and
// (with --json-out) written, without allocating the model.
int dry_run(const train::Recipe& recipe, const TrainFlags& flags, const train::DataParallel& dp) {
  int64_t vocab = recipe.model.vocab_size;
  if (vocab == 0) {
    if (!is_file(recipe.tokenizer)) {
      throw UsageError("model.vocab_size is 0 (take it from the tokenizer) but " + recipe.tokenizer +
                       " does not exist yet: set model.vocab_size or train the tokenizer first");
    }
    vocab = data::Tokenizer::load(recipe.tokenizer).vocab_size();
  }
  train::MemoryEstimate est, plain;
  try {
    est = train::estimate_training_memory(recipe, vocab, dp);
    plain = train::estimate_training_memory(train::without_techniques(recipe), vocab, dp);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  const at::ScalarType compute = train::resolve_compute_dtype(recipe);
  std::cout << "frugal train --dry-run: " << recipe.name << ", " << est.n_params << " parameters (" << train::dtype_name(recipe.dtype)
            << (compute != recipe.dtype ? std::string(", ") + train::dtype_name(compute) + " products" : "") << "), batch "
            << recipe.batch_size << " x " << recipe.seq_len << " tokens";
  if (dp.world_size > 1) {
    std::cout << " over " << dp.world_size << " ranks (per rank: rank " << dp.rank << ", " << recipe.rows_per_rank(dp.world_size)
              << " rows)";
  }
  std::cout << "\n";
  // The architecture and where each value came from (init_from's config.json, the recipe, a default).
  std::cout << "model:";
  for (const auto& [key, source] : recipe.model_sources) {
    std::string value = train::recipe_value(recipe, key);
    if (key == "model.vocab_size" && value == "0") value = std::to_string(vocab) + " (the tokenizer's)";
    std::cout << " " << key.substr(6) << "=" << value << " (" << source << ")";
  }
  const models::DecoderConfig& m = recipe.model;
  std::cout << "\n  head_dim=" << m.head_dim() << " activation=" << m.resolved_activation() << " rope=" << m.rope_scaling.type
            << (m.rope_scaling.type != "default" ? " x" + train::recipe_number(m.rope_scaling.factor) : std::string())
            << " attention_bias=" << (m.attention_bias ? "true" : "false") << " mlp_bias=" << (m.mlp_bias ? "true" : "false")
            << (recipe.init_from.empty() ? "" : " (from " + recipe.init_from + "/config.json)") << "\n";
  print_estimate_table(std::cout, "estimated peak with the recipe's techniques:", est, nullptr);
  print_state_placement(std::cout, recipe, est);
  print_estimate_table(std::cout, "estimated peak with every technique off:", plain, nullptr);
  if (!flags.json_out.empty()) {
    std::ostringstream json;
    io::JsonWriter w(json);
    w.begin_object().key("recipe").value(recipe.name).key("n_params").value(est.n_params);
    w.key("compute_dtype").value(train::dtype_name(compute));
    // The estimate's keys at the top level (as before), and the same object again as "estimate".
    w.key("peak_bytes").value(est.peak_bytes).key("by_category").begin_object();
    for (memory::Category c : memory::kAllCategories) w.key(memory::category_name(c)).value(est.by_category[static_cast<int>(c)]);
    w.end_object().key("estimate");
    write_estimate(w, est);
    w.key("techniques_off");
    write_estimate(w, plain);
    w.end_object();
    write_output(flags.json_out, json.str());
  }
  return 0;
}

// What a finished run measured beyond its TrainResult, taken once: the summary and the JSON print
// these same numbers.
struct RunFigures {
  memory::ProcessMemory process;  // at the end (its VmHWM: the process's peak)
  memory::CudaMemoryStats gpu;    // the caching allocator's peaks on a GPU
  train::StepTiming step;         // the median step and its parts
  int64_t major_faults = 0;       // of every step run here: mapped state read back from disk, among others
  double step_gflops = 0;         // matrix products per second of the median step
  double matmul_gflops = 0;       // this machine's matmul in the products' precision (0: not measured)
};

RunFigures measure_run(const train::Recipe& recipe, const train::TrainResult& result) {
  RunFigures f;
  f.process = memory::process_memory();
  // On a GPU, the caching allocator's own peaks since the process started (model build and every
  // step): the figures torch.cuda.max_memory_allocated() / max_memory_reserved() give.
  if (recipe.device.is_cuda()) f.gpu = memory::cuda_memory_stats(recipe.device.has_index() ? recipe.device.index() : 0);
  f.step = median_timing(result.timings);
  for (const train::StepTiming& t : result.timings) f.major_faults += t.major_faults;
  if (!result.timings.empty()) {
    f.step_gflops = train::step_matmul_flops(recipe, result) / std::max(f.step.total_s, 1e-9) / 1e9;
    // Against the products' own precision (bf16 under autocast); worth half a second of measuring.
    if (f.step.total_s >= 1.0 && recipe.device.is_cpu())
      f.matmul_gflops = bench::measure_compute_matmul_gflops(result.compute_dtype, 1024, 0.5);
  }
  return f;
}

// The run's summary as the terminal shows it.
std::string run_summary(const train::Recipe& recipe, const train::TrainResult& result, const RunFigures& f) {
  std::ostringstream summary;
  char line[256];
  std::snprintf(line, sizeof(line), "trained %s (%lld parameters) to step %lld: last loss %.4f, validation loss %.4f, %.0f tokens/s\n",
                recipe.name.c_str(), static_cast<long long>(result.n_params), static_cast<long long>(result.last_step),
                result.losses.empty() ? 0.0 : result.losses.back(), result.val_loss, result.tokens_per_s);
  summary << line;
  if (recipe.example_format) {
    const train::ExampleReport& e = result.examples;
    std::snprintf(line, sizeof(line),
                  "examples: %lld training, %lld validation; %lld steps an epoch; %.1f%% of the rows' tokens padding (%s); "
                  "%lld of %lld tokens with loss\n",
                  static_cast<long long>(e.train_examples), static_cast<long long>(e.val_examples),
                  static_cast<long long>(e.steps_per_epoch), 100 * e.padding_share, recipe.packing ? "packed" : "one example a row",
                  static_cast<long long>(e.label_tokens), static_cast<long long>(e.real_tokens));
    summary << line;
    if (e.skipped + e.truncated + e.dropped > 0) {
      summary << "  " << e.skipped << " bad examples skipped, " << e.truncated << " truncated and " << e.dropped
              << " dropped for train.seq_len " << recipe.seq_len << "\n";
    }
  }
  const std::string heading = "peak memory per category (measured peak over " + memory::describe_coverage(result.peak) +
                              ", reached in step " + std::to_string(result.peak.peak_step) + ", " + memory::phase_name(result.peak.phase) +
                              "):";
  print_estimate_table(summary, heading.c_str(), result.estimate, &result.peak);
  print_state_placement(summary, recipe, result.estimate);
  summary << "estimated peak of the same job with every technique off: " << io::human_bytes(result.estimate_plain.peak_bytes)
          << " (measured peak is " << io::human_bytes(result.peak.peak_bytes) << ")\n";
  // What the tracker does not see: the kernel's count of the process against the tracked bytes.
  const memory::ProcessMemory& end = result.process_after_steps;
  summary << "process peak resident memory " << io::human_bytes(f.process.peak_rss) << " (VmHWM) against the tracker's peak "
          << io::human_bytes(result.peak.peak_bytes) << "; after the last step " << io::human_bytes(end.rss)
          << " resident = " << io::human_bytes(end.anon) << " anonymous (the tracker's " << io::human_bytes(result.tracked_after_steps)
          << " of tensors, the rest the C++ heap and its free space, oneDNN and OpenMP scratch) + " << io::human_bytes(end.file)
          << " of mapped files (code, LibTorch's libraries, the token file, mapped optimizer state)\n";
  if (f.gpu.available) {
    summary << "CUDA caching allocator: peak allocated " << io::human_bytes(f.gpu.peak_allocated_bytes) << ", peak reserved "
            << io::human_bytes(f.gpu.peak_reserved_bytes) << " (since the process started)\n";
  }
  if (!result.timings.empty()) {
    summary << "step time (median of " << result.timings.size() << "): " << format_seconds(f.step.total_s) << " = forward "
            << format_seconds(f.step.forward_s) << " + backward with recompute " << format_seconds(f.step.backward_s);
    if (f.step.updates_overlapped) {
      summary << " (with the updates beside it on their own thread: optimizer " << format_seconds(f.step.optimizer_s)
              << ", of which moving state " << format_seconds(f.step.state_io_s) << "; backward waited "
              << format_seconds(f.step.update_wait_s) << " for them) + the rest; ";
    } else {
      summary << " + optimizer " << format_seconds(f.step.optimizer_s) << " (of which moving state " << format_seconds(f.step.state_io_s)
              << ") + the rest; ";
    }
    summary << f.major_faults << " pages read from disk in " << result.timings.size() << " steps";
    if (f.matmul_gflops > 0) {
      std::snprintf(line, sizeof(line), "; %.1f GFLOP/s of matrix products, %.0f%% of this machine's %s matmul (%.1f GFLOP/s)",
                    f.step_gflops, 100 * f.step_gflops / std::max(f.matmul_gflops, 1e-9), train::dtype_name(result.compute_dtype),
                    f.matmul_gflops);
      summary << line;
    }
    summary << "\n";
  }
  if (result.world_size > 1) summary << describe_ranks(result);
  summary << "checkpoint: " << result.checkpoint << "\n";
  if (!result.sample.empty()) summary << "sample: " << result.sample << "\n";
  return summary.str();
}

// The run's summary as --json-out writes it.
std::string run_json(const train::Recipe& recipe, const train::TrainResult& result, const RunFigures& f) {
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("recipe").value(recipe.name).key("n_params").value(result.n_params);
  w.key("first_step").value(result.first_step).key("last_step").value(result.last_step);
  w.key("final_loss").value(result.losses.empty() ? 0.0 : result.losses.back()).key("val_loss").value(result.val_loss);
  w.key("tokens_per_s").value(result.tokens_per_s);
  w.key("total_steps").value(result.total_steps);
  if (recipe.example_format) {
    const train::ExampleReport& e = result.examples;
    w.key("examples").begin_object().key("train").value(e.train_examples).key("validation").value(e.val_examples);
    w.key("skipped").value(e.skipped).key("truncated").value(e.truncated).key("dropped").value(e.dropped);
    w.key("steps_per_epoch").value(e.steps_per_epoch).key("padding_share").value(e.padding_share);
    w.key("packing").value(recipe.packing).key("label_tokens").value(e.label_tokens).key("real_tokens").value(e.real_tokens);
    w.key("processed_tokens").value(e.processed_tokens).end_object();
  }
  w.key("peak_bytes").value(result.peak.peak_bytes);
  w.key("peak_covers").begin_object().key("first_step").value(result.peak.covers_first_step);
  w.key("last_step").value(result.peak.covers_last_step).end_object();
  w.key("peak_step").value(result.peak.peak_step).key("peak_phase").value(memory::phase_name(result.peak.phase));
  w.key("peak_rss_bytes").value(f.process.peak_rss);
  if (f.gpu.available) {
    w.key("cuda_peak_allocated_bytes").value(f.gpu.peak_allocated_bytes).key("cuda_peak_reserved_bytes").value(f.gpu.peak_reserved_bytes);
  }
  w.key("step_time_s").value(f.step.total_s).key("step_time_breakdown_s").begin_object();
  w.key("forward").value(f.step.forward_s).key("backward_with_recompute").value(f.step.backward_s);
  w.key("optimizer").value(f.step.optimizer_s).key("state_io").value(f.step.state_io_s);
  w.key("updates_overlapped").value(f.step.updates_overlapped).key("update_wait").value(f.step.update_wait_s).end_object();
  w.key("major_page_faults").value(f.major_faults);
  w.key("compute_dtype").value(train::dtype_name(result.compute_dtype));
  w.key("achieved_gflops").value(f.step_gflops).key("matmul_gflops").value(f.matmul_gflops);
  w.key("by_category").begin_object();
  for (memory::Category c : memory::kAllCategories) w.key(memory::category_name(c)).value(result.peak.breakdown[static_cast<int>(c)]);
  w.end_object();
  if (result.world_size > 1) write_ranks(w, result);
  w.key("estimate");
  write_estimate(w, result.estimate);
  w.key("estimate_techniques_off");
  write_estimate(w, result.estimate_plain);
  w.key("losses").begin_array();
  for (double l : result.losses) w.value(l);
  w.end_array().key("checkpoint").value(result.checkpoint).key("sample").value(result.sample).end_object();
  return json.str();
}

// A run resumed with nothing left to do: what it found, and why it stops.
void say_nothing_to_do(const train::TrainResult& result, int64_t stop_after) {
  if (result.last_step >= result.total_steps) {
    std::cout << "run already complete: " << result.checkpoint << " is at step " << result.last_step << " (train.steps "
              << result.total_steps << "); nothing to do\n";
  } else {
    // --stop-after counts from step 0: a run resumed at or past it has nothing to do, yet is not complete.
    std::cout << "nothing to do: " << result.checkpoint << " is at step " << result.last_step << ", at or past --stop-after " << stop_after
              << " (train.steps " << result.total_steps << "); --resume without --stop-after, or with one above " << result.last_step
              << ", continues it\n";
  }
}

}  // namespace

int run_train(int argc, char** argv) {
  // 1. Flags, the recipe, the ranks: every mistake refused before any work.
  const std::optional<TrainFlags> parsed = parse_train_flags(argc, argv);
  if (!parsed) return 0;
  const TrainFlags& flags = *parsed;
  train::Recipe recipe;
  try {
    recipe = train::load_recipe(resolve_recipe(flags.recipe_arg), flags.overrides);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  if (!flags.dry_run) check_recipe_inputs(recipe, /*data=*/true);  // a dry run estimates any device's memory, on any machine
  std::optional<dist::Environment> env;
  try {
    env = dist::environment_from_variables();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (flags.nproc > 1 && env) throw UsageError("--nproc starts its own ranks; leave it out when a launcher (torchrun) has set WORLD_SIZE");
  const int64_t world = env ? env->world_size : flags.nproc;
  try {
    recipe.check_data_parallel(world);
  } catch (const train::RecipeError& e) {
    throw UsageError(e.what());
  }
  // 2. A dry run stops at the estimate.
  if (flags.dry_run) return dry_run(recipe, flags, train::DataParallel{world, env ? env->rank : 0});

  // 3. The ranks (--nproc starts them; a rank joins its group), then the run.
  if (flags.nproc > 1) return launch_ranks(argc, argv, flags.nproc, recipe.out_dir);
  dist::use_launcher_threads();  // a rank started by --nproc: its share of the cores
  std::shared_ptr<dist::Group> group;
  if (env && env->world_size > 1) {
    // On GPUs each rank takes the device of its local rank (cuda:LOCAL_RANK) unless the recipe names one.
    if (recipe.device.is_cuda() && !recipe.device.has_index())
      recipe.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(env->local_rank));
    group = dist::Group::create(*env, std::chrono::milliseconds(static_cast<int64_t>(flags.dist_timeout * 1000)), recipe.device);
  }
  const bool rank0 = !group || group->rank() == 0;
  warn_if_slow_blas();
  const bool bar = rank0 && (flags.progress == "bar" || (flags.progress == "auto" && ::isatty(STDERR_FILENO)));
  TrainProgress shown(rank0 ? "frugal train: " : "frugal train: rank " + std::to_string(group->rank()) + ": ", bar);
  train::TrainResult result;
  try {
    result = train::run_training(recipe,
                                 train::TrainOptions()
                                     .resume(flags.resume)
                                     .stop_after(flags.stop_after)
                                     .on_progress(shown.on_progress())
                                     .memory_limit(std::max<int64_t>(0, flags.memory_limit))
                                     .keep_events(!flags.trace_out.empty())
                                     .capture_steps(flags.capture)
                                     .group(group),
                                 shown.log());
  } catch (const train::RecipeError& e) {
    shown.end_line();
    throw UsageError(e.what());
  } catch (const train::MemoryLimitExceeded& e) {
    shown.message(std::string("stopped: ") + e.what());
    return 1;
  } catch (...) {
    shown.end_line();  // the error main() prints starts on a line of its own
    throw;
  }
  if (result.already_complete) {
    say_nothing_to_do(result, flags.stop_after);
    return 0;
  }
  if (!rank0) {
    std::cout << "rank " << group->rank() << " of " << group->size() << " done at step " << result.last_step << "; peak "
              << io::human_bytes(result.peak.peak_bytes) << ", optimizer state "
              << io::human_bytes(result.peak.breakdown[static_cast<int>(memory::Category::optimizer_state)]) << "\n";
    return 0;  // rank 0 reports the run and writes its outputs
  }
  // 4. What rank 0 reports: the summary, the trace, the JSON (the same figures in both).
  const RunFigures figures = measure_run(recipe, result);
  std::cout << run_summary(recipe, result, figures);
  if (!flags.trace_out.empty()) {
    std::ostringstream trace;
    result.tracker->write_timeline_json(trace);
    write_output(flags.trace_out, trace.str());
    std::cout << "wrote " << flags.trace_out << " (" << result.tracker->events().size() << " events)\n";
  }
  if (!flags.json_out.empty()) write_output(flags.json_out, run_json(recipe, result, figures));
  return 0;
}

}  // namespace cli
}  // namespace frugal
