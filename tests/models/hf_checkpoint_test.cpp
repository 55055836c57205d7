// Hugging Face checkpoints: a tiny model written and read back (single file and sharded, Llama and
// GPT-2), configs, and clear errors for weights that do not fit.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>

#include "frugal/io/safetensors.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/hf_checkpoint.h"

using namespace frugal;

namespace {

std::string fresh_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/frugal_hf_" + name;
  ::mkdir(d.c_str(), 0755);
  return d;
}

models::DecoderConfig small_config(const std::string& arch) {
  models::DecoderConfig c;
  c.arch = arch;
  c.vocab_size = 50;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = arch == "llama" ? 2 : 4;
  c.ffn_dim = 40;
  c.max_seq_len = 32;
  c.tie_embeddings = arch == "gpt2";
  return c;
}

}  // namespace

TEST(HfCheckpoint, RoundTripSingleAndSharded) {
  for (const char* arch : {"llama", "gpt2"}) {
    for (int64_t shard : {int64_t{0}, int64_t{3000}}) {
      SCOPED_TRACE(std::string(arch) + " shard " + std::to_string(shard));
      torch::manual_seed(0);
      auto model = models::make_decoder(small_config(arch));
      const std::string dir = fresh_dir(std::string(arch) + std::to_string(shard)) + "/made/by/save";  // folders made
      models::save_hf_checkpoint(*model, dir, shard);
      struct stat st {};
      EXPECT_EQ(::stat((dir + "/model.safetensors.index.json").c_str(), &st) == 0, shard > 0);
      const auto cfg = models::read_hf_config(dir + "/config.json");
      EXPECT_EQ(cfg.arch, arch);
      EXPECT_EQ(cfg.n_kv_heads, small_config(arch).n_kv_heads);
      EXPECT_EQ(cfg.param_count(), small_config(arch).param_count());
      torch::manual_seed(1);
      auto loaded = models::make_decoder(cfg);
      models::load_hf_weights(*loaded, dir);
      const at::Tensor tokens = at::randint(0, 50, {1, 6}, at::kLong);
      at::NoGradGuard g;
      EXPECT_TRUE(at::equal(loaded->logits(tokens), model->logits(tokens)));
      // load_hf_checkpoint builds the model without drawing its weights (WeightInit::for_loading):
      // every one of them is read.
      EXPECT_TRUE(at::equal(models::load_hf_checkpoint(dir)->logits(tokens), model->logits(tokens)));
    }
  }
}

// The default build draws Hugging Face's initialisation (every matrix from N(0, 0.02), biases zero);
// one made for loading skips that draw (minutes at 7B) and, loaded, is the saved model exactly.
TEST(HfCheckpoint, AModelMadeForLoadingIsTheSavedOneOnceLoaded) {
  models::DecoderConfig c = small_config("llama");
  c.dim = 64, c.ffn_dim = 176, c.vocab_size = 512, c.attention_bias = true;
  torch::manual_seed(0);
  auto drawn = models::make_decoder(c);
  for (const auto& p : drawn->named_parameters()) {
    if (p.value().dim() >= 2) {
      EXPECT_NEAR(p.value().std().item<double>(), 0.02, 0.002) << p.key();
    } else if (p.key().find("bias") != std::string::npos) {
      EXPECT_EQ(p.value().abs().max().item<double>(), 0.0) << p.key();
    }
  }
  const std::string dir = fresh_dir("for_loading");
  models::save_hf_checkpoint(*drawn, dir);
  torch::manual_seed(1);
  auto loaded = models::make_decoder(c, {}, models::WeightInit::for_loading);
  models::load_hf_weights(*loaded, dir);
  const auto a = drawn->named_parameters(), b = loaded->named_parameters();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i].value(), b[i].value())) << a[i].key();
}

TEST(HfCheckpoint, Gpt2WeightsAreStoredAsConv1D) {
  auto model = models::make_decoder(small_config("gpt2"));
  const std::string dir = fresh_dir("gpt2conv");
  models::save_hf_checkpoint(*model, dir);
  io::SafetensorsReader r(dir + "/model.safetensors");
  EXPECT_EQ(r.find("transformer.h.0.attn.c_attn.weight")->shape, (std::vector<int64_t>{16, 48}));
}

