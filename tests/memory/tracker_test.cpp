// The allocation tracker: exact balance over training steps, categories from scopes, the one
// category rule applied alike to counters, peaks, summaries and the trace, and allocations on
// other threads.
#include <ATen/ThreadLocalState.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <optional>
#include <sstream>
#include <thread>

#include "frugal/checkpoint/policy.h"
#include "frugal/memory/trace.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"
#include "frugal/models/transformer_block.h"

using namespace frugal;
using memory::Category;
using memory::Phase;

namespace {

int64_t cat(const memory::Tracker& t, Category c) { return t.live_by_category()[static_cast<int>(c)]; }

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

struct TinyModel {
  std::vector<models::PreLNBlock> blocks;
  std::vector<checkpoint::ChainBlock> chain;
  std::vector<at::Tensor> params;
  explicit TinyModel(int layers) {
    for (int i = 0; i < layers; ++i) blocks.emplace_back(32, 4);
    chain = checkpoint::make_chain(blocks);
    for (auto& b : blocks) {
      for (auto& p : b->parameters()) params.push_back(p);
    }
  }
};

void train_step(TinyModel& m, torch::optim::Optimizer& opt, const at::Tensor& x, const checkpoint::CheckpointPolicy& policy) {
  at::Tensor loss;
  {
    memory::PhaseScope fw(Phase::forward);
    loss = checkpoint::run_chain(m.chain, x, policy).pow(2).mean();
  }
  {
    memory::PhaseScope bw(Phase::backward);
    loss.backward();
  }
  {
    memory::PhaseScope op(Phase::optimizer);
    opt.step();
  }
  for (auto& p : m.params) p.mutable_grad().reset();
}

}  // namespace

TEST(Tracker, NoTrackerMeansScopesAreNoOps) {
  EXPECT_EQ(memory::current_tracker(), nullptr);
  memory::CategoryScope scope(Category::activation);
  memory::PhaseScope phase(Phase::forward);
  at::Tensor t = at::ones({10});
  EXPECT_EQ(memory::current_tracker(), nullptr);
}

TEST(Tracker, LiveBytesReturnExactlyToTheirValueAfterATrainingStep) {
  for (const char* policy_name : {"none", "full", "selective"}) {
    SCOPED_TRACE(policy_name);
    auto tracker = memory::Tracker::create();
    memory::TrackingGuard on(tracker);
    TinyModel m(3);
    at::Tensor x = at::randn({4, 16, 32});
    torch::optim::AdamW opt(m.params, torch::optim::AdamWOptions(1e-3));
    const auto policy = checkpoint::CheckpointPolicy::parse(policy_name);
    train_step(m, opt, x, policy);  // creates the AdamW state
    const int64_t before = tracker->live_bytes();
    const auto before_by_category = tracker->live_by_category();
    for (int step = 0; step < 2; ++step) {
      memory::mark_step(step);
      train_step(m, opt, x, policy);
      EXPECT_EQ(tracker->live_bytes(), before);
      EXPECT_EQ(tracker->live_by_category(), before_by_category);
    }
    EXPECT_EQ(tracker->untracked_frees(), 0);
    EXPECT_GT(tracker->peak_bytes(), before);
  }
}

