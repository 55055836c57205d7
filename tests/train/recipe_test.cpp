// Recipes: every key readable and overridable, unknown keys and bad values named, and the YAML a
// checkpoint stores reads back to the same recipe.
#include <gtest/gtest.h>

#include <torch/version.h>

#include "frugal/precision/autocast.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/models/hf_checkpoint.h"
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
  EXPECT_DOUBLE_EQ(r.optimizer.lr(), 3e-4);
  EXPECT_EQ(r.optimizer.mode(), frugal::optim::Mode::in_backward);
  EXPECT_TRUE(r.loss.chunked());
  EXPECT_EQ(r.optimizer.clip(), frugal::optim::Clip::global_norm_two_pass);
  EXPECT_EQ(r.checkpointing.kind, frugal::checkpoint::PolicyKind::every_k);
  EXPECT_EQ(r.checkpointing.k, 2);
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
  expect_error(kYaml, {"train.steps=many"}, "train.steps must be an integer from 1 to 1099511627776, got 'many'");
  // Strictly: the whole value one decimal number, finite, in the key's range (io/numbers.h).
  for (const char* v : {"0x10", "+5", " 5", "5 ", "5.0", "1e3"}) {
    expect_error(kYaml, {std::string("train.steps=") + v},
                 "train.steps must be an integer from 1 to 1099511627776, got '" + std::string(v) + "'");
  }
  for (const char* v : {"inf", "nan", "1e300", "0x1p-3", "-0.1"}) {
    expect_error(kYaml, {std::string("optimizer.lr=") + v}, "optimizer.lr must be a number from 0 to 100, got '" + std::string(v) + "'");
  }
  expect_error(kYaml, {"train.steps=0"}, "train.steps must be an integer from 1 to 1099511627776, got '0'");
  expect_error(kYaml, {"optimizer.algorithm=lion"}, "override: optimizer.algorithm must be one of sgd, adam, adamw, got 'lion'");
  expect_error(kYaml, {"optimizer.clip=x"},
               "override: optimizer.clip must be one of none, global_norm, global_norm_two_pass, per_param_norm, got 'x'");
  expect_error(kYaml, {"optimizer.state_precision=fp8"}, "optimizer.state_precision must be one of fp32, bf16, int8, int4, got 'fp8'");
  expect_error(kYaml, {"optimizer.state_placement=disk"}, "optimizer.state_placement must be one of device, host, mmap, file, got 'disk'");
  expect_error(kYaml, {"schedule.kind=cos"}, "schedule.kind must be one of constant, linear_warmup, cosine, linear_decay, step, got 'cos'");
  expect_error(kYaml, {"model.dtype=fp16"}, "model.dtype must be one of fp32, bf16, got 'fp16'");
  expect_error(kYaml, {"train.device=tpu"}, "train.device must be cpu, cuda or cuda:N, got 'tpu'");
  expect_error(kYaml, {"train.device=cuda:x"}, "train.device must be cpu, cuda or cuda:N, got 'cuda:x'");
  expect_error(kYaml, {"memory.checkpointing=most"}, "memory.checkpointing must be one of none, full, every_K");
  expect_error(kYaml, {"optimizer.clip=global_norm"}, "cannot run inside backward");
  expect_error(kYaml, {"model.n_heads=5"}, "model: dim 32 must be divisible by n_heads 5 (model.n_heads=5 from the command line)");
  expect_error(kYaml, {"train.seq_len=100"}, "train.seq_len=100 (from the command line) exceeds model.max_seq_len 64");
  expect_error(kYaml, {"noequals"}, "must look like section.key=value");
  expect_error("model: [1, 2", {}, "not valid YAML");
  expect_error("model:\n  dims: 3\n", {}, "unknown key 'model.dims'");
  EXPECT_THROW(load_recipe("/nonexistent/recipe.yaml"), RecipeError);
}