TEST(HfCheckpoint, WeightsThatDoNotFitAreNamed) {
  auto model = models::make_decoder(small_config("llama"));
  const std::string dir = fresh_dir("bad");
  io::write_safetensors(dir + "/model.safetensors",
                        {{"model.embed_tokens.weight", at::zeros({50, 8})}, {"model.norm.weight", at::zeros({16})}});
  try {
    models::load_hf_weights(*model, dir);
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Missing: model.layers.0."), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.embed_tokens.weight is [50, 8] in the file but [50, 16] in the model (dimension 1: 8 vs 16)"),
              std::string::npos)
        << msg;
  }
  EXPECT_THROW(models::load_hf_weights(*model, fresh_dir("empty")), std::invalid_argument);
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "hidden_size": 16})";
  try {
    models::read_hf_config(dir + "/config.json");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'vocab_size' is missing"), std::string::npos) << e.what();
  }
}

TEST(HfCheckpoint, LoadingAtRealWidthHoldsOneTensorBesidesTheModel) {
  // dim 4096 and ffn 11008 (the 7B width), one layer, a smaller vocabulary: 0.27B bf16 parameters.
  models::DecoderConfig c;
  c.vocab_size = 8000;
  c.dim = 4096;
  c.n_layers = 1;
  c.n_heads = 32;
  c.n_kv_heads = 32;
  c.ffn_dim = 11008;
  c.max_seq_len = 64;
  const std::string dir = ::testing::TempDir() + "/frugal_hf_wide";
  ::mkdir(dir.c_str(), 0755);
  const auto options = at::TensorOptions().dtype(at::kBFloat16);
  {
    auto saved = models::make_decoder(c, options);
    models::save_hf_checkpoint(*saved, dir, 0);
  }
  auto model = models::make_decoder(c, options);
  int64_t largest = 0;
  for (const auto& p : model->parameters()) largest = std::max<int64_t>(largest, p.numel() * 2);
  auto tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(tracker);
    models::load_hf_weights(*model, dir);
  }
  // Nothing but one tensor at a time on top of the model (which existed before tracking began).
  EXPECT_LE(static_cast<double>(tracker->peak_bytes()), 1.05 * static_cast<double>(largest));
  EXPECT_EQ(tracker->live_bytes(), 0);
  // And what was loaded is what was saved, bit for bit.
  auto again = models::make_decoder(c, options);
  models::load_hf_weights(*again, dir);
  const auto a = model->parameters(), b = again->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i]));
}

TEST(HfCheckpoint, ShapesFromTheConfigAreTheModelsParameters) {
  for (const std::string arch : {"llama", "gpt2"}) {
    for (int variant = 0; variant < 4; ++variant) {
      models::DecoderConfig c = small_config(arch);
      c.tie_embeddings = variant % 2 == 1;
      if (arch == "llama" && variant >= 2) {  // biases and a head size of its own
        c.attention_bias = c.mlp_bias = true;
        c.explicit_head_dim = 6;
      }
      const auto model = models::make_decoder(c);  // the reference: what the model really holds
      std::vector<std::pair<std::string, std::vector<int64_t>>> real;
      for (const auto& item : model->named_parameters()) real.emplace_back(item.key(), item.value().sizes().vec());
      EXPECT_EQ(models::hf_parameter_shapes(c), real) << arch << " variant " << variant;  // in the same order
      int64_t numel = 0;
      for (const auto& p : model->parameters()) numel += p.numel();
      EXPECT_EQ(c.param_count(), numel) << arch << " variant " << variant;
    }
  }
}

