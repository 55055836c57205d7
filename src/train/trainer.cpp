#include "frugal/train/trainer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>

#include "frugal/precision/autocast.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/checkpoint/planner.h"
#include "frugal/data/corpus.h"
#include "frugal/dist/sharded_exchange.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json_value.h"
#include "frugal/io/units.h"
#include "frugal/memory/process.h"
#include "frugal/memory/trace.h"
#include "frugal/models/generation.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/optim/schedule.h"
#include "frugal/train/run_state.h"
#include "metrics_file.h"

namespace frugal {
namespace train {
namespace {

using Clock = std::chrono::steady_clock;

// Weight decay on every matrix, embeddings included (as is common), and not on norm weights or biases.
std::vector<optim::ParamGroup> param_groups(models::DecoderImpl& model) {
  optim::ParamGroup decay, no_decay;
  no_decay.weight_decay = 0.0;
  for (const auto& item : model.named_parameters()) {
    auto& g = item.value().dim() >= 2 ? decay : no_decay;
    g.names.push_back(item.key());
    g.params.push_back(item.value());
  }
  return {decay, no_decay};
}

// The job's stages, in the order run_training calls them. Members are declared so that the model,
// optimizer and metrics file go before the tracking guard (their frees are tracked too).
class Trainer {
 public:
  Trainer(const Recipe& recipe, const TrainOptions& options, const LogFn& log)
      : r_(recipe), options_(options), log_(log) {}  // a copy: train.epochs becomes train.steps once the data is known

  // The tokenizer and token file (made when missing), the dataset, the model config with the
  // tokenizer's vocabulary, and the memory estimates for this recipe and with techniques off.
  void setup_data() {
    group_ = options_.group();
    std::string why;
    result_.compute_dtype = resolve_compute_dtype(r_, &why);
    if (result_.compute_dtype != r_.dtype) autocast_ = precision::AutocastState::compute(r_.device.type(), result_.compute_dtype);
    compute_line_ = std::string("compute: ") + dtype_name(result_.compute_dtype) +
                    (autocast_.enabled() ? " matrix products (autocast) over fp32 parameters" : "") + " (" + why + ")";
    // bf16 products run on LibTorch's own thread pool (oneDNN), fp32 ones on the BLAS library's:
    // the pools are sized for the run's precision, for the whole run (autocast.h).
    threads_ = std::make_unique<precision::ComputeThreadsGuard>(r_.device.type(), result_.compute_dtype);
    if (!threads_->describe().empty()) compute_line_ += "; " + threads_->describe();
    if (group_) r_.check_data_parallel(group_->size());  // refused unless the batch splits evenly, and so on
    // Rank 0 makes the tokenizer and token file when they are missing; the others wait for them.
    if (group_ && group_->rank() != 0) group_->barrier("waiting for rank 0 to prepare the data");
    data_ = prepare_data(r_, log_);
    if (group_ && group_->rank() == 0) group_->barrier("waiting for rank 0 to prepare the data");
    tokenizer_.emplace(data::Tokenizer::load(data_.tokenizer_path));
    if (!r_.text_data()) {
      setup_examples();
    } else {
      setup_text();
    }
    cfg_ = r_.model;  // with init_from, resolved from its config.json (resolve_model_config)
    if (r_.init_from.empty()) cfg_.vocab_size = data_.vocab_size;
    dp_ = DataParallel{group_ ? group_->size() : 1, group_ ? group_->rank() : 0};
    result_.estimate = estimate_training_memory(r_, cfg_.vocab_size, dp_);
    result_.estimate_plain = estimate_training_memory(without_techniques(r_), cfg_.vocab_size, dp_);
    if (optim::in_files(r_.optimizer.state().placement())) {
      try {
        optim::check_state_dir_space(r_.optimizer.state().mmap_dir(), result_.estimate.state_in_files_bytes);
      } catch (const std::invalid_argument& e) {
        throw RecipeError(std::string("optimizer.state_dir: ") + e.what());
      }
    }
    check_checkpoint_space();
    result_.world_size = dp_.world_size;
    result_.total_steps = r_.steps;
  }

