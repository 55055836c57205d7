// Recipes: every key readable and overridable, unknown keys and bad values named, and the YAML a
// checkpoint stores reads back to the same recipe.
#include <gtest/gtest.h>

#include "frugal/train/recipe.h"

using namespace frugal::train;

namespace {

const char* kYaml = R"(
name: t
model:
  arch: llama
  vocab_size: 0
  dim: 32
  n_layers: 2
  n_heads: 4
  n_kv_heads: 2
  ffn_dim: 64
  max_seq_len: 64
data:
  corpus: /tmp/x
train:
  steps: 20
  seq_len: 16
  sample_prompt: "A: b"
optimizer:
  in_backward: true
  clip: global_norm_two_pass
memory:
  checkpointing: every_2
  activation_budget: 2MiB
)";

void expect_error(const std::string& yaml, const std::vector<std::string>& overrides, const std::string& needle) {
  try {
    parse_recipe(yaml, "r.yaml", overrides);
    FAIL() << "accepted; expected " << needle;
  } catch (const RecipeError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Recipe, ReadsEveryKindOfKeyAndOverrides) {
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"train.steps=30", "optimizer.lr=3e-4", "memory.chunked_loss=true"});
  EXPECT_EQ(r.model.dim, 32);
  EXPECT_EQ(r.model.n_kv_heads, 2);
  EXPECT_EQ(r.steps, 30);
  EXPECT_DOUBLE_EQ(r.lr, 3e-4);
  EXPECT_TRUE(r.in_backward);
  EXPECT_TRUE(r.chunked_loss);
  EXPECT_EQ(r.clip, "global_norm_two_pass");
  EXPECT_EQ(r.checkpointing, "every_2");
  EXPECT_EQ(r.activation_budget, 2 << 20);
  EXPECT_EQ(r.sample_prompt, "A: b");
}

TEST(Recipe, RoundTripsThroughYaml) {
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"train.sample_prompt=quote \"this\": yes"});
  const Recipe back = parse_recipe(recipe_to_yaml(r), "saved.yaml");
  EXPECT_EQ(recipe_to_yaml(back), recipe_to_yaml(r));
  EXPECT_EQ(back.sample_prompt, "quote \"this\": yes");
  const std::string yaml = recipe_to_yaml(r);
  for (const std::string& key : recipe_keys()) {
    EXPECT_NE(yaml.find(key.substr(key.find('.') + 1) + ":"), std::string::npos) << key;  // every key is stored
  }
}

TEST(Recipe, ErrorsNameTheKeyAndWhatIsAllowed) {
  expect_error(kYaml, {"train.stpes=3"}, "unknown key 'train.stpes'");
  expect_error(kYaml, {"train.steps=many"}, "train.steps must be an integer, got 'many'");
  expect_error(kYaml, {"train.steps=0"}, "train.steps must be an integer >= 1, got '0'");
  expect_error(kYaml, {"optimizer.algorithm=lion"}, "optimizer.algorithm must be one of sgd, adam, adamw, got 'lion'");
  expect_error(kYaml, {"memory.checkpointing=most"}, "memory.checkpointing must be one of none, full, every_K");
  expect_error(kYaml, {"optimizer.clip=global_norm"}, "cannot run inside backward in one pass");
  expect_error(kYaml, {"model.n_heads=5"}, "model: dim 32 must be divisible by n_heads 5");
  expect_error(kYaml, {"train.seq_len=100"}, "train.seq_len 100 exceeds model.max_seq_len 64");
  expect_error(kYaml, {"noequals"}, "must look like section.key=value");
  expect_error("model: [1, 2", {}, "not valid YAML");
  expect_error("model:\n  dims: 3\n", {}, "unknown key 'model.dims'");
  EXPECT_THROW(load_recipe("/nonexistent/recipe.yaml"), RecipeError);
}