TEST(HfCheckpoint, AConfigLargerThanItsWeightsIsRefusedBeforeAnyModelIsBuilt) {
  auto model = models::make_decoder(small_config("llama"));
  const std::string dir = fresh_dir("huge_config");
  models::save_hf_checkpoint(*model, dir);
  EXPECT_NO_THROW(models::load_hf_checkpoint(dir));
  // 10^8 layers: building it would allocate without bound; the headers say no in microseconds.
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 40,
      "num_hidden_layers": 100000000, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32})";
  auto tracker = memory::Tracker::create(false);
  try {
    memory::TrackingGuard guard(tracker);
    models::load_hf_checkpoint(dir);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("config.json implies 900000003 tensors (100000000 layers) but the weights hold 21"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(tracker->peak_bytes(), 1 << 20);
  // A width the weights do not have: the tensor and the dimension are named.
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 4000000,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32})";
  try {
    models::load_hf_checkpoint(dir);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "model.layers.0.mlp.gate_proj.weight is [40, 16] in the file but [4000000, 16] in the model (dimension 0: 40 vs 4000000)"),
        std::string::npos)
        << e.what();
  }
}

TEST(HfCheckpoint, AHugeTensorInASparseFileIsRefusedFromItsHeaderWithoutReadingIt) {
  // 4 KiB on disk declaring a 1 GiB tensor: the shape check comes from the header, before any data
  // is read (no allocation for it, and not a quarter of its pages touched through a mapping).
  auto model = models::make_decoder(small_config("llama"));
  const std::string dir = fresh_dir("sparse");
  const int64_t n = int64_t{1} << 28, bytes = n * 4;
  std::string header =
      R"({"model.embed_tokens.weight":{"dtype":"F32","shape":[16384,16384],"data_offsets":[0,)" + std::to_string(bytes) + "]}}";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  {
    std::ofstream f(dir + "/model.safetensors", std::ios::binary);
    const uint64_t len = header.size();
    f.write(reinterpret_cast<const char*>(&len), 8);
    f << header;
  }
  ASSERT_EQ(::truncate((dir + "/model.safetensors").c_str(), static_cast<off_t>(8 + header.size() + bytes)), 0);
  struct rusage before, after;
  ::getrusage(RUSAGE_SELF, &before);
  auto tracker = memory::Tracker::create(false);
  try {
    memory::TrackingGuard guard(tracker);
    models::load_hf_weights(*model, dir);
    FAIL() << "a 1 GiB embedding was accepted for a [50, 16] one";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model.embed_tokens.weight is [16384, 16384] in the file but [50, 16] in the model"),
              std::string::npos)
        << e.what();
  }
  ::getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(tracker->peak_bytes(), 1 << 20);
  EXPECT_LT(after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt, 65536);  // 1 GiB is 262144 pages
}

namespace {

std::string write_config(const std::string& name, const std::string& json) {
  const std::string dir = fresh_dir(name);
  std::ofstream(dir + "/config.json") << json;
  return dir + "/config.json";
}

// The message read_hf_config throws for the config, or "" when it reads it.
std::string refusal(const std::string& json) {
  try {
    models::read_hf_config(write_config("refused", json));
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// What transformers 5.23 writes for LlamaForCausalLM(LlamaConfig(...)).save_pretrained(dir).
const char* kLlamaV5 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": true, "attention_dropout": 0.0, "bos_token_id": 1,
  "dtype": "float32", "eos_token_id": 2, "head_dim": 12, "hidden_act": "silu", "hidden_size": 32,
  "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 64, "mlp_bias": true,
  "model_type": "llama", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
  "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
  "rope_parameters": {"factor": 4.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 16, "rope_theta": 5000.0, "rope_type": "llama3"},
  "tie_word_embeddings": false, "transformers_version": "5.23.0", "use_cache": true, "vocab_size": 64})";

// What transformers 5.23 writes for GPT2LMHeadModel(GPT2Config(..., tie_word_embeddings=False)).
const char* kGpt2V5 = R"({
  "activation_function": "gelu_new", "add_cross_attention": false, "architectures": ["GPT2LMHeadModel"],
  "attn_pdrop": 0.1, "bos_token_id": 50256, "dtype": "float32", "embd_pdrop": 0.1, "eos_token_id": 50256,
  "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_embd": 32, "n_head": 4,
  "n_inner": null, "n_layer": 2, "n_positions": 32, "pad_token_id": null, "reorder_and_upcast_attn": false,
  "resid_pdrop": 0.1, "scale_attn_by_inverse_layer_idx": false, "scale_attn_weights": true,
  "summary_activation": null, "summary_first_dropout": 0.1, "summary_proj_to_labels": true,
  "summary_type": "cls_index", "summary_use_proj": true, "tie_word_embeddings": false,
  "transformers_version": "5.23.0", "use_cache": true, "vocab_size": 64})";

}  // namespace