TEST(Tracker, CategoriesComeFromScopesAndPhases) {
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  std::unique_ptr<TinyModel> m;
  {
    memory::CategoryScope scope(Category::parameter);
    m = std::make_unique<TinyModel>(2);
  }
  int64_t param_bytes = 0;
  for (auto& p : m->params) param_bytes += bytes_of(p);
  EXPECT_EQ(cat(*tracker, Category::parameter), param_bytes);  // init temporaries were reclassified

  at::Tensor x;
  {
    memory::CategoryScope scope(Category::input);
    x = at::randn({2, 8, 32});
  }
  EXPECT_EQ(cat(*tracker, Category::input), bytes_of(x));

  torch::optim::AdamW opt(m->params, torch::optim::AdamWOptions(1e-3));
  at::Tensor loss;
  {
    memory::PhaseScope fw(Phase::forward);
    loss = checkpoint::run_chain(m->chain, x, checkpoint::CheckpointPolicy::none()).pow(2).mean();
  }
  EXPECT_GT(cat(*tracker, Category::activation), 0);
  {
    memory::PhaseScope bw(Phase::backward);
    loss.backward();
  }
  loss.reset();
  EXPECT_EQ(cat(*tracker, Category::activation), 0);  // all freed by backward
  // What backward leaves is not a gradient until someone says so (frugal's optimizer tags .grad
  // as autograd accumulates it; torch::optim does not).
  EXPECT_EQ(cat(*tracker, Category::gradient), 0);
  EXPECT_EQ(cat(*tracker, Category::other), param_bytes);
  for (auto& p : m->params) memory::tag(p.grad(), Category::gradient);
  EXPECT_EQ(cat(*tracker, Category::gradient), param_bytes);
  {
    memory::PhaseScope op(Phase::optimizer);
    opt.step();
  }
  EXPECT_EQ(cat(*tracker, Category::optimizer_state), 2 * param_bytes);
  EXPECT_EQ(cat(*tracker, Category::temporary), 0);  // temporaries are never live outside their scope

  // Phase markers are in the timeline, in order.
  std::vector<std::pair<memory::Action, Phase>> marks;
  for (const auto& e : tracker->events()) {
    if (e.action == memory::Action::phase_begin || e.action == memory::Action::phase_end) marks.emplace_back(e.action, e.phase);
  }
  ASSERT_EQ(marks.size(), 6u);
  EXPECT_EQ(marks[0], std::make_pair(memory::Action::phase_begin, Phase::forward));
  EXPECT_EQ(marks[3], std::make_pair(memory::Action::phase_end, Phase::backward));
  EXPECT_EQ(marks[5], std::make_pair(memory::Action::phase_end, Phase::optimizer));
}

TEST(Tracker, FreedInsideItsScopeIsTemporaryInTheTimelineToo) {
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  at::Tensor kept;
  {
    memory::CategoryScope scope(Category::activation);
    kept = at::empty({100});
    at::Tensor scratch = at::empty({300});
  }
  EXPECT_EQ(cat(*tracker, Category::activation), 400);
  const auto report = tracker->peak_report();
  EXPECT_EQ(report.peak_bytes, 1600);
  EXPECT_EQ(report.breakdown[static_cast<int>(Category::activation)], 400);
  EXPECT_EQ(report.breakdown[static_cast<int>(Category::temporary)], 1200);
  int temporaries = 0;
  for (const auto& e : tracker->events()) {
    if (e.bytes == 1200) {
      EXPECT_EQ(e.category, Category::temporary);
      ++temporaries;
    }
  }
  EXPECT_EQ(temporaries, 2);  // its alloc and its free
  // Freed after its scope closed: keeps its category.
  kept.reset();
  const auto events = tracker->events();
  EXPECT_EQ(events.back().action, memory::Action::free);
  EXPECT_EQ(events.back().category, Category::activation);
}

TEST(Tracker, PeakReportAndReset) {
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  at::Tensor a = at::empty({1000});  // 4000 B
  at::Tensor b = at::empty({500});   // 2000 B
  a.reset();
  EXPECT_EQ(tracker->live_bytes(), 2000);
  EXPECT_EQ(tracker->peak_bytes(), 6000);
  EXPECT_EQ(tracker->peak_report().peak_bytes, 6000);
  EXPECT_EQ(memory::max_by_category(tracker->events())[static_cast<int>(Category::other)], 6000);
  tracker->reset_peak();
  EXPECT_EQ(tracker->peak_bytes(), 2000);
  at::Tensor c = at::empty({250});
  EXPECT_EQ(tracker->peak_bytes(), 3000);
  EXPECT_EQ(tracker->peak_report().peak_bytes, 3000);
  EXPECT_EQ(tracker->live_bytes(c10::Device(c10::kCPU)), 3000);
}