  // The checkpoints this run will write must fit in train.out_dir: found before the model is made
  // and step 0 runs, not when the last step is done (a save that fails leaves nothing behind).
  // Every rank asks the file system and all refuse when one does.
  void check_checkpoint_space() {
    remove_stale_checkpoint_temps(r_.out_dir);  // a killed save's folder is no checkpoint to keep
    int64_t start = 0;
    if (options_.resume()) {
      try {
        const std::string latest = latest_checkpoint(r_.out_dir);
        if (!latest.empty()) start = read_trainer_state(latest, r_.steps).step;
      } catch (const std::invalid_argument&) {
        // resume() refuses the damaged checkpoint with its own sentence
      }
    }
    const int64_t stop = planned_stop();
    if (start >= stop) return;
    // The saves: every checkpoint_interval steps and at the stop. Once keep + 1 are on disk and the
    // step folders found there pruned, each further save grows out_dir as the one before, so the
    // first keep + 64 and the last are enough (a keep past 2^20 is taken as keeping them all).
    const int64_t keep = r_.keep_checkpoints, one = checkpoint_bytes(result_.estimate.checkpoint_tensor_bytes, data_.tokenizer_path);
    const int64_t interval = r_.checkpoint_interval;
    const int64_t periodic = interval > 0 ? (stop - 1) / interval - start / interval : 0;  // multiples in (start, stop)
    int64_t need = 0;
    if (keep < (int64_t{1} << 20)) {
      std::vector<int64_t> saves;
      for (int64_t k = 1; k <= std::min(periodic, keep + 64); ++k) saves.push_back((start / interval + k) * interval);
      saves.push_back(stop);
      need = checkpoint_space_needed(r_.out_dir, saves, one, keep);
    } else {
      const int64_t count = std::min(periodic + 1, keep + 1);
      need = count > INT64_MAX / std::max<int64_t>(one, 1) ? INT64_MAX : count * one;
    }
    const int64_t free = io::free_space(r_.out_dir);
    int64_t short_of = free >= 0 && need > free ? 1 : 0;
    if (group_) {
      for (int64_t v : group_->allgather({short_of}, "the check of train.out_dir's free space")) short_of = std::max(short_of, v);
    }
    if (!short_of) return;
    const int64_t at_once = std::min(periodic + 1, keep + 1);
    throw RecipeError("train.out_dir: " + r_.out_dir + " has " + (free >= 0 ? io::human_bytes(free) : std::string("too little")) +
                      " free; the checkpoints of this run need " + io::human_bytes(need) + " there (" + std::to_string(at_once) +
                      " of about " + io::human_bytes(one) + " at once with train.keep_checkpoints " + std::to_string(keep) +
                      "): free space there, lower train.keep_checkpoints or choose another train.out_dir");
  }

  // Text: the token file's training and validation splits must each hold one window.
  void setup_text() {
    dataset_.emplace(data_.tokens_path, r_.val_fraction);
    if (dataset_->vocab_size() != data_.vocab_size) throw RecipeError(data_.tokens_path + " does not match the tokenizer");
    // Both splits must hold one window (seq_len + 1 tokens): found now, not at the first evaluation.
    const int64_t window = r_.seq_len + 1;
    if (dataset_->val_tokens() < window) {
      throw RecipeError("data.val_fraction " + std::to_string(r_.val_fraction) + " of the " +
                        std::to_string(dataset_->train_tokens() + dataset_->val_tokens()) + " tokens of " + data_.tokens_path + " leaves " +
                        std::to_string(dataset_->val_tokens()) +
                        " for validation, fewer than train.seq_len + 1 = " + std::to_string(window));
    }
    if (dataset_->train_tokens() < window) {
      throw RecipeError("data.val_fraction " + std::to_string(r_.val_fraction) + " leaves " + std::to_string(dataset_->train_tokens()) +
                        " tokens of " + data_.tokens_path + " for training, fewer than train.seq_len + 1 = " + std::to_string(window));
    }
  }

  // Examples: the training split (all of the examples file, or all but its last val_fraction) and
  // the validation examples, batched by epochs; train.epochs becomes train.steps here.
  void setup_examples() {
    auto file = std::make_shared<const data::ExampleFile>(data_.tokens_path);
    if (file->vocab_size() > data_.vocab_size) throw RecipeError(data_.tokens_path + " does not match the tokenizer");
    std::shared_ptr<const data::ExampleFile> val_file = file;
    int64_t train_end = file->size(), val_first = 0, val_end = 0;
    if (!data_.val_examples_path.empty()) {
      val_file = std::make_shared<const data::ExampleFile>(data_.val_examples_path);
      val_end = val_file->size();
    } else {
      // The last val_fraction of the examples (at least one), in file order.
      const int64_t held = std::max<int64_t>(1, static_cast<int64_t>(std::llround(r_.val_fraction * static_cast<double>(file->size()))));
      train_end = file->size() - held;
      val_first = train_end;
      val_end = file->size();
    }
    if (train_end < 1) {
      throw RecipeError("data.val_fraction " + recipe_number(r_.val_fraction) + " of the " + std::to_string(file->size()) +
                        " examples of " + data_.tokens_path + " leaves none for training (give more examples, or data.validation)");
    }
    if (val_end - val_first < 1) throw RecipeError("data.validation holds no examples");
    data::ExampleBatches::Options o;
    o.rows_per_step = r_.batch_size * r_.optimizer.accumulation_steps();
    o.micro_rows = r_.batch_size;
    o.seq_len = r_.seq_len;
    o.packing = r_.packing;
    o.drop_overlong = r_.drop_overlong;
    o.seed = static_cast<uint64_t>(r_.seed);
    examples_.emplace(file, 0, train_end, o);
    val_examples_.emplace(val_file, val_first, val_end, o);
    val_file_ = val_file;
    val_first_ = val_first;
    ExampleReport& e = result_.examples;
    e.train_examples = train_end;
    e.val_examples = val_end - val_first;
    e.skipped = data_.made.skipped + data_.val_made.skipped;
    e.truncated = examples_->truncated();
    e.dropped = examples_->dropped();
    e.steps_per_epoch = examples_->steps_per_epoch();
    e.padding_share = examples_->padding_share();
    const int64_t epochs = r_.epochs;
    r_ = resolve_epochs(r_, e.steps_per_epoch);
    std::string line = std::to_string(e.train_examples) + " training and " + std::to_string(e.val_examples) + " validation examples; " +
                       std::to_string(e.steps_per_epoch) + " steps an epoch of " + std::to_string(o.rows_per_step) + " rows (" +
                       (r_.packing ? "packed" : "one example a row") + ", " +
                       std::to_string(static_cast<int>(std::lround(100 * e.padding_share))) + "% padding)";
    if (epochs > 0) line += ", " + std::to_string(epochs) + " epochs = " + std::to_string(r_.steps) + " steps";
    if (e.truncated + e.dropped > 0) {
      line += "; " + std::to_string(e.truncated + e.dropped) + " over train.seq_len " + std::to_string(r_.seq_len) + " " +
              (r_.drop_overlong ? "dropped" : "truncated");
    }
    log_(line);
  }

