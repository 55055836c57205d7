// frugal bench optim-state — AdamW state in fp32, bf16, 8-bit and 4-bit, and SGD with momentum:
// bytes per parameter, step time against fp32 AdamW's on ~50M parameters, the bytes each step moves
// and the bandwidth that achieves beside a plain copy's, and with --steps N the default recipe's
// final loss.
#include <unistd.h>

#include <ATen/Parallel.h>
#include <torch/version.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <optional>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/quantize.h"
#include "frugal/optim/update.h"
#include "frugal/train/trainer.h"
#include "train_progress.h"

namespace frugal {
namespace cli {

namespace {

// The comparison with LibTorch's fused AdamW holds two sets of fp32 weights and both moments and
// one of gradients (28 bytes a parameter) at once: more than the machine's memory would swap for
// hours before the allocator gave up.
void check_params_fit_memory(int64_t params) {
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  if (physical > 0 && params > physical / 28) {
    throw UsageError(
        "--params " + std::to_string(params) + " needs about " +
        (params > INT64_MAX / 28 ? std::string("more than 8 EiB") : io::human_bytes(28 * params)) +
        " (28 bytes a parameter for two sets of fp32 weights and AdamW state and one of gradients), more than this machine's " +
        io::human_bytes(physical) + " of memory");
  }
}

// The memory bandwidth a plain copy reaches with the same threads: `bytes` of fp32 copied by
// at::Tensor::copy_, counted as read + written (the median of 5 after one untimed). The processor
// also reads each destination line before writing it, which the count leaves out; a step reads
// everything it writes anyway, so it can pass 100% of this figure.
double copy_bandwidth_gbs(int64_t bytes) {
  const at::Tensor src = at::ones({bytes / 4}), dst = at::empty_like(src);
  std::vector<double> times;
  for (int r = 0; r <= 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    dst.copy_(src);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) times.push_back(s);
  }
  std::sort(times.begin(), times.end());
  return 2.0 * static_cast<double>(bytes) / times[times.size() / 2] / 1e9;
}

struct Row {
  int64_t params = 0;  // in the timed step
  double bytes_per_param = 0, step_s = 0, final_loss = 0;
  int64_t state_bytes = 0;
  double ns_per_param = 0;
  // What one step reads and writes per parameter: the fp32 parameter (read, written), its fp32
  // gradient (read), and both moments' state (codes and scales, or the dense values: read, written).
  double moved_per_param = 0, achieved_gbs = 0;
  std::vector<double> losses;  // one per training step
};

// The timed parameters: 2048-wide fp32 matrices, each at most 2048 rows, about `params` in all.
struct Shapes {
  static constexpr int64_t kWidth = 2048;
  int64_t rows, matrices, last_rows;
  explicit Shapes(int64_t params)
      : rows(std::max<int64_t>(1, params / kWidth)),
        matrices(std::max<int64_t>(1, rows / kWidth)),
        last_rows(rows - (matrices - 1) * kWidth) {}
};

// One timed step of an optimizer over fresh fp32 parameters of those shapes: the median of `runs`
// steps after one untimed (which makes the state), fresh random gradients before each.
Row time_step(const optim::OptimizerOptions& options, const Shapes& shapes, int64_t runs) {
  torch::OrderedDict<std::string, at::Tensor> named;
  Row row;
  for (int64_t m = 0; m < shapes.matrices; ++m) {
    at::Tensor w = at::randn({m + 1 == shapes.matrices ? shapes.last_rows : Shapes::kWidth, Shapes::kWidth}).requires_grad_();
    named.insert(std::string("w").append(std::to_string(m)), w);  // not "w" + to_string: GCC 12 warns falsely (-Wrestrict)
    row.params += w.numel();
  }
  optim::Optimizer opt(named, options);
  std::vector<double> times;
  for (int64_t r = 0; r <= runs; ++r) {
    for (auto& item : named) item.value().mutable_grad() = at::randn_like(item.value());
    const auto t0 = std::chrono::steady_clock::now();
    opt.step();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) times.push_back(s);  // the first step creates the state
    opt.zero_grad();
  }
  std::sort(times.begin(), times.end());
  const auto n = static_cast<double>(row.params);
  row.step_s = times[times.size() / 2];
  row.state_bytes = opt.state_bytes();
  row.bytes_per_param = static_cast<double>(opt.state_bytes()) / n;
  row.ns_per_param = row.step_s * 1e9 / n;
  row.moved_per_param = 4 + 4 + 4 + 2 * row.bytes_per_param;
  row.achieved_gbs = row.moved_per_param * n / row.step_s / 1e9;
  return row;
}

// LibTorch's own fused CPU kernels (what PyTorch's `fused=True` AdamW and SGD call) exist from 2.4.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define FRUGAL_HAS_ATEN_FUSED_OPTIM 1
#else
#define FRUGAL_HAS_ATEN_FUSED_OPTIM 0
#endif

// frugal's step against LibTorch's fused kernel on the same shapes, in one process, alternating
// within each round (which goes first swaps every round), so a noisy neighbour slows both sides
// alike: the median of each side and the median of the per-round ratios.
struct AgainstFused {
  double frugal_ns = 0, fused_ns = 0, ratio = 0;  // ns per parameter; ratio = frugal / fused
  double max_param_diff = 0;                      // after the same steps from the same values: both did the same update
};

#if FRUGAL_HAS_ATEN_FUSED_OPTIM
// `fused_step(params, grads, states)` runs LibTorch's kernel once over `params` with `grads`;
// `states_per_param` fp32 state tensors a parameter (zeros, as PyTorch starts them).
template <typename FusedStep>
AgainstFused time_against_fused(const optim::OptimizerOptions& options, const Shapes& shapes, int64_t runs, int states_per_param,
                                FusedStep fused_step) {
  torch::OrderedDict<std::string, at::Tensor> named;
  std::vector<at::Tensor> fused_params, grads;
  std::vector<std::vector<at::Tensor>> states(static_cast<size_t>(states_per_param));
  int64_t params = 0;
  for (int64_t m = 0; m < shapes.matrices; ++m) {
    at::Tensor w = at::randn({m + 1 == shapes.matrices ? shapes.last_rows : Shapes::kWidth, Shapes::kWidth});
    fused_params.push_back(w.clone());
    grads.push_back(at::empty_like(w));
    for (auto& s : states) s.push_back(at::zeros_like(w));
    named.insert(std::string("w").append(std::to_string(m)), w.requires_grad_());
    params += w.numel();
  }
  optim::Optimizer opt(named, options);
  std::vector<double> frugal_s, fused_s, ratios;
  auto seconds = [](auto&& fn) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  for (int64_t r = 0; r <= runs; ++r) {
    for (auto& g : grads) g.normal_();
    size_t k = 0;
    for (auto& item : named) item.value().mutable_grad() = grads[k++];  // the same gradients for both sides
    double a = 0, b = 0;
    auto frugal_step = [&] { a = seconds([&] { opt.step(); }); };
    auto their_step = [&] { b = seconds([&] { fused_step(fused_params, grads, states, r); }); };
    if (r % 2 == 0) {
      frugal_step();
      their_step();
    } else {
      their_step();
      frugal_step();
    }
    if (r > 0) {  // the first step creates frugal's state
      frugal_s.push_back(a);
      fused_s.push_back(b);
      ratios.push_back(a / b);
    }
    opt.zero_grad();
  }
  at::NoGradGuard no_grad;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const auto n = static_cast<double>(params);
  AgainstFused out;
  out.frugal_ns = median(frugal_s) * 1e9 / n;
  out.fused_ns = median(fused_s) * 1e9 / n;
  out.ratio = median(ratios);
  size_t k = 0;
  for (auto& item : named) out.max_param_diff = std::max(out.max_param_diff, (item.value() - fused_params[k++]).abs().max().item<double>());
  return out;
}
#endif

// The curves side by side: the mean loss over each tenth of the run.
void print_loss_curves(const std::vector<optim::StatePrecision>& precisions, const std::vector<Row>& rows, int64_t steps) {
  const size_t window = std::max<size_t>(1, static_cast<size_t>(steps) / 10);
  std::fprintf(stderr, "\nloss curves (mean over each %zu steps)\n%10s", window, "steps");
  for (auto p : precisions) std::fprintf(stderr, " %8s", optim::precision_name(p));
  std::fprintf(stderr, "\n");
  for (size_t start = 0; start < rows[0].losses.size(); start += window) {
    std::fprintf(stderr, "%4zu..%-4zu", start + 1, std::min(start + window, rows[0].losses.size()));
    for (const Row& row : rows) {
      const size_t stop = std::min(start + window, row.losses.size());
      double mean = 0;
      for (size_t k = start; k < stop; ++k) mean += row.losses[k] / static_cast<double>(stop - start);
      std::fprintf(stderr, " %8.4f", mean);
    }
    std::fprintf(stderr, "\n");
  }
}

// bytes_per_param, step time, ns_per_param, bytes moved and GB/s (against copy) of one row.
void write_row_figures(io::JsonWriter& w, const Row& row, double copy_gbs) {
  w.key("bytes_per_param").value(row.bytes_per_param);
  w.key("step_time_s").value(row.step_s);
  w.key("ns_per_param").value(row.ns_per_param);
  w.key("bytes_moved_per_param").value(row.moved_per_param);
  w.key("achieved_gbs").value(row.achieved_gbs);
  w.key("fraction_of_copy_bandwidth").value(row.achieved_gbs / copy_gbs);
}

}  // namespace