TEST(Tracker, ThreadsThatInheritTheStateReportToTheOpenScope) {
  // Autograd's worker threads and at::launch copy the caller's thread-local state like this.
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  at::Tensor made_elsewhere;
  {
    memory::CategoryScope scope(Category::optimizer_state);
    at::ThreadLocalState state;
    std::thread worker([&] {
      at::ThreadLocalStateGuard guard(state);
      made_elsewhere = at::empty({64});
      at::Tensor scratch = at::empty({32});
    });
    worker.join();
  }
  EXPECT_EQ(cat(*tracker, Category::optimizer_state), 256);
  EXPECT_EQ(tracker->live_bytes(), 256);
  made_elsewhere.reset();
  EXPECT_EQ(tracker->live_bytes(), 0);
}

TEST(Tracker, TraceFileHoldsEveryEventAndStep) {
  auto tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(tracker);
    memory::mark_step(0);
    memory::PhaseScope fw(Phase::forward);
    at::Tensor t = at::empty({8});
  }
  std::ostringstream out;
  tracker->write_timeline_json(out);
  const memory::Trace t = memory::read_trace(out.str());
  ASSERT_EQ(t.events.size(), tracker->events().size());
  std::vector<memory::Action> actions;
  for (const auto& e : t.events) actions.push_back(e.action);
  const std::vector<memory::Action> expected = {memory::Action::step, memory::Action::phase_begin, memory::Action::alloc,
                                                memory::Action::free, memory::Action::phase_end};
  EXPECT_EQ(actions, expected);
  EXPECT_EQ(t.events[2].category, Category::temporary);  // freed inside forward
  EXPECT_EQ(t.events[2].phase, Phase::forward);
  EXPECT_EQ(t.events[2].device, c10::Device(c10::kCPU));
  EXPECT_EQ(t.events[2].bytes, 32);
  ASSERT_EQ(t.steps.size(), 1u);
  EXPECT_EQ(t.steps[0].peak_bytes, 32);
  EXPECT_EQ(t.steps[0].breakdown[static_cast<int>(Category::temporary)], 32);
}

TEST(Tracker, BoundedCaptureKeepsChosenStepsAndSummarisesEveryStep) {
  auto tracker = memory::Tracker::create();
  tracker->set_capture_steps({1});
  memory::TrackingGuard on(tracker);
  at::Tensor kept;
  for (int step = 0; step < 4; ++step) {
    memory::mark_step(step);
    at::Tensor a = at::empty({100 * (step + 1)});  // step s peaks at 400 * (s + 1) bytes above the kept one
    if (step == 1) kept = at::empty({10});
  }
  kept.reset();  // freed in step 3: its alloc was captured, so its free is too
  for (const auto& e : tracker->events()) EXPECT_EQ(e.step, e.action == memory::Action::free && e.bytes == 40 ? 3 : 1);
  int allocs = 0;
  for (const auto& e : tracker->events()) allocs += e.action == memory::Action::alloc;
  EXPECT_EQ(allocs, 2);
  const auto steps = tracker->step_summaries();
  ASSERT_EQ(steps.size(), 4u);
  EXPECT_EQ(steps[0].peak_bytes, 400);
  EXPECT_EQ(steps[2].peak_bytes, 40 + 1200);
  EXPECT_EQ(steps[3].peak_bytes, 40 + 1600);
  std::ostringstream json;
  tracker->write_timeline_json(json);
  const memory::Trace t = memory::read_trace(json.str());
  ASSERT_EQ(t.steps.size(), 4u);
  EXPECT_EQ(t.steps[3].peak_bytes, 1640);
}