TEST(Recipe, HoldsTheTypedOptionsTheLayersTake) {
  using namespace frugal;
  const Recipe defaults = parse_recipe("data:\n  corpus: /tmp/x\n", "r.yaml");
  EXPECT_EQ(defaults.dtype, at::kFloat);
  EXPECT_TRUE(defaults.device.is_cpu());
  EXPECT_EQ(defaults.optimizer.algorithm(), optim::Algorithm::adamw);
  EXPECT_DOUBLE_EQ(defaults.optimizer.weight_decay(), 0.1);
  EXPECT_DOUBLE_EQ(defaults.optimizer.beta2(), 0.95);
  EXPECT_EQ(defaults.optimizer.mode(), optim::Mode::standard);
  EXPECT_EQ(defaults.optimizer.clip(), optim::Clip::none);
  EXPECT_EQ(defaults.schedule.kind(), optim::ScheduleKind::cosine);
  EXPECT_EQ(defaults.schedule.total_steps(), defaults.steps);
  EXPECT_EQ(defaults.checkpointing.kind, checkpoint::PolicyKind::none);
  EXPECT_FALSE(defaults.loss.chunked());

  const Recipe r = parse_recipe(kYaml, "r.yaml",
                                {"model.dtype=bf16", "train.device=cuda:1", "optimizer.algorithm=sgd", "optimizer.momentum=0.5",
                                 "optimizer.state_precision=int4", "optimizer.state_placement=mmap", "optimizer.state_dir=/var/tmp",
                                 "schedule.kind=linear_decay", "schedule.warmup_steps=3", "memory.loss_chunk=77", "train.steps=50"});
  EXPECT_EQ(r.dtype, at::kBFloat16);
  EXPECT_EQ(r.device, c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(r.optimizer.algorithm(), optim::Algorithm::sgd);
  EXPECT_DOUBLE_EQ(r.optimizer.momentum(), 0.5);
  EXPECT_EQ(r.optimizer.state().precision(), optim::StatePrecision::int4);
  EXPECT_EQ(r.optimizer.state().placement(), optim::StatePlacement::mmap);
  EXPECT_EQ(r.optimizer.state().mmap_dir(), "/var/tmp");
  EXPECT_EQ(r.schedule.kind(), optim::ScheduleKind::linear_decay);
  EXPECT_EQ(r.schedule.warmup_steps(), 3);
  EXPECT_EQ(r.schedule.total_steps(), 50);
  EXPECT_EQ(r.loss.chunk_size(), 77);
  // Every typed value is written back as the text that parses to it.
  const Recipe back = parse_recipe(recipe_to_yaml(r), "saved.yaml");
  EXPECT_EQ(recipe_to_yaml(back), recipe_to_yaml(r));
  EXPECT_EQ(back.device, r.device);
  EXPECT_EQ(back.optimizer.state().precision(), optim::StatePrecision::int4);
  EXPECT_EQ(back.checkpointing.name(), "every_2");
}

// Aliases are shared nodes in yaml-cpp: a self-referring one makes a cycle and nested ones expand
// exponentially. Both, and their relatives, are refused before anything walks the tree.
TEST(Recipe, RefusesYamlThatExpandsWithoutBound) {
  expect_error("a: &x\n  b: *x\n", {}, "r.yaml: an alias refers to the node that contains it");
  expect_error("model: &m\n  dim: 3\n  sub: [1, *m]\n", {}, "an alias refers to the node that contains it");
  expect_error("a: &x [*x]\n", {}, "an alias refers to the node that contains it");
  // "Billion laughs": 9 levels of 9 aliases each, under a kilobyte of text, 9^9 values walked.
  std::string laughs = "l0: &l0 [x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 9; ++i) {
    const std::string n = std::to_string(i);
    laughs.append("l").append(n).append(": &l").append(n).append(" [");
    for (int k = 0; k < 9; ++k) laughs.append(k ? ", *l" : "*l").append(std::to_string(i - 1));
    laughs += "]\n";
  }
  ASSERT_LT(laughs.size(), 1024u);
  expect_error(laughs, {}, "r.yaml: expands to more than 10000 values");
  expect_error("a: " + std::string(5000, '[') + std::string(5000, ']') + "\n", {}, "r.yaml: nests deeper than 32 levels");
  expect_error("? [a, b]\n: 1\n", {}, "the keys of the recipe must be names");
  // Aliases a walk can afford stay allowed: one anchored value reused.
  const Recipe r = parse_recipe("data:\n  corpus: &c /tmp/x\n  tokens: *c\n", "r.yaml");
  EXPECT_EQ(r.tokens, "/tmp/x");
}