TEST(HfCheckpoint, TransformersFiveConfigsDefineTheModel) {
  const auto l = models::read_hf_config(write_config("llama_v5", kLlamaV5));
  EXPECT_EQ(l.head_dim(), 12);
  EXPECT_TRUE(l.attention_bias && l.mlp_bias);
  EXPECT_EQ(l.rope_theta, 5000.0);
  EXPECT_EQ(l.rope_scaling.type, "llama3");
  EXPECT_EQ(l.rope_scaling.factor, 4.0);
  EXPECT_EQ(l.rope_scaling.original_max_position_embeddings, 16);
  EXPECT_EQ(l.norm_eps, 1e-6);
  EXPECT_EQ(l.max_seq_len, 64);
  EXPECT_FALSE(l.tie_embeddings);
  EXPECT_EQ(l.file_dtype, at::kFloat);
  EXPECT_EQ(l.dropout, 0.0);
  const auto g = models::read_hf_config(write_config("gpt2_v5", kGpt2V5));
  EXPECT_EQ(g.resolved_activation(), "gelu_tanh");
  EXPECT_EQ(g.ffn_dim, 128);  // n_inner null: 4 * n_embd
  EXPECT_FALSE(g.tie_embeddings);
  EXPECT_EQ(g.dropout, 0.1);
  EXPECT_EQ(g.dropout_field, "attn_pdrop");
  // A GPT-2 file that names no activation or dropout has transformers' defaults.
  const auto old = models::read_hf_config(write_config(
      "gpt2_old", R"({"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 16, "n_ctx": 16})"));
  EXPECT_EQ(old.resolved_activation(), "gelu_tanh");
  EXPECT_TRUE(old.tie_embeddings);
  EXPECT_EQ(old.dropout, 0.1);
  EXPECT_EQ(models::read_hf_config(write_config("gpt2_old_again", models::hf_config_json(old))).dropout, 0.1);  // written back as 0.1
  // transformers 4's layout: rope_theta at the top, rope_scaling with "type".
  const auto v4 = models::read_hf_config(write_config("llama_v4", R"({"model_type": "llama", "vocab_size": 64,
      "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4,
      "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16"})"));
  EXPECT_EQ(v4.rope_theta, 500000.0);
  EXPECT_EQ(v4.rope_scaling.type, "linear");
  EXPECT_EQ(v4.rope_scaling.factor, 2.0);
  EXPECT_EQ(v4.n_kv_heads, 4);
  EXPECT_EQ(v4.max_seq_len, 2048);  // transformers' default
  EXPECT_EQ(v4.file_dtype, at::kBFloat16);
}