namespace {

// A few training steps of a small model with frugal's optimizer, under `tracker`.
void run_steps(const std::shared_ptr<memory::Tracker>& tracker, optim::Mode mode, const char* policy_name, int steps) {
  torch::manual_seed(3);
  memory::TrackingGuard on(tracker);
  std::unique_ptr<TinyModel> m;
  {
    memory::CategoryScope scope(Category::parameter);
    m = std::make_unique<TinyModel>(3);
  }
  torch::OrderedDict<std::string, at::Tensor> named;
  for (size_t i = 0; i < m->params.size(); ++i) named.insert(std::string("p").append(std::to_string(i)), m->params[i]);
  optim::Optimizer opt(named, optim::OptimizerOptions().lr(1e-3).mode(mode));
  const auto policy = checkpoint::CheckpointPolicy::parse(policy_name);
  for (int step = 0; step < steps; ++step) {
    memory::mark_step(step);
    at::Tensor x;
    {
      memory::CategoryScope in(Category::input);
      x = at::randn({4, 16, 32});
    }
    at::Tensor loss;
    {
      memory::PhaseScope fw(Phase::forward);
      loss = checkpoint::run_chain(m->chain, x, policy).pow(2).mean();
    }
    {
      memory::PhaseScope bw(Phase::backward);
      opt.backward(loss);
    }
    loss.reset();
    {
      memory::PhaseScope op(Phase::optimizer);
      opt.step();
    }
    opt.zero_grad();
  }
}

std::string describe(const memory::CategoryBytes& b) {
  std::string out;
  for (auto c : memory::kAllCategories) out += std::string(memory::category_name(c)) + "=" + std::to_string(b[static_cast<int>(c)]) + " ";
  return out;
}

}  // namespace

TEST(Tracker, CountersOnlyAndFullEventsGiveIdenticalNumbers) {
  for (const auto mode : {optim::Mode::standard, optim::Mode::in_backward}) {
    for (const char* policy : {"none", "full", "selective"}) {
      SCOPED_TRACE(std::string(policy) + (mode == optim::Mode::standard ? " standard" : " in_backward"));
      auto with_events = memory::Tracker::create(true), counters = memory::Tracker::create(false);
      run_steps(with_events, mode, policy, 3);
      run_steps(counters, mode, policy, 3);
      const auto a = with_events->peak_report(), b = counters->peak_report();
      EXPECT_EQ(a.peak_bytes, b.peak_bytes);
      EXPECT_EQ(a.breakdown, b.breakdown) << describe(a.breakdown) << "vs " << describe(b.breakdown);
      EXPECT_EQ(a.peak_step, b.peak_step);
      const auto sa = with_events->step_summaries(), sb = counters->step_summaries();
      ASSERT_EQ(sa.size(), 3u);
      ASSERT_EQ(sb.size(), 3u);
      for (size_t i = 0; i < sa.size(); ++i) {
        EXPECT_EQ(sa[i].peak_bytes, sb[i].peak_bytes);
        EXPECT_EQ(sa[i].breakdown, sb[i].breakdown) << "step " << i;
        EXPECT_EQ(sa[i].phase, sb[i].phase);
      }
      // The replay of the trace gives the tracker's peak and every step's summary back.
      const memory::Trace trace = with_events->trace();
      const auto samples = memory::replay_live_bytes(trace.events);
      const memory::LiveSample peak = memory::peak_sample(samples);
      EXPECT_EQ(peak.total(), a.peak_bytes);
      EXPECT_EQ(peak.bytes, a.breakdown);
      auto replayed = memory::step_peaks(samples);
      ASSERT_EQ(replayed.front().step, -1);  // building the model
      replayed.erase(replayed.begin());
      ASSERT_EQ(replayed.size(), sa.size());
      for (size_t i = 0; i < sa.size(); ++i) {
        EXPECT_EQ(replayed[i].peak_bytes, sa[i].peak_bytes);
        EXPECT_EQ(replayed[i].breakdown, sa[i].breakdown)
            << "step " << i << ": " << describe(replayed[i].breakdown) << "vs " << describe(sa[i].breakdown);
      }
      // Nothing made and freed inside forward or backward hides under another name at the peak.
      EXPECT_GT(a.breakdown[static_cast<int>(Category::temporary)] + a.breakdown[static_cast<int>(Category::activation)], 0);
    }
  }
}