  // Every allocation from here on is tracked. The tracker keeps counters only (unless the options
  // ask for events), so a long run costs no memory for its timeline.
  void track_memory() {
    tracker_ = memory::Tracker::create(options_.keep_events());
    result_.tracker = tracker_;
    tracker_->set_capture_steps(options_.capture_steps());
    if (options_.memory_limit() > 0) tracker_->set_limit(options_.memory_limit());
    tracking_ = std::make_unique<memory::TrackingGuard>(tracker_);
  }

  // The model (seeded, or loaded from init_from) in the recipe's dtype on its device, the
  // optimizer and the learning-rate schedule.
  void build_model() {
    torch::manual_seed(static_cast<uint64_t>(r_.seed));
    {
      memory::CategoryScope scope(memory::Category::parameter);
      // Made in its dtype on its device (no fp32 or host copy of the whole model). Weights that a
      // checkpoint replaces next (model.init_from; --resume with a checkpoint to resume, whose
      // loader refuses one that lacks a parameter) are not drawn first: 2-3 minutes at 7B.
      const bool loaded_next = !r_.init_from.empty() || (options_.resume() && !latest_checkpoint(r_.out_dir).empty());
      model_ = models::make_decoder(cfg_, at::TensorOptions().dtype(r_.dtype).device(r_.device),
                                    loaded_next ? models::WeightInit::for_loading : models::WeightInit::random);
      if (!r_.init_from.empty()) {
        // cfg_ is the folder's config.json already (load_recipe resolved it): only the weights remain to check.
        int64_t loaded = 0;
        try {
          loaded = models::load_hf_weights(*model_, r_.init_from);
        } catch (const std::invalid_argument& e) {
          throw RecipeError(std::string("model.init_from: ") + e.what());
        }
        log_("loaded " + std::to_string(loaded) + " tensors (" + std::to_string(cfg_.param_count()) + " parameters) from " + r_.init_from);
      }
    }
    result_.n_params = cfg_.param_count();
    result_.vocab_size = cfg_.vocab_size;
    optim::OptimizerOptions opt = r_.optimizer;
    if (group_) {
      // Every rank starts from rank 0's weights; mapped state files go to a folder per rank.
      std::vector<dist::Group::Wait> waits;
      at::NoGradGuard no_grad;
      for (const auto& item : model_->named_parameters()) {
        waits.push_back(group_->broadcast_async(item.value(), 0, "the broadcast of the initial '" + item.key() + "'"));
      }
      for (auto& w : waits) w();
      if (optim::in_files(opt.state().placement())) {
        const std::string dir = opt.state().mmap_dir() + "/rank-" + std::to_string(group_->rank());
        io::make_directories(dir);
        opt.state(optim::StateOptions(opt.state()).mmap_dir(dir));
      }
    }
    optimizer_ = std::make_unique<optim::Optimizer>(param_groups(*model_), opt);
    if (group_) {
      const auto owners = dist::assign_owners(optimizer_->parameter_numels(), group_->size());
      optimizer_->set_exchange(std::make_shared<dist::ShardedExchange>(group_, owners, optimizer_->parameter_names()));
    }
    schedule_ = std::make_unique<optim::LRScheduler>(*optimizer_, optim::ScheduleOptions(r_.schedule).total_steps(r_.steps));
  }

