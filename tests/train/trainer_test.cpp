// The training job on the tiny recipe: the loss falls, a stopped and resumed run follows exactly
// the uninterrupted trajectory (in either optimizer mode), the memory estimate is within 10% of
// the measured peak, and generation runs.
#include <gtest/gtest.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frugal/models/hf_checkpoint.h"
#include "frugal/train/run_state.h"
#include "frugal/train/trainer.h"

using namespace frugal;

namespace {

// The tiny recipe with its files in a shared temporary folder (the tokenizer is made once).
train::Recipe tiny(const std::string& run, std::vector<std::string> overrides = {}) {
  const std::string base = ::testing::TempDir() + "/frugal_train";
  ::mkdir(base.c_str(), 0755);
  overrides.insert(overrides.begin(), {"data.tokenizer=" + base + "/tok.model", "data.tokens=" + base + "/f.tokens",
                                       "train.out_dir=" + base + "/" + run, "model.vocab_size=512", "train.sample_tokens=8",
                                       "train.log_interval=100"});
  return train::load_recipe(std::string(FRUGAL_SOURCE_DIR) + "/recipes/tiny.yaml", overrides);
}

void quiet(const std::string&) {}

// How many of this process's open file descriptors refer to path.
int open_descriptors_of(const std::string& path) {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return -1;
  while (const dirent* e = ::readdir(dir)) {
    char target[4096];
    const std::string link = std::string("/proc/self/fd/") + e->d_name;
    const ssize_t len = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (len > 0 && std::string(target, static_cast<size_t>(len)) == path) ++n;
  }
  ::closedir(dir);
  return n;
}

}  // namespace

TEST(Trainer, LossFallsAndGenerationRuns) {
  const auto r = train::run_training(tiny("falls"), train::TrainOptions(), quiet);
  ASSERT_EQ(r.losses.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) {
    first += r.losses[i] / 5;
    last += r.losses[35 + i] / 5;
  }
  EXPECT_LT(last, first - 0.5) << "first " << first << " last " << last;
  EXPECT_GT(r.val_loss, 0);
  EXPECT_EQ(r.sample.rfind("A fool", 0), 0u);
  EXPECT_FALSE(r.checkpoint.empty());
}

TEST(Trainer, StoppedAndResumedRunFollowsTheSameTrajectory) {
  for (const char* in_backward : {"false", "true"}) {
    SCOPED_TRACE(std::string("in_backward=") + in_backward);
    const std::vector<std::string> o = {std::string("optimizer.in_backward=") + in_backward, "train.steps=16",
                                        "train.checkpoint_interval=4", "memory.checkpointing=full", "memory.chunked_loss=true"};
    const auto straight = train::run_training(tiny(std::string("straight") + in_backward, o), train::TrainOptions().sample(false), quiet);
    const auto recipe = tiny(std::string("resumed") + in_backward, o);
    const auto part1 = train::run_training(recipe, train::TrainOptions().sample(false).stop_after(6), quiet);
    ASSERT_EQ(part1.losses.size(), 6u);
    // The latest checkpoint is step 6 (the stop), written atomically.
    EXPECT_EQ(train::read_trainer_state(train::latest_checkpoint(recipe.out_dir)).step, 6);
    const auto part2 = train::run_training(recipe, train::TrainOptions().sample(false).resume(true), quiet);
    EXPECT_EQ(part2.first_step, 6);
    ASSERT_EQ(part2.losses.size(), 10u);
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(part1.losses[i], straight.losses[i]) << "step " << i;
    for (size_t i = 0; i < 10; ++i) EXPECT_EQ(part2.losses[i], straight.losses[6 + i]) << "step " << 6 + i;
  }
}

