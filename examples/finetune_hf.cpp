// Fine-tuning a Hugging Face folder from C++ with the library (not the CLI): its config.json defines
// the model, its safetensors hold the weights, its tokenizer files the tokenizer. Full fine-tune
// with checkpointed layers, the chunked loss, and 8-bit AdamW stepped inside backward; then the
// model is written back as a folder transformers loads (config.json, model.safetensors, tokenizer).
//
//   ./finetune_hf HF_FOLDER TEXT_FILE OUT_FOLDER [steps]
//
// Needs frugal::frugal (models, tokenizers).
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>

#include "frugal/data/tokenizer.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/optim/optimizer.h"

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s HF_FOLDER TEXT_FILE OUT_FOLDER [steps]\n", argv[0]);
    return 2;
  }
  const std::string folder = argv[1], text_file = argv[2], out = argv[3];
  const int steps = argc > 4 ? std::atoi(argv[4]) : 20;
  try {
    frugal::models::Decoder model = frugal::models::load_hf_checkpoint(folder);  // config.json + weights, checked
    const auto tokenizer = frugal::data::Tokenizer::load_folder(folder);
    std::ifstream in(text_file);
    std::stringstream text;
    text << in.rdbuf();
    const std::vector<int32_t> ids = tokenizer.encode(text.str(), /*add_special_tokens=*/true);
    const int64_t batch = 4, seq = 64;
    if (static_cast<int64_t>(ids.size()) < seq + 2) throw std::invalid_argument(text_file + " has too few tokens");
    const torch::Tensor stream = torch::tensor(std::vector<int64_t>(ids.begin(), ids.end()));

    model->set_checkpointing(frugal::checkpoint::CheckpointPolicy::full());
    const auto loss_options = frugal::models::LossOptions().chunked(true).chunk_size(256);
    auto tracker = frugal::memory::Tracker::create(/*keep_events=*/false);
    tracker->watch(*model);
    frugal::memory::TrackingGuard tracking(tracker);
    frugal::optim::Optimizer optimizer(model->named_parameters(),  // by name: the state dict says whose state is whose
                                       frugal::optim::AdamWOptions(1e-3)
                                           .betas({0.9, 0.95})
                                           .weight_decay(0.0)
                                           .state_precision(frugal::optim::StatePrecision::int8)
                                           .mode(frugal::optim::Mode::in_backward)
                                           .clip(frugal::optim::Clip::per_param_norm));
    torch::manual_seed(0);
    double first = 0, last = 0;
    for (int step = 0; step < steps; ++step) {
      const torch::Tensor starts = torch::randint(stream.size(0) - seq - 1, {batch});
      std::vector<torch::Tensor> rows;
      for (int64_t b = 0; b < batch; ++b) rows.push_back(stream.narrow(0, starts[b].item<int64_t>(), seq + 1));
      const torch::Tensor window = torch::stack(rows);
      const torch::Tensor loss = model->loss(window.narrow(1, 0, seq), window.narrow(1, 1, seq), loss_options);
      optimizer.backward(loss);
      optimizer.step();
      optimizer.zero_grad();
      (step == 0 ? first : last) = loss.item<double>();
      if (step % 5 == 0 || step == steps - 1) std::printf("step %d loss %.4f\n", step, loss.item<double>());
    }
    std::cout << "memory: " << tracker->report() << "\n";
    frugal::models::save_hf_checkpoint(*model, out);
    tokenizer.save_folder(out);
    std::printf("loss %.4f -> %.4f; wrote %s\n", first, last, out.c_str());
    return last < first ? 0 : 1;
  } catch (const std::exception& e) {  // a bad folder or file: one sentence naming it
    std::fprintf(stderr, "finetune_hf: %s\n", e.what());
    return 2;
  }
}