  // An activation budget (planned on measured blocks) or the recipe's checkpointing policy.
  void apply_memory_techniques() {
    if (r_.activation_budget <= 0) {
      model_->set_checkpointing(r_.checkpointing);
      result_.recomputed_blocks = 0;
      for (int64_t i = 0; i < cfg_.n_layers; ++i) result_.recomputed_blocks += r_.checkpointing.checkpoints(i) ? 1 : 0;
      return;
    }
    // The plan is made on a full micro-batch of train.seq_len tokens (examples' rows are at most that).
    const at::Tensor tokens = r_.text_data()
                                  ? batch(0).micro.front().tokens
                                  : at::zeros({micro_rows(), r_.seq_len}, at::TensorOptions().dtype(at::kLong).device(r_.device));
    at::Tensor embedded;
    {
      at::NoGradGuard no_grad;
      embedded = model_->embed(tokens);  // the chain's input: (B, T, dim)
    }
    auto costs = [&] {
      precision::AutocastGuard compute(autocast_);  // blocks keep what they keep in the run's precision
      return checkpoint::measure_chain(model_->chain(), embedded.requires_grad_(), 1);
    }();
    // A decoder's blocks are identical: one time for all (their median), so the timer's noise does
    // not pick among plans of equal cost and every run of a recipe makes the same plan.
    auto same_for_all = [&costs](double checkpoint::BlockCost::*field) {
      std::vector<double> times;
      for (const auto& c : costs) times.push_back(c.*field);
      std::nth_element(times.begin(), times.begin() + static_cast<std::ptrdiff_t>(times.size() / 2), times.end());
      for (auto& c : costs) c.*field = times[times.size() / 2];
    };
    same_for_all(&checkpoint::BlockCost::forward_s);
    same_for_all(&checkpoint::BlockCost::tail_s);
    const auto plan = checkpoint::plan_for_budget(costs, r_.activation_budget);
    if (!plan) throw unmet_activation_budget(r_.activation_budget, costs);
    model_->set_plan(*plan);
    result_.recomputed_blocks = plan->checkpointed_blocks();
    // The estimate of the plan chosen (the measured blocks may order their times differently from
    // the formula's equal ones), so it is checked against what runs.
    result_.estimate = estimate_training_memory(r_, cfg_.vocab_size, dp_, &plan->segments);
    plan_line_ = "activation plan for " + io::human_bytes(r_.activation_budget) + ": " + plan->describe() + " (predicted " +
                 io::human_bytes(plan->predicted_bytes) + ")";
  }

  // With options.resume: weights, optimizer state, schedule step and CPU RNG from the latest
  // checkpoint, so the run continues the uninterrupted trajectory bit for bit.
  void resume() {
    // (check_checkpoint_space removed the folders a run killed while saving left behind)
    if (options_.resume()) {
      const std::string latest = latest_checkpoint(r_.out_dir);
      if (!latest.empty()) {
        RunState s;
        try {
          s = load_run_state(latest, *model_, *optimizer_, r_.steps);  // each rank its own parameters' state
        } catch (const std::invalid_argument& e) {
          throw RecipeError(std::string("--resume: ") + e.what());  // a damaged checkpoint is refused, not trained on
        }
        // The loader's freed buffers (a 7B checkpoint's: over 1 GiB of heap) would stay resident.
        memory::release_freed_heap();
        start_ = s.step;
        schedule_->set_last_step(s.schedule_step);
        rng_state_from_hex(s.rng_state_hex);
        result_.checkpoint = latest;
        // The metrics file is read back (cut to this step) only when the run starts: one that is
        // no regular file is refused now, before anything is printed.
        const std::string metrics = r_.out_dir + "/metrics.jsonl";
        if (is_rank0() && io::path_exists(metrics)) io::open_regular_file(metrics, "--resume: metrics file");
        log_("resumed from " + latest + " at step " + std::to_string(start_));
      } else {
        log_("nothing to resume in " + r_.out_dir + ": starting from step 0");
      }
    }
    stop_ = planned_stop();
    result_.first_step = start_;
  }

  // The step this run stops after: --stop-after or the recipe's last.
  int64_t planned_stop() const { return options_.stop_after() >= 0 ? std::min(options_.stop_after(), r_.steps) : r_.steps; }

  // Resumed at or past where this run stops: there is nothing to train, evaluate or write.
  bool nothing_to_do() const { return options_.resume() && start_ > 0 && start_ >= stop_; }
  TrainResult nothing_done() {
    result_.already_complete = true;
    result_.last_step = start_;
    result_.n_params = cfg_.param_count();
    return std::move(result_);
  }

  // Opens the metrics file where the run (re)starts and starts the throughput clock.
  void start_metrics() {
    // Once every input has been checked (a refused one is the only line a bad run prints): the
    // products' precision and why, then the checkpointing plan.
    log_(compute_line_);
    if (!plan_line_.empty()) log_(plan_line_);
    if (is_rank0()) metrics_ = std::make_unique<MetricsFile>(r_.out_dir + "/metrics.jsonl", start_);
    recipe_yaml_ = recipe_to_yaml(r_);
    if (group_) traffic_start_ = group_->traffic();
    t_start_ = t_log_ = Clock::now();
  }

