// frugal generate — continue a prompt (text, or token ids) with a checkpoint's model.
//   frugal generate --checkpoint out/tiny --prompt "A fool" --max-new-tokens 32 --temperature 0.8 --top-p 0.9
//   frugal generate --checkpoint hf-dir --prompt-ids 1,2,3 --temperature 0 --json-out gen.json
// Stops at an end-of-sequence id (the tokenizer's, and the folder's generation_config.json or
// config.json eos_token_id), at --max-new-tokens, or when the model's max_seq_len is full.
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/io/json.h"
#include "frugal/models/generation.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace cli {

int run_generate(int argc, char** argv) {
  std::string dir, prompt, prompt_ids_text, json_out, dtype = "auto";
  int64_t tokens = 64, top_k = 40, seed = 0;
  double temperature = 0.8, top_p = 1.0;
  Args args("generate", "Continue a prompt with a checkpoint: a Hugging Face folder, a frugal step-N folder, or a run's out_dir.");
  args.add_string("checkpoint", &dir, "a run folder (its latest checkpoint is used) or a checkpoint folder", "DIR");
  args.add_string("prompt", &prompt, "text to continue (encoded with the checkpoint's tokenizer, BOS first)", "TEXT");
  args.add_string("prompt-ids", &prompt_ids_text, "token ids to continue, as given (no BOS added): 1,2,3", "IDS");
  args.add_int("max-new-tokens", &tokens, "how many tokens to generate at most", 0, int64_t{1} << 24);
  args.add_int("tokens", &tokens, "the same as --max-new-tokens", 0, int64_t{1} << 24);
  args.add_double("temperature", &temperature, "sampling temperature (0: greedy)", 0.0, 100.0);
  args.add_int("top-k", &top_k, "sample among the k likeliest tokens (0: all)", 0, (int64_t{1} << 31) - 1);
  args.add_double("top-p", &top_p,
                  "sample among the likeliest tokens whose probability adds up to P (below 1e-6 all but the likeliest are dropped anyway)",
                  1e-6, 1.0, "P");
  args.add_int("seed", &seed, "random seed (the same seed, the same tokens)", 0, kMaxSeed);
  args.add_string("dtype", &dtype, "auto (the checkpoint's own, as transformers loads it), fp32 or bf16", "DTYPE");
  args.add_output("json-out", &json_out, "also write {prompt_ids, tokens, text, stop} as JSON");
  if (!args.parse(argc, argv, 2)) return 0;
  if (!json_out.empty()) check_output_path("json-out", json_out);
  if (!prompt_ids_text.empty() && !prompt.empty()) throw UsageError("--prompt and --prompt-ids exclude each other: give one");
  const auto options = models::GenerationOptions()
                           .max_new_tokens(tokens)
                           .temperature(temperature)
                           .top_k(top_k)
                           .top_p(top_p)
                           .seed(static_cast<uint64_t>(seed));
  try {
    options.validate();
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  std::vector<int32_t> prompt_ids;  // read before the checkpoint is loaded: a bad id is refused before any work
  if (!prompt_ids_text.empty()) {
    prompt_ids = parse_ids(prompt_ids_text, "--prompt-ids");
    if (prompt_ids.empty()) throw UsageError("--prompt-ids holds no ids");
  }
  const at::TensorOptions weights = weights_dtype_option(dtype, /*allow_auto=*/true);
  const std::string step_dir = resolve_checkpoint_dir(dir);
  models::Decoder model;
  std::optional<data::Tokenizer> tok;
  std::vector<int32_t> eos;
  try {
    model = models::load_hf_checkpoint(step_dir, weights);  // the config's sizes checked against the weights first
    tok = load_checkpoint_tokenizer(step_dir);
    eos = models::checkpoint_eos_ids(step_dir);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  models::Generation g;
  if (!prompt_ids_text.empty()) {
    if (tok && tok->eos_id() >= 0) eos.push_back(tok->eos_id());
    g = models::generate_ids(*model, prompt_ids, models::GenerationOptions(options).eos_ids(eos));
    if (tok) {
      std::vector<int32_t> all = prompt_ids;
      all.insert(all.end(), g.tokens.begin(), g.tokens.end());
      g.text = tok->decode(all);
    }
  } else {
    if (!tok) throw UsageError("--checkpoint " + step_dir + " has no tokenizer.model: give the prompt as --prompt-ids");
    prompt_ids = tok->encode(prompt);
    if (tok->bos_id() >= 0) prompt_ids.insert(prompt_ids.begin(), tok->bos_id());
    g = models::generate(*model, *tok, prompt, models::GenerationOptions(options).eos_ids(eos));
  }
  if (tok) {
    std::cout << g.text << "\n";
  } else {
    for (size_t i = 0; i < g.tokens.size(); ++i) std::cout << (i ? " " : "") << g.tokens[i];
    std::cout << "\n";
  }
  if (!json_out.empty()) {
    std::ostringstream s;
    io::JsonWriter w(s);
    w.begin_object().key("prompt_ids").begin_array();
    for (int32_t id : prompt_ids) w.value(static_cast<int64_t>(id));
    w.end_array().key("tokens").begin_array();
    for (int32_t id : g.tokens) w.value(static_cast<int64_t>(id));
    w.end_array().key("text");
    if (tok)
      w.value(g.text);
    else
      w.null();
    w.key("stop").value(models::generation_stop_key(g.stop)).end_object();
    s << "\n";
    write_output(json_out, s.str());
  }
  // On stderr, so the text on stdout stays clean for pipes; an early stop is never silent.
  std::string why = models::generation_stop_name(g.stop);
  if (g.stop == models::GenerationStop::context_full) {
    why += " (max_seq_len " + std::to_string(model->config().max_seq_len) + " tokens, prompt included)";
  }
  std::cerr << "frugal generate: " << g.tokens.size() << " of " << tokens << " tokens; stopped: " << why << "\n";
  return 0;
}

}  // namespace cli
}  // namespace frugal