TEST(Trainer, EstimateIsWithinTenPercentOfTheMeasuredPeak) {
  const std::vector<std::vector<std::string>> configs = {
      {"memory.checkpointing=none"},
      {"memory.checkpointing=full", "memory.chunked_loss=true"},
      {"memory.checkpointing=selective", "optimizer.in_backward=true"},
      {"memory.checkpointing=every_2", "optimizer.in_backward=true", "memory.chunked_loss=true", "memory.loss_chunk=64"},
      {"train.batch_size=16", "train.seq_len=64", "model.dim=128", "model.ffn_dim=344"},
  };
  for (auto o : configs) {
    std::string label;
    for (const auto& s : o) label += s + " ";
    SCOPED_TRACE(label);
    o.push_back("train.steps=3");
    o.push_back("train.checkpoint_interval=0");
    o.push_back("train.eval_interval=0");
    o.push_back("schedule.warmup_steps=1");
    const auto r = train::run_training(tiny("estimate", o), train::TrainOptions().sample(false).keep_events(true), quiet);
    const auto exact = r.tracker->peak_report();
    std::string breakdown;
    for (auto c : memory::kAllCategories) {
      breakdown += std::string(" ") + memory::category_name(c) + " " + std::to_string(r.estimate.by_category[static_cast<int>(c)]) +
                   "/" + std::to_string(exact.breakdown[static_cast<int>(c)]);
    }
    const double ratio = static_cast<double>(r.estimate.peak_bytes) / static_cast<double>(r.peak.peak_bytes);
    EXPECT_NEAR(ratio, 1.0, 0.10) << "estimated " << r.estimate.peak_bytes << " measured " << r.peak.peak_bytes
                                  << "; estimated/measured by category:" << breakdown;
    std::printf("[ estimate ] %-90s %.3f\n", label.c_str(), ratio);
    EXPECT_GE(r.estimate_plain.peak_bytes, r.estimate.peak_bytes);
  }
}

TEST(Trainer, CheckpointsHoldAWorkingModelAndTokenizer) {
  const auto recipe = tiny("ckpt", {"train.steps=4", "schedule.warmup_steps=1", "train.checkpoint_interval=2", "train.keep_checkpoints=1"});
  train::run_training(recipe, train::TrainOptions().sample(false), quiet);
  const std::string dir = train::latest_checkpoint(recipe.out_dir);
  ASSERT_EQ(dir, recipe.out_dir + "/step-00000004");
  struct stat st {};
  EXPECT_NE(::stat((recipe.out_dir + "/step-00000002").c_str(), &st), 0);  // pruned: keep 1
  auto model = models::make_decoder(models::read_hf_config(dir + "/config.json"));
  models::load_hf_weights(*model, dir);
  const auto tok = data::Tokenizer::load(dir + "/tokenizer.model");
  const std::string text = train::generate_text(*model, tok, "Hello", 5, 0.0, 0, 0);
  EXPECT_EQ(text.rfind("Hello", 0), 0u);
  EXPECT_THROW(train::run_training(tiny("bad", {"model.vocab_size=999"}), train::TrainOptions(), quiet), train::RecipeError);
}

TEST(Trainer, ReportsEveryStepThroughTheCallbackAndPrintsNothing) {
  const auto recipe = tiny("progress", {"train.steps=6", "train.log_interval=4", "schedule.warmup_steps=1",
                                        "train.checkpoint_interval=0", "train.eval_interval=0"});
  std::vector<train::StepProgress> seen;
  ::testing::internal::CaptureStderr();
  ::testing::internal::CaptureStdout();
  const auto r = train::run_training(
      recipe, train::TrainOptions().sample(false).on_progress([&](const train::StepProgress& p) { seen.push_back(p); }), quiet);
  EXPECT_EQ(::testing::internal::GetCapturedStdout(), "");
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  ASSERT_EQ(seen.size(), 6u);
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].step, static_cast<int64_t>(i) + 1);
    EXPECT_EQ(seen[i].total_steps, 6);
    EXPECT_EQ(seen[i].loss, r.losses[i]);
    EXPECT_GT(seen[i].tokens_per_s, 0);
    EXPECT_GT(seen[i].live_bytes, 0);
    EXPECT_GE(seen[i].peak_bytes, seen[i].live_bytes);
    EXPECT_EQ(seen[i].at_log_interval, i == 3 || i == 5) << i;
  }
}

TEST(Trainer, MetricsFileIsClosedWhenTheRunStopsOnAMemoryLimit) {
  const auto recipe = tiny("limit", {"train.steps=4", "schedule.warmup_steps=1"});
  EXPECT_THROW(train::run_training(recipe, train::TrainOptions().sample(false).memory_limit(1 << 20), quiet),
               train::MemoryLimitExceeded);
  const std::string metrics = recipe.out_dir + "/metrics.jsonl";
  struct stat st {};
  ASSERT_EQ(::stat(metrics.c_str(), &st), 0);
  EXPECT_EQ(open_descriptors_of(metrics), 0);
}