TEST(HfCheckpoint, FieldsThatWouldChangeTheModelAreRefusedByName) {
  const std::string llama = R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
      "num_hidden_layers": 1, "num_attention_heads": 4)";
  const std::string gpt2 = R"({"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 4, "n_positions": 16)";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {llama + R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})", "'yarn'"},
      {llama + R"(, "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}})", "'longrope'"},
      {llama + R"(, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "attention_factor": 2.0}})", "attention_factor"},
      {llama + R"(, "rope_parameters": {"rope_type": "default", "beta_fast": 32}})", "beta_fast"},
      {llama + R"(, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}})", "original_max_position_embeddings"},
      {llama + R"(, "rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})", "rope_theta"},
      {llama + R"(, "hidden_act": "relu"})", "hidden_act"},
      {llama + R"(, "sliding_window": 128})", "sliding_window"},
      {llama + R"(, "torch_dtype": "float64"})", "torch_dtype"},
      {R"({"model_type": "llama", "vocab_size": 64, "hidden_size": 30, "intermediate_size": 48, "num_hidden_layers": 1,
          "num_attention_heads": 4})",
       "num_attention_heads"},
      {llama + R"(, "head_dim": 7})", "head_dim"},
      {gpt2 + R"(, "scale_attn_weights": false})", "scale_attn_weights"},
      {gpt2 + R"(, "scale_attn_by_inverse_layer_idx": true})", "scale_attn_by_inverse_layer_idx"},
      {gpt2 + R"(, "activation_function": "relu"})", "activation_function"},
      {gpt2 + R"(, "add_cross_attention": true})", "add_cross_attention"},
      {gpt2 + R"(, "rope_theta": 1e4})", "rope_theta"},
      {R"({"model_type": "mistral", "vocab_size": 64})", "mistral"},
  };
  for (const auto& [json, field] : cases) {
    const std::string msg = refusal(json);
    EXPECT_NE(msg.find(field), std::string::npos) << json << " -> " << msg;
  }
  EXPECT_EQ(refusal(llama + R"(, "pretraining_tp": 2, "rope_scaling": null, "attention_dropout": 0.1})"), "");
}

TEST(HfCheckpoint, EveryFieldRoundTripsAndTheHarmlessOnesPassThrough) {
  models::DecoderConfig l = small_config("llama");
  l.explicit_head_dim = 6;
  l.attention_bias = l.mlp_bias = true;
  l.rope_theta = 5000;
  l.rope_scaling.type = "llama3";
  l.rope_scaling.factor = 4;
  l.rope_scaling.original_max_position_embeddings = 8;
  l.norm_eps = 1e-6;
  l.activation = "gelu_tanh";
  models::DecoderConfig g = small_config("gpt2");
  g.tie_embeddings = false;
  g.activation = "gelu_tanh";
  for (const auto& c : {l, g}) {
    SCOPED_TRACE(c.arch);
    torch::manual_seed(0);
    auto model = models::make_decoder(c, at::TensorOptions().dtype(at::kBFloat16));
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) p.normal_();  // biases too: nonzero
    }
    const std::string dir = fresh_dir("fields_" + c.arch);
    models::save_hf_checkpoint(*model, dir);
    const auto back = models::read_hf_config(dir + "/config.json");
    EXPECT_EQ(back.head_dim(), c.head_dim());
    EXPECT_EQ(back.attention_bias, c.attention_bias);
    EXPECT_EQ(back.mlp_bias, c.mlp_bias);
    EXPECT_EQ(back.rope_theta, c.rope_theta);
    EXPECT_TRUE(back.rope_scaling == c.rope_scaling);
    EXPECT_EQ(back.resolved_activation(), "gelu_tanh");
    EXPECT_EQ(back.tie_embeddings, c.tie_embeddings);
    EXPECT_EQ(back.norm_eps, c.norm_eps);
    EXPECT_EQ(back.dropout, 0.0);
    EXPECT_EQ(back.file_dtype, at::kBFloat16);
    auto loaded = models::load_hf_checkpoint(dir);  // the file's dtype: bf16
    const auto a = model->named_parameters(), b = loaded->named_parameters();
    ASSERT_EQ(a.size(), b.size());
    for (const auto& item : a) {
      EXPECT_EQ(b[item.key()].scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(item.value(), b[item.key()])) << item.key();
    }
  }
  // A config read and written back keeps the file's harmless fields.
  const auto v5 = models::read_hf_config(write_config("passthrough", kGpt2V5));
  const std::string again = write_config("passthrough_again", models::hf_config_json(v5));
  const auto back = models::read_hf_config(again);
  EXPECT_EQ(back.hf_passthrough, v5.hf_passthrough);
  EXPECT_EQ(back.dropout_field, "attn_pdrop");
  std::ifstream in(again);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"bos_token_id\": 50256"), std::string::npos) << text;
  EXPECT_NE(text.find("\"summary_type\": \"cls_index\""), std::string::npos) << text;
}
