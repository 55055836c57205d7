#include "frugal/train/trainer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "frugal/checkpoint/planner.h"
#include "frugal/data/corpus.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/units.h"
#include "frugal/memory/trace.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/optim/schedule.h"
#include "frugal/train/run_state.h"

namespace frugal {
namespace train {
namespace {

using Clock = std::chrono::steady_clock;

// Weight decay on matrices only (not on norms, biases or... embeddings included, as is common).
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

std::string format_duration(double s) {
  char buf[32];
  const int64_t t = static_cast<int64_t>(s);
  if (t >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(t / 3600), static_cast<long long>(t / 60 % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(t / 60), static_cast<long long>(t % 60));
  }
  return buf;
}

// Keeps the metrics lines of steps <= last_step (a resumed run rewrites what came after).
void truncate_metrics(const std::string& path, int64_t last_step) {
  std::ifstream in(path);
  if (!in) return;
  std::string line, kept;
  while (std::getline(in, line)) {
    try {
      const io::JsonValue j = io::parse_json(line);
      if (j.at("step").as_int() <= last_step) kept += line + "\n";
    } catch (const std::exception&) {
      // a line cut by a kill: dropped
    }
  }
  io::write_file_atomic(path, kept);
}

}  // namespace

PreparedData prepare_data(const Recipe& r, const std::function<void(const std::string&)>& log) {
  PreparedData p;
  p.tokenizer_path = r.tokenizer;
  p.tokens_path = r.tokens;
  std::vector<std::string> docs;
  auto corpus = [&]() -> const std::vector<std::string>& {
    if (docs.empty()) {
      if (r.corpus.empty()) throw RecipeError("data.corpus is needed to make " + r.tokenizer + " or " + r.tokens);
      docs = data::read_corpus(r.corpus);
      log("read " + std::to_string(docs.size()) + " documents from " + r.corpus);
    }
    return docs;
  };
  if (p.tokenizer_path.empty()) throw RecipeError("data.tokenizer must be set");
  if (!io::path_exists(p.tokenizer_path)) {
    const std::string suffix = ".model";
    if (p.tokenizer_path.size() <= suffix.size() ||
        p.tokenizer_path.compare(p.tokenizer_path.size() - suffix.size(), suffix.size(), suffix) != 0) {
      throw RecipeError("data.tokenizer " + p.tokenizer_path + " does not exist (and must end in .model to be trained)");
    }
    const int64_t vocab = r.model.vocab_size > 0 ? r.model.vocab_size : 4096;
    log("training a " + std::to_string(vocab) + "-piece tokenizer into " + p.tokenizer_path);
    io::make_directories(io::parent_path(p.tokenizer_path));
    // Trained under a temporary name and renamed, so a concurrent run never reads half a file.
    const std::string prefix = p.tokenizer_path.substr(0, p.tokenizer_path.size() - suffix.size());
    const std::string tmp_prefix = prefix + ".tmp-" + std::to_string(::getpid());
    data::train_tokenizer(corpus(), tmp_prefix, data::TokenizerTrainOptions().vocab_size(vocab));
    std::rename((tmp_prefix + ".vocab").c_str(), (prefix + ".vocab").c_str());
    if (std::rename((tmp_prefix + ".model").c_str(), p.tokenizer_path.c_str()) != 0) {
      throw std::runtime_error("cannot move the trained tokenizer to " + p.tokenizer_path);
    }
  }
  const data::Tokenizer tok = data::Tokenizer::load(p.tokenizer_path);
  p.vocab_size = tok.vocab_size();
  if (r.model.vocab_size > 0 && r.model.vocab_size != p.vocab_size) {
    throw RecipeError("model.vocab_size " + std::to_string(r.model.vocab_size) + " differs from the tokenizer's " +
                      std::to_string(p.vocab_size) + " (set model.vocab_size=0 to take the tokenizer's)");
  }
  bool fresh = !io::path_exists(p.tokens_path);
  if (!fresh) {
    data::TokenFile f(p.tokens_path);
    fresh = f.vocab_size() != p.vocab_size;
    if (fresh) log(p.tokens_path + " was made with another tokenizer: remaking it");
  }
  if (fresh) {
    io::make_directories(io::parent_path(p.tokens_path));
    const int64_t n = data::tokenize_corpus(corpus(), tok, p.tokens_path);
    log("tokenized the corpus into " + std::to_string(n) + " tokens: " + p.tokens_path);
  }
  return p;
}

std::string generate_text(models::DecoderImpl& model, const data::Tokenizer& tok, const std::string& prompt,
                          int64_t n_tokens, double temperature, int64_t top_k, uint64_t seed) {
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  std::vector<int32_t> ids = tok.encode(prompt);
  ids.insert(ids.begin(), tok.bos_id());
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t window = model.config().max_seq_len;
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n_tokens; ++i) {
    const size_t start = ids.size() > static_cast<size_t>(window) ? ids.size() - static_cast<size_t>(window) : 0;
    const std::vector<int64_t> context(ids.begin() + static_cast<std::ptrdiff_t>(start), ids.end());
    const at::Tensor x = at::tensor(context, at::kLong).unsqueeze(0).to(device);  // (1, T)
    at::Tensor logits = model.logits(x).select(1, -1).squeeze(0).to(at::kFloat).to(at::kCPU);  // (V)
    int32_t next;
    if (temperature <= 0) {
      next = static_cast<int32_t>(logits.argmax().item<int64_t>());
    } else {
      logits = logits / temperature;
      if (top_k > 0 && top_k < logits.size(0)) {
        const at::Tensor kth = std::get<0>(logits.topk(top_k)).select(0, top_k - 1);
        logits = logits.masked_fill(logits < kth, -INFINITY);
      }
      next = static_cast<int32_t>(at::multinomial(at::softmax(logits, 0), 1, false, gen).item<int64_t>());
    }
    if (next == tok.eos_id()) break;
    ids.push_back(next);
    out.push_back(next);
  }
  if (was_training) model.train();
  return prompt + tok.decode(out);
}

TrainResult run_training(const Recipe& r, const TrainOptions& options, const std::function<void(const std::string&)>& log) {
  TrainResult result;
  const PreparedData data = prepare_data(r, log);
  const data::Tokenizer tok = data::Tokenizer::load(data.tokenizer_path);
  data::TokenDataset dataset(data.tokens_path, r.val_fraction);
  if (dataset.vocab_size() != data.vocab_size) throw RecipeError(data.tokens_path + " does not match the tokenizer");

  models::DecoderConfig cfg = r.model;
  cfg.vocab_size = data.vocab_size;
  const c10::Device device = r.device;
  result.estimate = estimate_training_memory(r, cfg.vocab_size);
  result.estimate_plain = estimate_training_memory(without_techniques(r), cfg.vocab_size);

  // The tracker keeps counters only, so a long run costs no memory for its timeline.
  auto tracker = memory::Tracker::create(options.keep_events());
  result.tracker = tracker;
  tracker->set_capture_steps(options.capture_steps());
  if (options.memory_limit() > 0) tracker->set_limit(options.memory_limit());
  // Stops the run (a safe point: between phases) once the limit was crossed or an allocation failed.
  auto check_limit = [&]() {
    const auto report = tracker->limit_report();
    if (report.exceeded) {
      throw MemoryLimitExceeded(explain_memory_limit(r, cfg.vocab_size, report, options.memory_limit()));
    }
  };
  memory::TrackingGuard tracking(tracker);

  torch::manual_seed(static_cast<uint64_t>(r.seed));
  models::Decoder model;
  {
    memory::CategoryScope scope(memory::Category::parameter);
    model = models::make_decoder(cfg);
    if (!r.init_from.empty()) {
      const auto file_cfg = models::read_hf_config(r.init_from + "/config.json");
      if (file_cfg.param_count() != cfg.param_count()) {
        throw RecipeError("model.init_from " + r.init_from + " holds a model of another shape than the recipe's");
      }
      models::load_hf_weights(*model, r.init_from);
    }
    model->to(device, r.dtype);
  }
  result.n_params = cfg.param_count();
  const models::LossOptions& loss_options = r.loss;

  optim::Optimizer opt(param_groups(*model), r.optimizer);
  optim::LRScheduler sched(opt, optim::ScheduleOptions(r.schedule).total_steps(r.steps));

  auto batch = [&](int64_t step) {
    memory::CategoryScope scope(memory::Category::input);
    auto b = dataset.train_batch(step, r.batch_size, r.seq_len, static_cast<uint64_t>(r.seed));
    return std::make_pair(b.first.to(device), b.second.to(device));
  };

  // Memory techniques: an activation budget (planned on measured blocks) or a policy.
  if (r.activation_budget > 0) {
    const auto [tokens, targets] = batch(0);
    const auto chain = model->chain();
    at::Tensor embedded;
    {
      at::NoGradGuard no_grad;
      embedded = model->embed(tokens);  // the chain's input
    }
    const auto costs = checkpoint::measure_chain(chain, embedded.requires_grad_(), 1);
    const auto plan = checkpoint::plan_for_budget(costs, r.activation_budget);
    if (!plan) {
      throw RecipeError("memory.activation_budget " + std::to_string(r.activation_budget) +
                        " cannot be met: the smallest achievable activation peak is " +
                        std::to_string(checkpoint::min_achievable_bytes(costs)) + " bytes");
    }
    model->set_plan(*plan);
    log("activation plan for " + io::human_bytes(r.activation_budget) + ": " + plan->describe() + " (predicted " +
        io::human_bytes(plan->predicted_bytes) + ")");
  } else {
    model->set_checkpointing(r.checkpointing);
  }

  // Resume.
  int64_t start = 0;
  const std::string metrics_path = r.out_dir + "/metrics.jsonl";
  io::make_directories(io::parent_path(metrics_path));
  if (options.resume()) {
    const std::string latest = latest_checkpoint(r.out_dir);
    if (!latest.empty()) {
      const RunState s = load_run_state(latest, *model, opt);
      start = s.step;
      sched.set_last_step(s.schedule_step);
      rng_state_from_hex(s.rng_state_hex);
      log("resumed from " + latest + " at step " + std::to_string(start));
    } else {
      log("nothing to resume in " + r.out_dir + ": starting from step 0");
    }
  }
  if (start == 0) {
    io::write_file_atomic(metrics_path, "");
  } else {
    truncate_metrics(metrics_path, start);
  }
  std::FILE* metrics = std::fopen(metrics_path.c_str(), "a");
  if (!metrics) throw std::runtime_error("cannot open " + metrics_path);
  result.first_step = start;
  const std::string recipe_yaml = recipe_to_yaml(r);

  auto evaluate = [&]() {
    at::NoGradGuard no_grad;
    double total = 0;
    for (int64_t i = 0; i < r.eval_batches; ++i) {
      memory::CategoryScope scope(memory::Category::input);
      const auto [x, y] = dataset.val_batch(i, r.batch_size, r.seq_len);
      total += model->loss(x.to(device), y.to(device), loss_options).item<double>();
    }
    return total / static_cast<double>(r.eval_batches);
  };
  auto checkpoint_now = [&](int64_t step, double loss) {
    RunState s;
    s.step = step;
    s.schedule_step = sched.last_step();
    s.rng_state_hex = rng_state_to_hex();
    s.last_loss = loss;
    result.checkpoint = save_run_state(r.out_dir, s, *model, opt, recipe_yaml, data.tokenizer_path, r.keep_checkpoints);
  };

  const auto t_start = Clock::now();
  auto t_log = Clock::now();
  int64_t tokens_since_log = 0;
  double loss_value = 0;
  const int64_t stop = options.stop_after() >= 0 ? std::min(options.stop_after(), r.steps) : r.steps;
  for (int64_t step = start; step < stop; ++step) {
    memory::mark_step(step);
    const auto [x, y] = batch(step);
    at::Tensor loss;
    try {
      {
        memory::PhaseScope fw(memory::Phase::forward);
        loss = model->loss(x, y, loss_options);
      }
      check_limit();
      {
        memory::PhaseScope bw(memory::Phase::backward);
        opt.backward(loss);
      }
      check_limit();
      {
        memory::PhaseScope op(memory::Phase::optimizer);
        opt.step();
      }
      check_limit();
    } catch (const c10::Error& e) {
      // The allocator ran out: it told the tracker what was asked for; explain with that.
      check_limit();
      throw;
    }
    opt.zero_grad();
    sched.step();
    loss_value = loss.item<double>();
    loss.reset();
    if (!std::isfinite(loss_value)) throw std::runtime_error("the loss became " + std::to_string(loss_value) + " at step " + std::to_string(step));
    result.losses.push_back(loss_value);
    tokens_since_log += r.batch_size * r.seq_len;

    const int64_t done = step + 1;
    const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
    const double rate = static_cast<double>((done - start) * r.batch_size * r.seq_len) / std::max(elapsed, 1e-9);
    std::fprintf(metrics, "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6g, \"tokens_per_s\": %.1f, \"live_bytes\": %lld, \"peak_bytes\": %lld}\n",
                 static_cast<long long>(done), loss_value, opt.lr(), rate, static_cast<long long>(tracker->live_bytes()),
                 static_cast<long long>(tracker->peak_bytes()));
    std::fflush(metrics);
    const double eta = elapsed / static_cast<double>(done - start) * static_cast<double>(r.steps - done);
    if (options.progress_bar()) {
      const int width = 24;
      const int filled = static_cast<int>(width * done / r.steps);
      std::fprintf(stderr, "\r[%s%s] step %lld/%lld  loss %.4f  %.0f tok/s  mem %s (peak %s)  ETA %s   ",
                   std::string(static_cast<size_t>(filled), '#').c_str(), std::string(static_cast<size_t>(width - filled), '.').c_str(),
                   static_cast<long long>(done), static_cast<long long>(r.steps), loss_value, rate,
                   io::human_bytes(tracker->live_bytes()).c_str(), io::human_bytes(tracker->peak_bytes()).c_str(),
                   format_duration(eta).c_str());
      if (done == r.steps) std::fprintf(stderr, "\n");
    } else if (done % r.log_interval == 0 || done == r.steps) {
      const double since = std::chrono::duration<double>(Clock::now() - t_log).count();
      char line[256];
      std::snprintf(line, sizeof(line), "step %lld/%lld  loss %.4f  lr %.3g  %.0f tok/s  mem %s (peak %s)  ETA %s",
                    static_cast<long long>(done), static_cast<long long>(r.steps), loss_value, opt.lr(),
                    static_cast<double>(tokens_since_log) / std::max(since, 1e-9), io::human_bytes(tracker->live_bytes()).c_str(),
                    io::human_bytes(tracker->peak_bytes()).c_str(), format_duration(eta).c_str());
      log(line);
      t_log = Clock::now();
      tokens_since_log = 0;
    }
    if (r.eval_interval > 0 && done % r.eval_interval == 0 && done != r.steps) {
      const double v = evaluate();
      std::fprintf(metrics, "{\"step\": %lld, \"val_loss\": %.6f}\n", static_cast<long long>(done), v);
      std::fflush(metrics);
      char line[96];
      std::snprintf(line, sizeof(line), "step %lld  validation loss %.4f", static_cast<long long>(done), v);
      if (options.progress_bar()) std::fprintf(stderr, "\n");
      log(line);
    }
    if ((r.checkpoint_interval > 0 && done % r.checkpoint_interval == 0) || done == stop) checkpoint_now(done, loss_value);
  }
  result.last_step = std::max(start, stop);
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
  result.tokens_per_s = static_cast<double>((result.last_step - start) * r.batch_size * r.seq_len) / std::max(elapsed, 1e-9);
  result.peak = memory::peak_over_steps(tracker->step_summaries(), start);  // every step this run took
  result.val_loss = evaluate();
  std::fprintf(metrics, "{\"step\": %lld, \"val_loss\": %.6f}\n", static_cast<long long>(result.last_step), result.val_loss);
  std::fclose(metrics);
  if (options.sample() && r.sample_tokens > 0) {
    result.sample = generate_text(*model, tok, r.sample_prompt, r.sample_tokens, 0.8, 40, static_cast<uint64_t>(r.seed));
  }
  return result;
}

}  // namespace train
}  // namespace frugal