// Sizes past 64 bits must not wrap into small or negative counts: each integer key has a bound and
// every product the estimate takes is checked, naming the key that makes it too large.
TEST(Recipe, RefusesSizesThatWouldOverflow) {
  expect_error(kYaml, {"model.vocab_size=9223372036854775807"}, "model.vocab_size must be an integer from 0 to 2147483647");
  expect_error(kYaml, {"model.n_layers=100000"}, "model.n_layers must be an integer from 1 to 4096");
  expect_error(kYaml, {"train.batch_size=99999999999"}, "train.batch_size must be an integer from 1 to 16777216");
  expect_error(kYaml, {"train.steps=9223372036854775807"}, "train.steps must be an integer from 1 to");
  expect_error(kYaml, {"train.log_interval=99999999999999"}, "train.log_interval must be an integer from 1 to");
  expect_error(kYaml, {"model.vocab_size=2000000000", "model.dim=2000000000", "model.n_heads=2", "model.n_kv_heads=2"},
               "model.dim=2000000000: too large");
  expect_error(kYaml, {"model.ffn_dim=2000000000", "train.batch_size=16777216"}, "train.batch_size=16777216");
  expect_error(kYaml, {"model.max_seq_len=16777216", "train.seq_len=16777216"}, "train.seq_len=16777216: too large");
  // Large but representable stays allowed and exact: 2^31-1 vocabulary x 64 wide embeddings.
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"model.vocab_size=2147483647"});
  EXPECT_EQ(r.model.vocab_size, 2147483647);
}

// An override that breaks a check is named as one, so the user knows which to change.
TEST(Recipe, ChecksNameTheOverrideThatBrokeThem) {
  expect_error(kYaml, {"train.steps=3", "schedule.warmup_steps=5"},
               "schedule.warmup_steps=5 (from the command line) must be below train.steps=3 (from the command line)");
  expect_error(kYaml, {"optimizer.beta2=1"}, "optimizer.beta2=1 (from the command line): it must be below 1");
  expect_error(kYaml, {"model.dim=30"}, "(model.dim=30 from the command line)");
  expect_error("model:\n  n_heads: 5\n  dim: 32\ndata:\n  corpus: x\n", {}, "r.yaml: model: dim 32 must be divisible by n_heads 5");
}

TEST(Recipe, RefusesValuesThatOnlyFailLater) {
  expect_error(kYaml, {"data.val_fraction=-0.1"}, "data.val_fraction must be a number from 0 to 1, got '-0.1'");
  expect_error(kYaml, {"data.val_fraction=1.5"}, "data.val_fraction must be a number from 0 to 1, got '1.5'");
  for (const char* v : {"0", "1"}) {
    expect_error(kYaml, {std::string("data.val_fraction=") + v},
                 "data.val_fraction=" + std::string(v) + " (from the command line): it must be above 0 and below 1");
  }
  expect_error(kYaml, {"train.out_dir="}, "train.out_dir must be set");
}

// data.tokenizer and data.tokens left empty live in train.out_dir, so changing the output folder
// moves every file the run writes.
TEST(Recipe, DataPathsFollowTheOutputFolder) {
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"train.out_dir=out/on"});
  EXPECT_EQ(r.tokenizer, "out/on/tokenizer.model");
  EXPECT_EQ(r.tokens, "out/on/corpus.tokens");
  const Recipe set = parse_recipe(kYaml, "r.yaml", {"train.out_dir=out/on", "data.tokenizer=t.model"});
  EXPECT_EQ(set.tokenizer, "t.model");
  EXPECT_EQ(parse_recipe(recipe_to_yaml(r), "saved.yaml").tokenizer, "out/on/tokenizer.model");
}

// --list-keys prints these: every key has a type, a default that parses back and a meaning.
TEST(Recipe, EveryKeyIsDocumented) {
  const auto docs = recipe_key_docs();
  ASSERT_EQ(docs.size(), recipe_keys().size());
  std::vector<std::string> every_default;  // all set together: the defaults agree with each other
  for (const RecipeKey& k : docs) {
    EXPECT_FALSE(k.meaning.empty()) << k.key;
    EXPECT_FALSE(k.type.empty()) << k.key;
    if (k.key.rfind("data.", 0) != 0) every_default.push_back(k.key + "=" + k.default_value);
  }
  const Recipe r = parse_recipe("data:\n  corpus: /tmp/x\n", "r.yaml", every_default);
  EXPECT_EQ(recipe_to_yaml(r), recipe_to_yaml(parse_recipe("data:\n  corpus: /tmp/x\n", "r.yaml")));
  for (const RecipeKey& k : docs) {
    if (k.key == "optimizer.algorithm") {
      EXPECT_EQ(k.type, "one of sgd, adam, adamw");
    }
    if (k.key == "train.steps") {
      EXPECT_EQ(k.default_value, "100");
    }
  }
}