TEST(Tracker, GradientIsOnlyParametersGradients) {
  // In-backward mode holds at most one backward node's gradients at once: a Linear's weight and
  // bias come out of one node (a gradient counts from its allocation, before it is accumulated).
  int64_t param_bytes = 0, largest_node = 0;
  {
    TinyModel m(3);
    for (auto& p : m.params) param_bytes += bytes_of(p);
    for (auto& b : m.blocks) {
      for (const auto& child : b->children()) {
        int64_t own = 0;
        for (const auto& p : child->parameters(/*recurse=*/false)) own += bytes_of(p);
        largest_node = std::max(largest_node, own);
      }
    }
  }
  for (const auto mode : {optim::Mode::standard, optim::Mode::in_backward}) {
    SCOPED_TRACE(mode == optim::Mode::standard ? "standard" : "in_backward");
    auto tracker = memory::Tracker::create();
    run_steps(tracker, mode, "none", 2);
    const int64_t max_grad = memory::max_by_category(tracker->events())[static_cast<int>(Category::gradient)];
    if (mode == optim::Mode::standard) {
      EXPECT_EQ(max_grad, param_bytes);  // every .grad at once before the step, nothing else
    } else {
      EXPECT_GT(max_grad, 0);
      EXPECT_LE(max_grad, largest_node);  // freed by its update as soon as it is complete
    }
    // The logits' and intermediate gradients of backward are temporaries.
    EXPECT_GT(tracker->peak_report().breakdown[static_cast<int>(Category::temporary)] +
                  memory::max_by_category(tracker->events())[static_cast<int>(Category::temporary)],
              0);
  }
}

TEST(Tracker, ARecordedPeakLearnsThatItsBuffersWereTemporaries) {
  auto tracker = memory::Tracker::create(/*keep_events=*/false);
  memory::TrackingGuard on(tracker);
  memory::mark_step(0);
  at::Tensor kept;
  {
    memory::PhaseScope fw(Phase::forward);
    kept = at::empty({100});                                                               // 400 B, survives forward: activation
    at::Tensor scratch = at::empty({1000});                                                // 4000 B, the peak, freed inside forward
    EXPECT_EQ(tracker->live_by_category()[static_cast<int>(Category::activation)], 4400);  // not known yet
  }
  const auto peak = tracker->peak_report();
  EXPECT_EQ(peak.peak_bytes, 4400);
  EXPECT_EQ(peak.breakdown[static_cast<int>(Category::activation)], 400);
  EXPECT_EQ(peak.breakdown[static_cast<int>(Category::temporary)], 4000);
  EXPECT_EQ(tracker->step_summaries().back().breakdown, peak.breakdown);
  // A tag after the fact applies from the allocation on, to the recorded moments too.
  memory::tag(kept, Category::gradient);
  EXPECT_EQ(tracker->peak_report().breakdown[static_cast<int>(Category::gradient)], 400);
  EXPECT_EQ(tracker->peak_report().breakdown[static_cast<int>(Category::activation)], 0);
  // The limit report is one of those moments.
  tracker->set_limit(100);
  {
    memory::PhaseScope bw(Phase::backward);
    at::Tensor intermediate = at::empty({50});
    EXPECT_EQ(tracker->limit_report().by_category[static_cast<int>(Category::other)], 200);
  }
  const auto limit = tracker->limit_report();
  ASSERT_TRUE(limit.exceeded);
  EXPECT_EQ(limit.by_category[static_cast<int>(Category::temporary)], 200);
  EXPECT_EQ(limit.by_category[static_cast<int>(Category::other)], 0);
  EXPECT_EQ(limit.live_bytes, 600);
}

TEST(Tracker, TraceRoundTripsThroughItsFile) {
  auto tracker = memory::Tracker::create();
  run_steps(tracker, optim::Mode::in_backward, "full", 2);
  const memory::Trace written = tracker->trace();
  std::ostringstream out;
  memory::write_trace(out, written);
  const memory::Trace read = memory::read_trace(out.str());
  ASSERT_EQ(read.events.size(), written.events.size());
  for (size_t i = 0; i < read.events.size(); ++i) {
    const auto &a = read.events[i], &b = written.events[i];
    ASSERT_TRUE(a.time_us == b.time_us && a.action == b.action && a.bytes == b.bytes && a.category == b.category && a.phase == b.phase &&
                a.device == b.device && a.addr == b.addr && a.step == b.step)
        << "event " << i;
  }
  ASSERT_EQ(read.steps.size(), written.steps.size());
  for (size_t i = 0; i < read.steps.size(); ++i) {
    EXPECT_EQ(read.steps[i].step, written.steps[i].step);
    EXPECT_EQ(read.steps[i].peak_bytes, written.steps[i].peak_bytes);
    EXPECT_EQ(read.steps[i].time_us, written.steps[i].time_us);
    EXPECT_EQ(read.steps[i].phase, written.steps[i].phase);
    EXPECT_EQ(read.steps[i].breakdown, written.steps[i].breakdown);
  }
  // Hostile or foreign files are refused with a reason.
  EXPECT_THROW(memory::read_trace(R"({"format": "something-else", "version": 1, "events": []})"), std::invalid_argument);
  EXPECT_THROW(memory::read_trace(R"({"format": "frugal-trace", "version": 99, "events": []})"), std::invalid_argument);
  const std::string huge =
      R"({"time_us": 0, "action": "alloc", "bytes": 9223372036854775807, "category": "other", "phase": "idle", "device": "cpu", "step": 0})";
  EXPECT_THROW(memory::read_trace("{\"events\": [" + huge + ", " + huge + "]}"), std::invalid_argument);
}