int bench_optim_state(int argc, char** argv) {
  int64_t params = 50'000'000, steps = 0, runs = 5;
  std::string json_out = "-", recipe_path = "default";
  Args args("bench optim-state",
            "AdamW with its two moments in fp32, bf16, 8-bit and 4-bit blocks: bytes per parameter and the time of one\n"
            "optimizer step over --params parameters (as 2048-wide matrices), against fp32, with the bytes it moves per\n"
            "parameter and the GB/s that achieves beside a plain copy's (same threads); then SGD with momentum 0.9, timed\n"
            "the same way; then both against LibTorch's own fused kernels (2.4 and later), alternating in one process.\n"
            "With --steps N, also trains\n"
            "the recipe N steps per precision, prints the loss curves side by side and compares the final loss with\n"
            "fp32's (the JSON carries every step's loss per precision, for plotting).");
  args.add_int("params", &params, "parameters in the timed step", 4096, int64_t{1} << 40);
  args.add_int("runs", &runs, "timed steps per precision", 1, kMaxRuns);
  args.add_int("steps", &steps, "training steps of the recipe per precision (0: skip)", 0, kMaxSteps);
  args.add_string("recipe", &recipe_path, "the recipe for --steps: a file or a shipped recipe's name", "RECIPE");
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  check_params_fit_memory(params);
  // The recipe is used last: check it, and every key the runs will set, before the timed steps.
  recipe_path = resolve_recipe(recipe_path);
  std::string data_files[2];  // where the recipe keeps its tokenizer and tokens: shared by the runs
  auto recipe_for = [&](optim::StatePrecision p, const std::string& out_dir) {
    try {
      if (data_files[0].empty()) {
        const train::Recipe base = train::load_recipe(recipe_path, {"train.steps=" + std::to_string(steps)});
        data_files[0] = "data.tokenizer=" + base.tokenizer;
        data_files[1] = "data.tokens=" + base.tokens;
      }
      return train::load_recipe(recipe_path, {"train.steps=" + std::to_string(steps), data_files[0], data_files[1],
                                              "train.out_dir=" + out_dir, "train.checkpoint_interval=0", "train.eval_interval=0",
                                              std::string("optimizer.state_precision=") + optim::precision_name(p)});
    } catch (const train::RecipeError& e) {
      throw UsageError(e.what());
    }
  };
  if (steps > 0) check_recipe_inputs(recipe_for(optim::StatePrecision::fp32, io::TempDir::base()), /*data=*/true);

  warn_if_slow_blas();
  const Shapes shapes(params);
  const std::vector<optim::StatePrecision> precisions = {optim::StatePrecision::fp32, optim::StatePrecision::bf16,
                                                         optim::StatePrecision::int8, optim::StatePrecision::int4};
  const int64_t copy_bytes = int64_t{256} << 20;
  const double copy_gbs = copy_bandwidth_gbs(copy_bytes);
  std::fprintf(
      stderr, "copy  %.1f GB/s (at::Tensor::copy_ of %s, read + written; intra-op threads: %d); quantized kernel %s; dense kernel %s%s\n",
      copy_gbs, io::human_bytes(copy_bytes).c_str(), at::get_num_threads(), optim::quant_kernel_name(optim::quant_kernel_chosen()),
      optim::dense_cpu_kernel(),
      !optim::adam_takes_dense_kernel() ? " (not for Adam(W) here: LibTorch's multiply-adds are not fused, so it keeps ATen's operations)"
      : optim::adam_kernel_gives_aten_bits() ? " (Adam(W): torch::optim's bits)"
                                             : " (Adam(W): within an ulp a step of torch::optim, whose sqrt here is MKL's)");
  std::vector<Row> rows_out;
  for (optim::StatePrecision p : precisions) {
    rows_out.push_back(
        time_step(optim::OptimizerOptions().lr(1e-3).weight_decay(0.01).state(optim::StateOptions().precision(p)), shapes, runs));
    const Row& row = rows_out.back();
    std::fprintf(stderr,
                 "%-5s %.3f bytes/param (%s), step %.1f ms over %lld parameters, %.2fx fp32's step time\n"
                 "      %.3f ns/param, moves %.2f bytes/param: %.1f GB/s, %.0f%% of copy\n",
                 optim::precision_name(p), row.bytes_per_param, io::human_bytes(row.state_bytes).c_str(), row.step_s * 1e3,
                 static_cast<long long>(row.params), row.step_s / rows_out[0].step_s, row.ns_per_param, row.moved_per_param,
                 row.achieved_gbs, 100 * row.achieved_gbs / copy_gbs);
  }
  // SGD with momentum (PyTorch's SGD(momentum=0.9, weight_decay=0.01)): one fp32 momentum buffer.
  const Row sgd =
      time_step(optim::OptimizerOptions().algorithm(optim::Algorithm::sgd).lr(1e-3).momentum(0.9).weight_decay(0.01), shapes, runs);
  std::fprintf(stderr,
               "sgd   momentum, %.3f bytes/param (%s), step %.1f ms over %lld parameters, %.2fx fp32 AdamW's step time\n"
               "      %.3f ns/param, moves %.2f bytes/param: %.1f GB/s, %.0f%% of copy\n",
               sgd.bytes_per_param, io::human_bytes(sgd.state_bytes).c_str(), sgd.step_s * 1e3, static_cast<long long>(sgd.params),
               sgd.step_s / rows_out[0].step_s, sgd.ns_per_param, sgd.moved_per_param, sgd.achieved_gbs, 100 * sgd.achieved_gbs / copy_gbs);
  // The two with a 1.0x target against LibTorch's own fused kernels, in one process (above).
  std::optional<AgainstFused> adamw_vs_fused, sgd_vs_fused;
#if FRUGAL_HAS_ATEN_FUSED_OPTIM
  {
    const optim::OptimizerOptions adamw = optim::OptimizerOptions().lr(1e-3).weight_decay(0.01);
    std::vector<at::Tensor> counts;  // PyTorch's per-parameter step counts: fp32 scalars, added to before each step
    adamw_vs_fused = time_against_fused(adamw, shapes, runs, 2, [&](auto& p, auto& g, auto& st, int64_t) {
      if (counts.empty())
        for (size_t k = 0; k < p.size(); ++k) counts.push_back(at::zeros({}));
      at::_foreach_add_(counts, 1);
      at::_fused_adamw_(p, g, st[0], st[1], {}, counts, adamw.lr(), adamw.beta1(), adamw.beta2(), adamw.weight_decay(), adamw.eps(),
                        /*amsgrad=*/false, /*maximize=*/false);
    });
    const optim::OptimizerOptions sgd_options =
        optim::OptimizerOptions().algorithm(optim::Algorithm::sgd).lr(1e-3).momentum(0.9).weight_decay(0.01);
    sgd_vs_fused = time_against_fused(sgd_options, shapes, runs, 1, [&](auto& p, auto& g, auto& st, int64_t round) {
      at::_fused_sgd_(p, g, st[0], sgd_options.weight_decay(), sgd_options.momentum(), sgd_options.lr(), sgd_options.dampening(),
                      sgd_options.nesterov(), /*maximize=*/false, /*is_first_step=*/round == 0);
    });
    std::fprintf(
        stderr,
        "against LibTorch's fused kernels (at::_fused_adamw_, at::_fused_sgd_: PyTorch's fused=True), alternating in this process:\n"
        "      adamw fp32 %.3f vs %.3f ns/param: %.2fx;  sgd momentum %.3f vs %.3f ns/param: %.2fx (median of per-round ratios)\n"
        "      parameters after the same steps differ by at most %.2g (adamw), %.2g (sgd)\n",
        adamw_vs_fused->frugal_ns, adamw_vs_fused->fused_ns, adamw_vs_fused->ratio, sgd_vs_fused->frugal_ns, sgd_vs_fused->fused_ns,
        sgd_vs_fused->ratio, adamw_vs_fused->max_param_diff, sgd_vs_fused->max_param_diff);
  }
#endif
  if (steps > 0) {
    for (size_t i = 0; i < precisions.size(); ++i) {
      const io::TempDir out_dir("frugal-bench-state");  // removed on every way out, signals included
      const train::Recipe r = recipe_for(precisions[i], out_dir.path());
      TrainProgress shown(std::string("frugal bench optim-state (") + optim::precision_name(precisions[i]) + "): ", /*bar=*/false);
      const auto result = train::run_training(r, train::TrainOptions().sample(false).on_progress(shown.on_progress()), shown.log());
      // The final loss: the mean of the last 10% of the steps (one step is noisy).
      const size_t tail = std::max<size_t>(1, result.losses.size() / 10);
      double sum = 0;
      for (size_t k = result.losses.size() - tail; k < result.losses.size(); ++k) sum += result.losses[k];
      rows_out[i].final_loss = sum / static_cast<double>(tail);
      rows_out[i].losses = result.losses;
    }
    print_loss_curves(precisions, rows_out, steps);
  }
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("optim-state").key("params_timed").value(shapes.rows * Shapes::kWidth).key("steps").value(steps);
  w.key("quantized_kernel").value(optim::quant_kernel_name(optim::quant_kernel_chosen()));
  w.key("dense_kernel").value(optim::dense_cpu_kernel()).key("adam_dense_kernel").value(optim::adam_takes_dense_kernel());
  w.key("adam_dense_kernel_aten_bits").value(optim::adam_kernel_gives_aten_bits());
  w.key("sgd_dense_kernel").value(optim::sgd_takes_dense_kernel());
  w.key("threads").value(static_cast<int64_t>(at::get_num_threads()));
  w.key("copy_bytes").value(copy_bytes).key("copy_bandwidth_gbs").value(copy_gbs);
  w.key("precisions").begin_object();
  for (size_t i = 0; i < precisions.size(); ++i) {
    w.key(optim::precision_name(precisions[i])).begin_object();
    write_row_figures(w, rows_out[i], copy_gbs);
    w.key("step_time_ratio_vs_fp32").value(rows_out[i].step_s / rows_out[0].step_s);
    if (steps > 0) {
      w.key("final_loss").value(rows_out[i].final_loss);
      w.key("loss_ratio_vs_fp32").value(rows_out[i].final_loss / rows_out[0].final_loss);
      w.key("losses").begin_array();
      for (double l : rows_out[i].losses) w.value(l);
      w.end_array();
    }
    w.end_object();
  }
  w.end_object();
  w.key("sgd_momentum").begin_object();
  w.key("momentum").value(0.9);
  write_row_figures(w, sgd, copy_gbs);
  w.end_object();
  // null where this LibTorch has no fused CPU kernels (before 2.4)
  w.key("against_libtorch_fused");
  if (!adamw_vs_fused) {
    w.null();
  } else {
    w.begin_object();
    for (const auto& [name, figures] :
         {std::pair<const char*, AgainstFused>{"adamw_fp32", *adamw_vs_fused}, {"sgd_momentum", *sgd_vs_fused}}) {
      w.key(name).begin_object().key("frugal_ns_per_param").value(figures.frugal_ns).key("fused_ns_per_param").value(figures.fused_ns);
      w.key("ratio").value(figures.ratio).key("max_param_diff").value(figures.max_param_diff).end_object();
    }
    w.end_object();
  }
  w.end_object();
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