// model.attention: explicit by default, listed with its choices, sdpa taken by the model config on
// LibTorch 2.x and refused on 1.13 with the reason, naming the override.
TEST(Recipe, AttentionKernelKey) {
  using frugal::models::AttentionKernel;
  EXPECT_EQ(parse_recipe(kYaml, "r.yaml").model.attention, AttentionKernel::explicit_softmax);
  bool listed = false;
  for (const RecipeKey& k : recipe_key_docs()) {
    if (k.key != "model.attention") continue;
    listed = true;
    EXPECT_EQ(k.type, "one of explicit, sdpa");
    EXPECT_EQ(k.default_value, "explicit");
  }
  EXPECT_TRUE(listed);
  expect_error(kYaml, {"model.attention=flash"}, "override: model.attention must be one of explicit, sdpa, got 'flash'");
#if TORCH_VERSION_MAJOR >= 2
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"model.attention=sdpa"});
  EXPECT_EQ(r.model.attention, AttentionKernel::sdpa);
  EXPECT_EQ(parse_recipe(recipe_to_yaml(r), "saved.yaml").model.attention, AttentionKernel::sdpa);
#else
  expect_error(kYaml, {"model.attention=sdpa"},
               "r.yaml: model.attention=sdpa (from the command line) needs LibTorch 2.0 or later "
               "(at::scaled_dot_product_attention); this frugal is built against LibTorch 1.13");
  std::string in_file = kYaml;
  in_file.replace(in_file.find("model:\n"), 7, "model:\n  attention: sdpa\n");
  expect_error(in_file, {}, "r.yaml: model.attention sdpa needs LibTorch 2.0 or later");
#endif
}

TEST(Recipe, ComputeDtypeKey) {
  EXPECT_EQ(parse_recipe(kYaml, "r.yaml").compute_dtype, ComputeDtype::fp32);  // autocast only when asked
  expect_error(kYaml, {"model.compute_dtype=fp16"}, "override: model.compute_dtype must be one of fp32, bf16, auto, got 'fp16'");
  std::string why;
  const Recipe bf16 = parse_recipe(kYaml, "r.yaml", {"model.compute_dtype=bf16"});
  EXPECT_EQ(resolve_compute_dtype(bf16, &why), at::kBFloat16);
  EXPECT_EQ(why, "model.compute_dtype bf16");
  EXPECT_EQ(parse_recipe(recipe_to_yaml(bf16), "saved.yaml").compute_dtype, ComputeDtype::bf16);
  // auto follows the device's bf16 instructions, and says so.
  const Recipe automatic = parse_recipe(kYaml, "r.yaml", {"model.compute_dtype=auto"});
  const bool fast = frugal::precision::fast_bf16(c10::kCPU);
  EXPECT_EQ(resolve_compute_dtype(automatic, &why), fast ? at::kBFloat16 : at::kFloat);
  EXPECT_EQ(why.rfind("model.compute_dtype auto: this CPU has ", 0), 0u) << why;
  // bf16 parameters compute in bf16 whatever the key says (no autocast).
  EXPECT_EQ(resolve_compute_dtype(parse_recipe(kYaml, "r.yaml", {"model.dtype=bf16", "model.compute_dtype=fp32"}), &why), at::kBFloat16);
  EXPECT_EQ(why, "the parameters are bf16");
}