TEST(Tracker, BoundedCaptureRecordsWhatIsLiveWhenACapturedStepBegins) {
  auto tracker = memory::Tracker::create();
  tracker->set_capture_steps({2});
  memory::TrackingGuard on(tracker);
  at::Tensor early;
  for (int step = 0; step < 4; ++step) {
    memory::mark_step(step);
    if (step == 0) early = at::empty({250});  // 1000 B, made before capture
    at::Tensor a = at::empty({100 * (step + 1)});
  }
  const memory::Trace t = tracker->trace();
  const auto samples = memory::replay_live_bytes(t.events);
  const auto replayed = memory::step_peaks(samples);
  ASSERT_FALSE(replayed.empty());
  EXPECT_EQ(replayed.front().step, 2);
  EXPECT_EQ(replayed.front().peak_bytes, t.steps[2].peak_bytes);  // 1000 + 1200: the chart agrees with the table
  EXPECT_EQ(t.steps[2].peak_bytes, 2200);
}

// A model built before tracking (the LibTorch habit) is adopted by watch(): its parameters and
// buffers are parameter from then on, and its gradients are gradient even when torch::optim and
// loss.backward() make them; adopted memory leaves the counts once its storage is gone.
TEST(Tracker, WatchAdoptsAModelBuiltBeforeTrackingAndItsGradients) {
  auto net = torch::nn::Sequential(torch::nn::Linear(64, 256), torch::nn::BatchNorm1d(256), torch::nn::ReLU(), torch::nn::Linear(256, 8));
  int64_t param_bytes = 0, buffer_bytes = 0;
  for (const auto& p : net->parameters()) param_bytes += bytes_of(p);
  for (const auto& b : net->buffers()) buffer_bytes += bytes_of(b);
  ASSERT_GT(buffer_bytes, 0);
  auto tracker = memory::Tracker::create();
  tracker->watch(*net);
  EXPECT_EQ(cat(*tracker, Category::parameter), param_bytes + buffer_bytes);
  EXPECT_TRUE(tracker->implicit_rules());
  {
    memory::TrackingGuard on(tracker);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-3));
    for (int step = 0; step < 2; ++step) {
      opt.zero_grad();
      net->forward(at::randn({32, 64})).pow(2).mean().backward();
      EXPECT_EQ(cat(*tracker, Category::gradient), param_bytes) << "step " << step;
      opt.step();
    }
    EXPECT_EQ(cat(*tracker, Category::parameter), param_bytes + buffer_bytes);  // BatchNorm updated its buffers in place
  }
  // Memory adopted from before tracking is seen leaving when it is freed while tracking.
  at::Tensor extra = at::ones({1000});
  tracker->watch({}, {extra});
  EXPECT_EQ(cat(*tracker, Category::parameter), param_bytes + buffer_bytes + 4000);
  {
    memory::TrackingGuard on(tracker);
    extra.reset();                            // c10 reports no free of memory allocated before reporting began...
    memory::PhaseScope next(Phase::forward);  // ...so the tracker sees the storage gone at the next mark
  }
  EXPECT_EQ(cat(*tracker, Category::parameter), param_bytes + buffer_bytes);
  EXPECT_EQ(tracker->untracked_frees(), 0);
}