  int64_t first_step() const { return start_; }
  int64_t stop_step() const { return stop_; }  // one past the last step to run

  // Forward, backward and the optimizer step on the step's batch; returns the loss.
  double train_step(int64_t step) {
    const auto t0 = Clock::now();
    auto seconds_since = [](Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); };
    StepTiming timing;
    const double update_before = optimizer_->update_seconds(), io_before = optimizer_->state_transfer_seconds();
    const double wait_before = optimizer_->update_wait_seconds();
    const int64_t faults_before = memory::major_page_faults();
    memory::mark_step(step);
    const StepBatch b = batch(step);
    // Gradient accumulation: the step's batch in micro-batches of train.batch_size rows; the
    // optimizer updates on the K-th step() call. Text: each micro-batch's mean loss scaled by 1/K,
    // so the accumulated gradient is the whole batch's mean. Examples: each micro-batch's summed
    // loss divided by the label tokens of the whole step (every micro-batch, every rank), as
    // transformers does with labels of -100, so an example's tokens weigh the same wherever it lands.
    const int64_t micro = r_.optimizer.accumulation_steps();
    const models::LossOptions loss_options = b.sum_loss ? models::LossOptions(r_.loss).reduction(loss::Reduction::sum) : r_.loss;
    const double world = group_ ? static_cast<double>(group_->size()) : 1.0;
    const double scale = !b.sum_loss          ? 1.0 / static_cast<double>(micro)
                         : b.label_tokens > 0 ? world / static_cast<double>(b.label_tokens)
                                              : 0.0;  // ranks' gradients are averaged
    double value = 0;
    try {
      for (int64_t k = 0; k < micro; ++k) {
        at::Tensor loss;
        const MicroBatch& mb = b.micro[static_cast<size_t>(k)];
        {
          memory::PhaseScope fw(memory::Phase::forward);
          const auto t = Clock::now();
          // Forward under the run's autocast state; backward outside it, as torch.autocast asks
          // (recomputed regions re-enter the forward's state themselves).
          precision::AutocastGuard compute(autocast_);
          loss = model_->loss(mb.tokens, mb.targets, loss_options, mb.segments);
          if (scale != 1.0) loss = loss * scale;
          timing.forward_s += seconds_since(t);
        }
        check_memory_limit();
        {
          memory::PhaseScope bw(memory::Phase::backward);
          const auto t = Clock::now();
          optimizer_->backward(loss);
          timing.backward_s += seconds_since(t);
        }
        check_memory_limit();
        {
          memory::PhaseScope op(memory::Phase::optimizer);
          optimizer_->step();
        }
        check_memory_limit();
        optimizer_->zero_grad();  // a no-op until the K-th micro-batch
        value += loss.item<double>();
      }
    } catch (const c10::Error&) {
      check_memory_limit();  // the allocator ran out: it told the tracker what was asked for; explain with that
      throw;
    }
    step_tokens_ = b.real_tokens;
    result_.examples.label_tokens += r_.text_data() ? 0 : b.label_tokens;
    result_.examples.real_tokens += r_.text_data() ? 0 : b.real_tokens;
    result_.examples.processed_tokens += r_.text_data() ? 0 : b.processed_tokens;
    if (group_) {
      // The whole batch's loss: the mean of the ranks' (equal shares; with examples each rank's is
      // already its tokens' share of the step's, times the world size).
      at::Tensor sum = at::scalar_tensor(value, at::kDouble).reshape({1});
      group_->allreduce_sum(sum, "the sum of the step's losses");
      value = sum.item<double>() / static_cast<double>(group_->size());
    }
    schedule_->step();
    if (!std::isfinite(value)) throw std::runtime_error("the loss became " + std::to_string(value) + " at step " + std::to_string(step));
    result_.losses.push_back(value);
    timing.optimizer_s = optimizer_->update_seconds() - update_before;
    timing.state_io_s = optimizer_->state_transfer_seconds() - io_before;
    timing.major_faults = memory::major_page_faults() - faults_before;
    timing.update_wait_s = optimizer_->update_wait_seconds() - wait_before;
    timing.updates_overlapped = r_.optimizer.update_threads() > 0;
    // Updates inside backward's hooks are part of its time; on their own thread they run beside it.
    if (r_.in_backward() && !timing.updates_overlapped) timing.backward_s = std::max(0.0, timing.backward_s - timing.optimizer_s);
    timing.total_s = seconds_since(t0);
    timing.tokens = b.real_tokens;
    result_.timings.push_back(timing);
    return value;
  }