// model.init_from: the folder's config.json defines the model; keys left at their defaults follow
// it, keys set explicitly must agree with it, and its dropout needs model.ignore_dropout.
TEST(Recipe, InitFromDefinesTheArchitecture) {
  frugal::models::DecoderConfig c;
  c.vocab_size = 48;
  c.dim = 24;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 40;
  c.max_seq_len = 128;
  c.rope_theta = 500000;
  c.explicit_head_dim = 8;
  const std::string dir = ::testing::TempDir() + "/frugal_recipe_init_from";
  frugal::io::make_directories(dir);
  frugal::io::write_file_atomic(dir + "/config.json", frugal::models::hf_config_json(c));
  const std::string yaml = "data:\n  corpus: /tmp/x\ntrain:\n  seq_len: 16\nmodel:\n  init_from: " + dir + "\n";
  const Recipe r = parse_recipe(yaml, "r.yaml");
  EXPECT_EQ(r.model.vocab_size, 48);
  EXPECT_EQ(r.model.dim, 24);
  EXPECT_EQ(r.model.head_dim(), 8);
  EXPECT_EQ(r.model.rope_theta, 500000);
  EXPECT_EQ(r.model.max_seq_len, 128);
  ASSERT_EQ(r.model_sources.size(), architecture_keys().size());
  for (const auto& [key, source] : r.model_sources) EXPECT_EQ(source, "file") << key;
  // An explicit value that agrees is fine; one that contradicts names both values.
  EXPECT_EQ(parse_recipe(yaml, "r.yaml", {"model.dim=24"}).model.dim, 24);
  expect_error(yaml, {"model.dim=32"}, "model.dim 32 (set in the recipe) contradicts model.init_from");
  expect_error(yaml, {"model.rope_theta=10000"}, "which says 500000");
  expect_error(yaml + "  n_layers: 2\n", {}, "model.n_layers 2");
  // Without init_from, where each value came from.
  const Recipe plain = parse_recipe(kYaml, "r.yaml", {"model.norm_eps=1e-6"});
  for (const auto& [key, source] : plain.model_sources) {
    EXPECT_EQ(source, key == "model.rope_theta" || key == "model.tie_embeddings" ? "default" : "recipe") << key;
  }
  // A GPT-2 file with transformers' default dropout.
  frugal::io::write_file_atomic(dir + "/config.json", R"({"model_type": "gpt2", "vocab_size": 48, "n_embd": 24,
      "n_layer": 1, "n_head": 4, "n_positions": 64, "resid_pdrop": 0.1})");
  expect_error(yaml, {}, "resid_pdrop 0.1: frugal trains without dropout; set model.ignore_dropout=true");
  const Recipe g = parse_recipe(yaml, "r.yaml", {"model.ignore_dropout=true"});
  EXPECT_EQ(g.model.arch, "gpt2");
  EXPECT_EQ(g.model.resolved_activation(), "gelu_tanh");
  expect_error("data:\n  corpus: /tmp/x\nmodel:\n  init_from: /nonexistent\n", {}, "model.init_from /nonexistent is not a folder");
}

// frugal's own GPT-2 recipes tie the head unless they say otherwise.
TEST(Recipe, Gpt2TiesItsHeadByDefault) {
  EXPECT_TRUE(parse_recipe(kYaml, "r.yaml", {"model.arch=gpt2", "model.n_kv_heads=4"}).model.tie_embeddings);
  EXPECT_FALSE(parse_recipe(kYaml, "r.yaml", {"model.arch=gpt2", "model.n_kv_heads=4", "model.tie_embeddings=false"}).model.tie_embeddings);
  EXPECT_FALSE(parse_recipe(kYaml, "r.yaml").model.tie_embeddings);
}

// optimizer.update_threads and optimizer.bytes_in_flight reach the optimizer's options; the update
// thread is refused outside in-backward mode and with data parallel, naming the key.
TEST(Recipe, UpdateThreadsKeys) {
  const Recipe r = parse_recipe(kYaml, "r.yaml", {"optimizer.update_threads=1", "optimizer.bytes_in_flight=512MiB"});
  EXPECT_EQ(r.optimizer.update_threads(), 1);
  EXPECT_EQ(r.optimizer.bytes_in_flight(), int64_t{512} << 20);
  EXPECT_EQ(parse_recipe(kYaml, "r.yaml").optimizer.bytes_in_flight(), frugal::optim::kDefaultBytesInFlight);
  EXPECT_NO_THROW(r.check_data_parallel(1));
  try {
    r.check_data_parallel(2);
    FAIL() << "update_threads over 2 ranks was accepted";
  } catch (const RecipeError& e) {
    EXPECT_NE(std::string(e.what()).find("optimizer.update_threads 1 cannot be used with 2 ranks"), std::string::npos) << e.what();
  }
  expect_error(kYaml, {"optimizer.update_threads=1", "optimizer.in_backward=false", "optimizer.clip=none"},
               "optimizer.update_threads=1 (from the command line) needs optimizer.in_backward=true");
  expect_error(kYaml, {"optimizer.bytes_in_flight=lots"}, "optimizer.bytes_in_flight");
}
