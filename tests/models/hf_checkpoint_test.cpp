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

models::DecoderConfig tiny(const std::string& arch) {
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
      auto model = models::make_decoder(tiny(arch));
      const std::string dir = fresh_dir(std::string(arch) + std::to_string(shard));
      models::save_hf_checkpoint(*model, dir, shard);
      struct stat st {};
      EXPECT_EQ(::stat((dir + "/model.safetensors.index.json").c_str(), &st) == 0, shard > 0);
      const auto cfg = models::read_hf_config(dir + "/config.json");
      EXPECT_EQ(cfg.arch, arch);
      EXPECT_EQ(cfg.n_kv_heads, tiny(arch).n_kv_heads);
      EXPECT_EQ(cfg.param_count(), tiny(arch).param_count());
      torch::manual_seed(1);
      auto loaded = models::make_decoder(cfg);
      models::load_hf_weights(*loaded, dir);
      const at::Tensor tokens = at::randint(0, 50, {1, 6}, at::kLong);
      at::NoGradGuard g;
      EXPECT_TRUE(at::equal(loaded->logits(tokens), model->logits(tokens)));
    }
  }
}

TEST(HfCheckpoint, Gpt2WeightsAreStoredAsConv1D) {
  auto model = models::make_decoder(tiny("gpt2"));
  const std::string dir = fresh_dir("gpt2conv");
  models::save_hf_checkpoint(*model, dir);
  io::SafetensorsReader r(dir + "/model.safetensors");
  EXPECT_EQ(r.find("transformer.h.0.attn.c_attn.weight")->shape, (std::vector<int64_t>{16, 48}));
}

TEST(HfCheckpoint, WeightsThatDoNotFitAreNamed) {
  auto model = models::make_decoder(tiny("llama"));
  const std::string dir = fresh_dir("bad");
  io::write_safetensors(dir + "/model.safetensors",
                        {{"model.embed_tokens.weight", at::zeros({50, 8})}, {"model.norm.weight", at::zeros({16})}});
  try {
    models::load_hf_weights(*model, dir);
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Missing: model.layers.0."), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.embed_tokens.weight is [50, 8] in the file but [50, 16] in the model (dimension 1: 8 vs 16)"), std::string::npos) << msg;
  }
  EXPECT_THROW(models::load_hf_weights(*model, fresh_dir("empty")), std::invalid_argument);
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "hidden_size": 16})";
  try {
    models::read_hf_config(dir + "/config.json");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("missing key 'vocab_size'"), std::string::npos) << e.what();
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
    for (bool tie : {false, true}) {
      models::DecoderConfig c = tiny(arch);
      c.tie_embeddings = arch == "gpt2" ? true : tie;
      const auto model = models::make_decoder(c);  // the reference: what the model really holds
      std::vector<std::pair<std::string, std::vector<int64_t>>> real;
      for (const auto& item : model->named_parameters()) real.emplace_back(item.key(), item.value().sizes().vec());
      auto predicted = models::hf_parameter_shapes(c);
      std::sort(real.begin(), real.end());
      std::sort(predicted.begin(), predicted.end());
      EXPECT_EQ(predicted, real) << arch << " tie " << tie;
    }
  }
}

TEST(HfCheckpoint, AConfigLargerThanItsWeightsIsRefusedBeforeAnyModelIsBuilt) {
  auto model = models::make_decoder(tiny("llama"));
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
              std::string::npos) << e.what();
  }
  EXPECT_LT(tracker->peak_bytes(), 1 << 20);
  // A width the weights do not have: the tensor and the dimension are named.
  std::ofstream(dir + "/config.json") << R"({"model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 4000000,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32})";
  try {
    models::load_hf_checkpoint(dir);
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.gate_proj.weight is [40, 16] in the file but [4000000, 16] in the model (dimension 0: 40 vs 4000000)"),
              std::string::npos) << e.what();
  }
}

TEST(HfCheckpoint, AHugeTensorInASparseFileIsRefusedFromItsHeaderWithoutReadingIt) {
  // 4 KiB on disk declaring a 1 GiB tensor: the shape check comes from the header, before any data
  // is read (no allocation for it, and not a quarter of its pages touched through a mapping).
  auto model = models::make_decoder(tiny("llama"));
  const std::string dir = fresh_dir("sparse");
  const int64_t n = int64_t{1} << 28, bytes = n * 4;
  std::string header = R"({"model.embed_tokens.weight":{"dtype":"F32","shape":[16384,16384],"data_offsets":[0,)" +
                       std::to_string(bytes) + "]}}";
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
              std::string::npos) << e.what();
  }
  ::getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(tracker->peak_bytes(), 1 << 20);
  EXPECT_LT(after.ru_minflt + after.ru_majflt - before.ru_minflt - before.ru_majflt, 65536);  // 1 GiB is 262144 pages
}