  // The step's metrics line and progress report (`done` steps are done).
  void report_step(int64_t done, double loss) {
    const int64_t tokens = step_tokens_;
    tokens_since_log_ += tokens;
    tokens_done_ += tokens;
    const auto now = Clock::now();
    const double elapsed = std::chrono::duration<double>(now - t_start_).count();
    StepProgress p;
    p.step = done;
    p.total_steps = r_.steps;
    p.loss = loss;
    p.lr = optimizer_->lr();
    p.tokens_per_s = static_cast<double>(tokens_done_) / std::max(elapsed, 1e-9);
    p.live_bytes = tracker_->live_bytes();
    p.peak_bytes = tracker_->peak_bytes();
    p.eta_s = elapsed / static_cast<double>(done - start_) * static_cast<double>(r_.steps - done);
    p.at_log_interval = done % r_.log_interval == 0 || done == r_.steps;
    p.interval_tokens_per_s = static_cast<double>(tokens_since_log_) / std::max(std::chrono::duration<double>(now - t_log_).count(), 1e-9);
    if (p.at_log_interval) {
      t_log_ = now;
      tokens_since_log_ = 0;
    }
    if (metrics_) metrics_->step(done, loss, p.lr, p.tokens_per_s, p.live_bytes, p.peak_bytes);
    if (options_.on_progress()) options_.on_progress()(p);
  }

  // Every train.eval_interval steps (except the last: finish() evaluates then).
  void evaluate_if_due(int64_t done) {
    if (r_.eval_interval <= 0 || done % r_.eval_interval != 0 || done == r_.steps || !is_rank0()) return;
    const double v = evaluate();
    metrics_->validation(done, v);
    char line[96];
    std::snprintf(line, sizeof(line), "step %lld  validation loss %.4f", static_cast<long long>(done), v);
    log_(line);
  }

  // Every train.checkpoint_interval steps, and at the stop.
  void checkpoint_if_due(int64_t done, double loss) {
    if (!((r_.checkpoint_interval > 0 && done % r_.checkpoint_interval == 0) || done == stop_)) return;
    // After the last step the run is still busy for a while: say with what (also below).
    if (done == stop_) log_("step " + std::to_string(done) + " done: saving the checkpoint");
    RunState s;
    s.step = done;
    s.schedule_step = schedule_->last_step();
    s.rng_state_hex = rng_state_to_hex();
    s.last_loss = loss;
    result_.checkpoint =
        save_run_state(r_.out_dir, s, *model_, *optimizer_, recipe_yaml_, data_.tokenizer_path, r_.keep_checkpoints, group_.get());
  }

  // Throughput, the measured peak, the final validation loss, and a sample.
  TrainResult finish() {
    result_.last_step = std::max(start_, stop_);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start_).count();
    result_.tokens_per_s = static_cast<double>(tokens_done_) / std::max(elapsed, 1e-9);
    result_.peak = peak_memory_after_training();
    result_.process_after_steps = memory::process_memory();
    result_.tracked_after_steps = tracker_->live_bytes();
    if (group_) {
      // Every rank's peak by category, for rank 0's summary (this rank's is result_.peak).
      std::vector<int64_t> mine(result_.peak.breakdown.begin(), result_.peak.breakdown.end());
      mine.push_back(result_.peak.peak_bytes);
      const std::vector<int64_t> all = group_->allgather(mine, "the gathering of the ranks' peaks");
      for (int64_t rank = 0; rank < group_->size(); ++rank) {
        memory::CategoryBytes b{};
        for (size_t c = 0; c < b.size(); ++c) b[c] = all[static_cast<size_t>(rank) * mine.size() + c];
        result_.peak_by_rank.push_back(b);
        result_.peak_bytes_by_rank.push_back(all[static_cast<size_t>(rank) * mine.size() + b.size()]);
      }
      // The steps' collectives (from the first step to the last, checkpoints included).
      const dist::Traffic now = group_->traffic();
      result_.traffic.reduce_bytes = now.reduce_bytes - traffic_start_.reduce_bytes;
      result_.traffic.broadcast_bytes = now.broadcast_bytes - traffic_start_.broadcast_bytes;
      result_.traffic.allreduce_bytes = now.allreduce_bytes - traffic_start_.allreduce_bytes;
      result_.traffic.calls = now.calls - traffic_start_.calls;
      if (!is_rank0()) return std::move(result_);  // rank 0 evaluates and samples
    }
    log_("final evaluation on " + std::to_string(r_.eval_batches) + " validation batches");
    result_.val_loss = evaluate();
    metrics_->validation(result_.last_step, result_.val_loss);
    metrics_.reset();
    if (options_.sample() && r_.sample_tokens > 0 && !r_.text_data()) {
      memory::PhaseScope phase(memory::Phase::sampling);
      precision::AutocastGuard compute(autocast_);
      result_.sample = answer_first_validation_example();
    } else if (options_.sample() && r_.sample_tokens > 0) {
      log_("sampling " + std::to_string(r_.sample_tokens) + " tokens after \"" + r_.sample_prompt + "\"");
      memory::PhaseScope phase(memory::Phase::sampling);
      precision::AutocastGuard compute(autocast_);
      result_.sample =
          models::generate(
              *model_, *tokenizer_, r_.sample_prompt,
              models::GenerationOptions().max_new_tokens(r_.sample_tokens).temperature(0.8).top_k(40).seed(static_cast<uint64_t>(r_.seed)))
              .text;
    }
    return std::move(result_);
  }