// With frugal's optimizer and no scopes, backward and the optimizer are marked for the program,
// steps are marked after each update, and what the program's forward kept for backward is
// activation: the same bytes as the loop with the trainer's scopes, category by category.
TEST(Tracker, PlainLoopWithFrugalsOptimizerGetsTheScopedLoopsBreakdown) {
  auto run = [](bool scopes) {
    torch::manual_seed(0);
    auto tracker = memory::Tracker::create();
    std::optional<TinyModel> m;
    std::optional<memory::TrackingGuard> on;
    if (scopes) {
      on.emplace(tracker);
      memory::CategoryScope params(Category::parameter);
      m.emplace(3);
    } else {
      m.emplace(3);
      std::vector<at::Tensor> ps = m->params;
      tracker->watch(ps);
      on.emplace(tracker);
    }
    std::vector<std::string> names;
    for (size_t i = 0; i < m->params.size(); ++i) names.push_back(std::to_string(i));
    optim::Optimizer opt({optim::ParamGroup(names, m->params)}, optim::AdamWOptions(1e-3));
    for (int step = 0; step < 4; ++step) {
      if (scopes) memory::mark_step(step);
      at::Tensor x;
      {
        std::optional<memory::CategoryScope> input;
        if (scopes) input.emplace(Category::input);
        x = at::randn({4, 16, 32});
      }
      at::Tensor loss;
      {
        std::optional<memory::PhaseScope> fw;
        if (scopes) fw.emplace(Phase::forward);
        loss = checkpoint::run_chain(m->chain, x, checkpoint::CheckpointPolicy::none()).pow(2).mean();
      }
      opt.backward(loss);
      opt.step();
      opt.zero_grad();
    }
    if (!scopes) {
      EXPECT_EQ(tracker->current_step(), 4);
    }
    return tracker->report();
  };
  const memory::MemoryReport scoped = run(true), plain = run(false);
  std::ostringstream a, b;
  a << scoped;
  b << plain;
  SCOPED_TRACE("scoped: " + a.str() + "\nplain:  " + b.str());
  EXPECT_EQ(plain.peak_phase, Phase::backward);
  EXPECT_EQ(plain.peak_phase, scoped.peak_phase);
  EXPECT_EQ(plain.parameter, scoped.parameter);
  EXPECT_EQ(plain.gradient, scoped.gradient);
  EXPECT_EQ(plain.optimizer_state, scoped.optimizer_state);
  EXPECT_EQ(plain.parameter, plain.at_peak(Category::parameter));
  // The scoped loop's activation also holds the loss scalar (kept past backward), and its input
  // is the plain loop's other.
  EXPECT_NEAR(static_cast<double>(plain.activation), static_cast<double>(scoped.activation), 256.0);
  EXPECT_EQ(plain.other + plain.activation, scoped.input + scoped.activation + scoped.other);
  EXPECT_GT(plain.activation, 0);
  EXPECT_EQ(plain.peak_bytes, scoped.peak_bytes);
}

// The program that marks its own steps keeps its numbering: the optimizer marks none.
TEST(Tracker, ExplicitStepsWinOverTheOptimizers) {
  TinyModel m(1);
  auto tracker = memory::Tracker::create();
  tracker->watch(m.params);
  memory::TrackingGuard on(tracker);
  std::vector<std::string> names;
  for (size_t i = 0; i < m.params.size(); ++i) names.push_back(std::to_string(i));
  optim::Optimizer opt({optim::ParamGroup(names, m.params)}, optim::AdamWOptions(1e-3));
  for (int step = 0; step < 3; ++step) {
    memory::mark_step(100 + step);
    opt.backward(checkpoint::run_chain(m.chain, at::randn({2, 8, 32}), checkpoint::CheckpointPolicy::none()).pow(2).mean());
    opt.step();
    opt.zero_grad();
  }
  EXPECT_EQ(tracker->current_step(), 102);
  const auto r = tracker->report(101);
  EXPECT_EQ(r.first_step, 101);
  EXPECT_EQ(r.last_step, 102);
}
