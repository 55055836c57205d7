// The allocation tracker: exact balance over training steps, categories from scopes, the
// "freed inside its scope = temporary" rule, peaks, and allocations on other threads.
#include <ATen/ThreadLocalState.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adamw.h>

#include <sstream>
#include <thread>

#include "frugal/checkpoint/policy.h"
#include "frugal/memory/tracker.h"
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

void train_step(TinyModel& m, torch::optim::Optimizer& opt, const at::Tensor& x,
                const checkpoint::CheckpointPolicy& policy) {
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
  EXPECT_EQ(tracker->peak_report().max_by_category[static_cast<int>(Category::other)], 6000);
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

TEST(Tracker, TimelineJsonHasOneRecordPerEvent) {
  auto tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(tracker);
    memory::mark_step(0);
    memory::PhaseScope fw(Phase::forward);
    at::Tensor t = at::empty({8});
  }
  std::ostringstream out;
  tracker->write_timeline_json(out);
  const std::string json = out.str();
  EXPECT_NE(json.find("\"action\": \"alloc\""), std::string::npos);
  EXPECT_NE(json.find("\"action\": \"free\""), std::string::npos);
  EXPECT_NE(json.find("\"category\": \"temporary\""), std::string::npos);
  EXPECT_NE(json.find("\"phase\": \"forward\""), std::string::npos);
  EXPECT_NE(json.find("\"device\": \"cpu\""), std::string::npos);
  EXPECT_NE(json.find("\"action\": \"step\""), std::string::npos);
  size_t records = 0;
  for (size_t pos = json.find("\"time_us\""); pos != std::string::npos; pos = json.find("\"time_us\"", pos + 1)) ++records;
  EXPECT_EQ(records, tracker->events().size());
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
  EXPECT_NE(json.str().find("\"peak_bytes\": 1640"), std::string::npos);
}