 private:
  // ---- Peak memory: the one place the run's peak is measured ----
  // Over every step run here, from the tracker's step summaries: what the terminal, --json-out and
  // the trace's HTML page all report (memory::peak_over_steps; covers_* say which steps).
  memory::PeakReport peak_memory_after_training() const { return memory::peak_over_steps(tracker_->step_summaries(), start_); }

  // Stops the run (a safe point: between phases) once the limit was crossed or an allocation failed.
  void check_memory_limit() const {
    const auto report = tracker_->limit_report();
    if (report.exceeded) {
      throw MemoryLimitExceeded(explain_memory_limit(r_, cfg_.vocab_size, report, options_.memory_limit()));
    }
  }

  // One micro-batch on the device: (B, T) int64 inputs and targets, and with packed examples the
  // (B, T) segments.
  struct MicroBatch {
    at::Tensor tokens, targets, segments;
  };
  struct StepBatch {
    std::vector<MicroBatch> micro;  // this rank's rows of each micro-batch
    bool sum_loss = false;          // examples: summed losses over label_tokens
    int64_t label_tokens = 0;       // of the whole step (every rank)
    int64_t real_tokens = 0;        // of the whole step, padding left out
    int64_t processed_tokens = 0;   // of the whole step, padding included
  };

  // The step's micro-batches; which rows depend on (seed, step) only, so a resumed run sees the
  // batches the uninterrupted one would have. Data parallel: this rank's share of each micro-batch,
  // rows [r B/N, (r+1) B/N) of micro-batch k, so the micro-batches are one process's, split.
  StepBatch batch(int64_t step) const {
    memory::CategoryScope scope(memory::Category::input);
    const int64_t micro = r_.optimizer.accumulation_steps(), share = micro_rows();
    const int64_t first_row = group_ ? group_->rank() * share : 0;
    StepBatch out;
    // A rank keeps a copy of its rows only, not a view holding the whole batch.
    auto mine = [&](const at::Tensor& t) { return (group_ ? t.narrow(0, first_row, share).clone() : t).to(r_.device); };
    if (r_.text_data()) {
      const auto [x, y] = dataset_->train_batch(step, r_.batch_size * micro, r_.seq_len, static_cast<uint64_t>(r_.seed));
      for (int64_t k = 0; k < micro; ++k) {
        const at::Tensor xk = x.narrow(0, k * r_.batch_size, r_.batch_size), yk = y.narrow(0, k * r_.batch_size, r_.batch_size);
        out.micro.push_back({mine(xk), mine(yk), at::Tensor()});
      }
      out.label_tokens = out.real_tokens = out.processed_tokens = x.numel();
      return out;
    }
    out.sum_loss = true;
    for (const data::ExampleBatch& e : examples_->step(step)) {
      out.micro.push_back({mine(e.tokens), mine(e.targets), e.segments.defined() ? mine(e.segments) : at::Tensor()});
      out.label_tokens += e.label_tokens;
      out.real_tokens += e.real_tokens;
      out.processed_tokens += e.tokens.numel();
    }
    return out;
  }

  // Greedy, the model's answer to the first validation example's prompt (its tokens before the
  // first with loss), stopped at the token that ends that example's answer (EOS, <|eot_id|>,
  // <|im_end|>) or the tokenizer's EOS; with the expected answer beside it.
  std::string answer_first_validation_example() {
    const data::ExampleFile& f = *val_file_;
    const int64_t n = f.length(val_first_);
    const int32_t* ids = f.tokens(val_first_);
    const uint8_t* loss = f.loss(val_first_);
    int64_t answer = 0;
    while (answer < n && !loss[answer]) ++answer;
    if (answer == 0 || answer == n) return "";
    std::vector<int32_t> eos = {ids[n - 1]};
    if (tokenizer_->eos_id() >= 0) eos.push_back(tokenizer_->eos_id());
    const std::vector<int32_t> prompt(ids, ids + answer);
    std::vector<int32_t> expected(ids + answer, ids + n);
    if (!expected.empty() && std::find(eos.begin(), eos.end(), expected.back()) != eos.end()) expected.pop_back();
    log_("answering the first validation example (" + std::to_string(answer) + " prompt tokens), greedy, at most " +
         std::to_string(r_.sample_tokens) + " tokens");
    const models::Generation g =
        models::generate_ids(*model_, prompt, models::GenerationOptions().max_new_tokens(r_.sample_tokens).temperature(0).eos_ids(eos));
    return "\"" + tokenizer_->decode(g.tokens) + "\" (expected \"" + tokenizer_->decode(expected) + "\")";
  }

