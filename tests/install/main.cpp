// A tiny Llama, its loss and gradients plain and checkpointed, and a tokenizer round trip: what an
// outside program needs from an installed frugal, helpers included; and whether frugal's CUDA
// module loaded (memory/cuda_runtime.h).
#include <cstdio>
#include <string>

#include "frugal/data/tokenizer.h"
#include "frugal/memory/cuda_runtime.h"
#include "frugal/models/decoder.h"

int main(int argc, char** argv) {
  frugal::models::DecoderConfig cfg;
  cfg.vocab_size = 64, cfg.dim = 32, cfg.n_layers = 2, cfg.n_heads = 2, cfg.n_kv_heads = 2, cfg.ffn_dim = 64, cfg.max_seq_len = 16;
  at::manual_seed(0);
  auto model = frugal::models::make_decoder(cfg);
  const at::Tensor x = at::randint(64, {2, 8}, at::kLong), y = at::randint(64, {2, 8}, at::kLong);  // (B, T)
  model->loss(x, y).backward();
  const at::Tensor plain = model->parameters()[0].grad().clone();
  model->zero_grad();
  model->set_checkpointing(frugal::checkpoint::CheckpointPolicy::full());
  const at::Tensor loss = model->loss(x, y);
  loss.backward();
  const double diff = (model->parameters()[0].grad() - plain).abs().max().item<double>();
  std::string text;
  for (int i = 0; i < 50; ++i) text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  frugal::data::train_tokenizer({text}, std::string(argv[argc - 1]) + "/tok", frugal::data::TokenizerTrainOptions().vocab_size(300));
  const auto tok = frugal::data::Tokenizer::load(std::string(argv[argc - 1]) + "/tok.model");
  std::printf("loss %.6f grad_diff %g roundtrip '%s'\n", loss.item<double>(), diff, tok.decode(tok.encode("lazy fox")).c_str());
  std::printf("cuda %s\n", frugal::memory::load_cuda().loaded ? "loaded" : frugal::memory::load_cuda().reason.c_str());
}
