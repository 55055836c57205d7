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

using namespace frugal;

namespace {

void quiet(const std::string&) {}

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

train::Recipe recipe(const std::string& run, int n, std::vector<std::string> overrides = {}, const std::string& format = "prompt_completion") {
  overrides.insert(overrides.begin(),
                   {"data.tokenizer=" + tokenizer(), "data.format=" + format, "data.corpus=" + examples_file(n, format), "data.tokens=",
                    "train.out_dir=" + base_dir() + "/" + run, "model.vocab_size=512", "model.max_seq_len=128", "train.seq_len=128",
                    "train.sample_prompt=", "train.sample_tokens=0", "train.log_interval=100", "train.eval_batches=2", "train.batch_size=4",
                    "schedule.warmup_steps=1"});
  return train::load_recipe(std::string(FRUGAL_SOURCE_DIR) + "/recipes/tiny.yaml", overrides);
}

}  // namespace

TEST(ExamplesTraining, EpochsSetTheStepsAndTheLossOnAnswersFalls) {
  // 40 examples, 4 held out: 36 one a row in steps of 4 rows are 9 steps an epoch.
  const auto r = train::run_training(recipe("epochs", 40, {"train.epochs=6", "train.eval_interval=0"}, "alpaca"),
                                     train::TrainOptions().sample(false), quiet);
  EXPECT_EQ(r.examples.train_examples, 36);
  EXPECT_EQ(r.examples.val_examples, 4);
  EXPECT_EQ(r.examples.steps_per_epoch, 9);
  EXPECT_EQ(r.total_steps, 54);
  ASSERT_EQ(r.losses.size(), 54u);
  EXPECT_LT(r.losses.back(), 0.5 * r.losses.front()) << "first " << r.losses.front() << " last " << r.losses.back();
  EXPECT_GT(r.examples.padding_share, 0.0);
  EXPECT_LT(r.examples.label_tokens, r.examples.real_tokens);  // the prompts carry no loss
  EXPECT_TRUE(std::isfinite(r.val_loss));
  // Packed, the same examples take fewer steps an epoch and less padding.
  const auto packed = train::run_training(recipe("epochs-packed", 40, {"train.epochs=1", "train.eval_interval=0", "data.packing=true"}, "alpaca"),
                                          train::TrainOptions().sample(false), quiet);
  EXPECT_LT(packed.examples.steps_per_epoch, r.examples.steps_per_epoch);
  EXPECT_LT(packed.examples.padding_share, r.examples.padding_share);
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
    const auto straight = train::run_training(recipe(std::string("straight-") + packing, 30, o), train::TrainOptions().sample(false), quiet);
    const auto again = recipe(std::string("resumed-") + packing, 30, o);
    const int64_t per_epoch = straight.examples.steps_per_epoch;
    ASSERT_GE(per_epoch, 2);
    const int64_t stop = per_epoch + 1;  // inside the second epoch
    const auto part1 = train::run_training(again, train::TrainOptions().sample(false).stop_after(stop), quiet);
    const auto part2 = train::run_training(again, train::TrainOptions().sample(false).resume(true), quiet);
    ASSERT_EQ(part1.losses.size() + part2.losses.size(), straight.losses.size());
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
  const std::vector<std::string> o = {"train.batch_size=12", "train.steps=2", "train.checkpoint_interval=0", "train.eval_interval=0",
                                      "optimizer.in_backward=false", "memory.checkpointing=full", "memory.chunked_loss=true",
                                      "memory.loss_chunk=64"};
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
    EXPECT_NEAR(packed.losses[0], rows.losses[0], 1e-5 * rows.losses[0]);
    EXPECT_NEAR(packed.losses[1], rows.losses[1], 1e-4 * rows.losses[1]);  // after one identical update
    EXPECT_EQ(packed.examples.label_tokens, rows.examples.label_tokens);
  }
}