  bool is_rank0() const { return !group_ || group_->rank() == 0; }
  // Rows of one micro-batch on this rank.
  int64_t micro_rows() const { return group_ ? r_.batch_size / group_->size() : r_.batch_size; }

  // The mean loss over train.eval_batches validation batches.
  double evaluate() {
    at::NoGradGuard no_grad;
    memory::PhaseScope phase(memory::Phase::evaluation);
    precision::AutocastGuard compute(autocast_);
    double total = 0;
    if (!r_.text_data()) {
      // The mean over every answer token of the batches (as training's loss), not a mean of means.
      int64_t counted = 0;
      const models::LossOptions sum = models::LossOptions(r_.loss).reduction(loss::Reduction::sum);
      for (int64_t i = 0; i < r_.eval_batches; ++i) {
        memory::CategoryScope scope(memory::Category::input);
        const data::ExampleBatch e = val_examples_->eval_batch(i);
        total +=
            model_
                ->loss(e.tokens.to(r_.device), e.targets.to(r_.device), sum, e.segments.defined() ? e.segments.to(r_.device) : at::Tensor())
                .item<double>();
        counted += e.label_tokens;
      }
      return counted > 0 ? total / static_cast<double>(counted) : 0.0;
    }
    for (int64_t i = 0; i < r_.eval_batches; ++i) {
      memory::CategoryScope scope(memory::Category::input);
      const auto [x, y] = dataset_->val_batch(i, r_.batch_size, r_.seq_len);
      total += model_->loss(x.to(r_.device), y.to(r_.device), r_.loss).item<double>();
    }
    return total / static_cast<double>(r_.eval_batches);
  }

  Recipe r_;
  const TrainOptions& options_;
  const LogFn& log_;
  TrainResult result_;
  PreparedData data_;
  std::optional<data::Tokenizer> tokenizer_;
  std::optional<data::TokenDataset> dataset_;                    // text
  std::optional<data::ExampleBatches> examples_, val_examples_;  // examples
  std::shared_ptr<const data::ExampleFile> val_file_;            // the validation examples' file, from val_first_
  int64_t val_first_ = 0;
  models::DecoderConfig cfg_;
  std::shared_ptr<memory::Tracker> tracker_;
  std::unique_ptr<memory::TrackingGuard> tracking_;
  models::Decoder model_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> schedule_;
  std::unique_ptr<MetricsFile> metrics_;
  std::shared_ptr<dist::Group> group_;
  DataParallel dp_;
  std::string compute_line_, plan_line_;                                 // logged when training starts
  precision::AutocastState autocast_ = precision::AutocastState::off();  // on when compute_dtype differs from model.dtype
  std::unique_ptr<precision::ComputeThreadsGuard> threads_;              // thread pools for the compute dtype, until the run ends
  dist::Traffic traffic_start_;
  std::string recipe_yaml_;
  int64_t start_ = 0, stop_ = 0;
  Clock::time_point t_start_, t_log_;
  int64_t tokens_since_log_ = 0;
  int64_t step_tokens_ = 0, tokens_done_ = 0;  // of the step just run (padding left out), and of every step run here
};

}  // namespace

double step_matmul_flops(const Recipe& r, const TrainResult& result, bool with_recompute) {
  models::DecoderConfig c = r.model;
  c.vocab_size = result.vocab_size;
  const models::DecoderFlops f = models::decoder_flops(c, r.batch_size, r.seq_len);
  const double recomputed = with_recompute ? static_cast<double>(result.recomputed_blocks) : 0.0;
  const double full = static_cast<double>(r.optimizer.accumulation_steps()) * (3 * f.forward + recomputed * f.block_forward);
  const int64_t steps = result.last_step - result.first_step;
  if (r.text_data() || steps <= 0) return full;
  // Examples' rows may be shorter than train.seq_len (padded to the longest of each micro-batch):
  // the products scale with the tokens computed (the attention scores' share, quadratic in the
  // row's length, is taken as linear here).
  const double full_tokens = static_cast<double>(r.tokens_per_step());
  return full * static_cast<double>(result.examples.processed_tokens) / static_cast<double>(steps) / full_tokens;
}

TrainResult run_training(const Recipe& recipe, const TrainOptions& options, const LogFn& log) {
  Trainer job(recipe, options, log);
  job.setup_data();
  job.track_memory();
  job.build_model();
  job.apply_memory_techniques();
  job.resume();
  if (job.nothing_to_do()) return job.nothing_done();
  job.start_metrics();
  for (int64_t step = job.first_step(); step < job.stop_step(); ++step) {
    const double loss = job.train_step(step);
    job.report_step(step + 1, loss);
    job.evaluate_if_due(step + 1);
    job.checkpoint_if_due(step + 1, loss);
  }
  return job.finish();
}

}  // namespace train
}  // namespace frugal
