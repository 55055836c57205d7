#include "frugal/data/tokenizer.h"

#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <limits.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "frugal/data/hf_tokenizer.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "fingerprint.h"
#include "hf_pipeline.h"

extern char** environ;

namespace frugal {
namespace data {

// The functions of libfrugal_spm.so (see sentencepiece_shim.cpp for why it is loaded privately).
struct SentencePieceApi {
  void* (*load_bytes)(const char*, size_t, char*, int);
  void (*free_model)(void*);
  int (*encode)(void*, const char*, size_t, int**, size_t*, char*, int);
  int (*decode)(void*, const int*, size_t, char**, size_t*, char*, int);
  void (*free_buffer)(void*);
  int (*piece_size)(void*);
  int (*bos_id)(void*);
  int (*eos_id)(void*);
  int (*piece_to_id)(void*, const char*);
  int (*id_to_piece)(void*, int, char*, int);
};

namespace {

const SentencePieceApi& api() {
  static std::once_flag once;
  static SentencePieceApi table{};
  static std::string error;
  std::call_once(once, [] {
    const auto candidates = io::helper_candidates("FRUGAL_SPM_SHIM", "libfrugal_spm.so");
    void* lib = nullptr;
    for (const auto& c : candidates) {
      lib = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (lib) break;
      error = ::dlerror();
    }
    if (!lib) return;
    auto sym = [&](const char* name) {
      void* p = ::dlsym(lib, name);
      if (!p) error = std::string("libfrugal_spm.so lacks ") + name;
      return p;
    };
    table.load_bytes = reinterpret_cast<decltype(table.load_bytes)>(sym("frugal_spm_load_bytes"));
    table.free_model = reinterpret_cast<decltype(table.free_model)>(sym("frugal_spm_free"));
    table.encode = reinterpret_cast<decltype(table.encode)>(sym("frugal_spm_encode"));
    table.decode = reinterpret_cast<decltype(table.decode)>(sym("frugal_spm_decode"));
    table.free_buffer = reinterpret_cast<decltype(table.free_buffer)>(sym("frugal_spm_free_buffer"));
    table.piece_size = reinterpret_cast<decltype(table.piece_size)>(sym("frugal_spm_piece_size"));
    table.bos_id = reinterpret_cast<decltype(table.bos_id)>(sym("frugal_spm_bos_id"));
    table.piece_to_id = reinterpret_cast<decltype(table.piece_to_id)>(sym("frugal_spm_piece_to_id"));
    table.id_to_piece = reinterpret_cast<decltype(table.id_to_piece)>(sym("frugal_spm_id_to_piece"));
    table.eos_id = reinterpret_cast<decltype(table.eos_id)>(sym("frugal_spm_eos_id"));
  });
  if (!table.eos_id) throw std::runtime_error("cannot load SentencePiece (libfrugal_spm.so): " + error);
  return table;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_directory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
  if (is_directory(path)) return load_folder(path);
  if (ends_with(path, ".json")) return load_json(path);
  return load_sentencepiece(path);
}

Tokenizer Tokenizer::load_json(const std::string& json_path) {
  Tokenizer t;
  t.hf_ = std::make_shared<const HfTokenizer>(HfTokenizer::load(json_path));
  t.path_ = json_path;
  t.vocab_ = t.hf_->vocab_size();
  // Without tokenizer_config.json: BOS from the post-processor's template, EOS by its usual names.
  const auto& prefix = t.hf_->prefix_ids();
  if (!prefix.empty()) t.bos_ = prefix.front();
  for (const char* name : {"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"}) {
    if (t.bos_ < 0) t.bos_ = t.hf_->token_to_id(name);
  }
  for (const char* name : {"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|im_end|>"}) {
    if (t.eos_ < 0) t.eos_ = t.hf_->token_to_id(name);
  }
  t.add_bos_ = t.bos_ >= 0 && !prefix.empty() && prefix.front() == t.bos_;
  t.add_eos_ = t.eos_ >= 0 && !t.hf_->suffix_ids().empty() && t.hf_->suffix_ids().back() == t.eos_;
  t.fingerprint_ = fnv1a64("json:" + t.hf_->json());
  std::function<bool(const io::JsonValue&)> prepends = [&](const io::JsonValue& v) -> bool {
    if (!v.is_object()) return false;
    const io::JsonValue* type = v.find("type");
    const std::string ty = type && type->is_string() ? type->as_string() : "";
    if (ty == "Prepend") return true;
    // Metaspace is not one: it adds its mark only to a text that does not start with one already
    // (" word" and "word" both give "▁word", as in `tokenizers`), so a later piece keeps its space.
    for (const char* list : {"normalizers", "pretokenizers"}) {
      if (const io::JsonValue* l = v.find(list); l && l->is_array()) {
        for (const auto& x : l->items())
          if (prepends(x)) return true;
      }
    }
    return false;
  };
  const io::JsonValue root = io::parse_json(t.hf_->json());
  for (const char* stage : {"normalizer", "pre_tokenizer"}) {
    if (const io::JsonValue* v = root.find(stage)) t.prepends_space_ = t.prepends_space_ || prepends(*v);
  }
  return t;
}

bool Tokenizer::folder_has_tokenizer(const std::string& dir) {
  return io::path_exists(dir + "/tokenizer.json") || io::path_exists(dir + "/tokenizer.model");
}

namespace {

// Every field of tokenizer_config.json changes the ids or text as transformers means it, changes
// nothing frugal computes, or is refused by name.
void check_tokenizer_config_fields(const io::JsonValue& config, const std::string& path, bool has_tokenizer_json) {
  // Honoured where the folder is loaded (bos/eos, whether they are added, decode's clean-up).
  static const std::set<std::string> kHonoured = {"bos_token", "eos_token", "add_bos_token", "add_eos_token",
                                                  "clean_up_tokenization_spaces"};
  // Change no id and no decoded text: class names, lengths and sides for padding and truncation
  // (frugal pads and cuts itself), the other special tokens' names (their ids are in the tokenizer
  // file), added_tokens_decoder (a copy of the tokenizer file's added tokens), and the chat template
  // (the text a chat becomes, not how text becomes ids: data/examples.h reads it for chats, and
  // save_folder writes a string one back).
  static const std::set<std::string> kNeutral = {"tokenizer_class",
                                                 "backend",
                                                 "model_max_length",
                                                 "padding_side",
                                                 "truncation_side",
                                                 "pad_token",
                                                 "unk_token",
                                                 "sep_token",
                                                 "cls_token",
                                                 "mask_token",
                                                 "additional_special_tokens",
                                                 "extra_special_tokens",
                                                 "added_tokens_decoder",
                                                 "model_input_names",
                                                 "chat_template",
                                                 "name_or_path",
                                                 "auto_map",
                                                 "processor_class",
                                                 "use_default_system_prompt"};
  for (const auto& [key, value] : config.members()) {
    if (kHonoured.count(key) || kNeutral.count(key)) continue;
    const bool unset = value.is_null() || (value.is_bool() && !value.as_bool()) || (value.is_object() && value.members().empty());
    // legacy only decides how transformers converts a bare tokenizer.model; with tokenizer.json it is moot.
    if (key == "legacy" && has_tokenizer_json) continue;
    // Neutral when unset: a lower-casing, a prefix space or split special tokens frugal would not apply.
    if ((key == "do_lower_case" || key == "add_prefix_space" || key == "split_special_tokens" || key == "sp_model_kwargs") && unset)
      continue;
    const std::string shown = value.is_bool()     ? (value.as_bool() ? "true" : "false")
                              : value.is_string() ? "'" + value.as_string() + "'"
                              : value.is_number() ? std::to_string(value.as_double())
                                                  : std::string(value.is_object() ? "an object" : "a list");
    throw std::invalid_argument(path + ": field '" + key + "' (" + shown + ") is not supported: frugal would " +
                                "encode differently from transformers (supported: bos_token, eos_token, add_bos_token, " +
                                "add_eos_token, clean_up_tokenization_spaces and fields that change no id)");
  }
}

}  // namespace

Tokenizer Tokenizer::load_folder(const std::string& dir) {
  if (!is_directory(dir)) throw std::invalid_argument("model folder " + dir + " does not exist or is not a folder");
  Tokenizer t;
  if (io::path_exists(dir + "/tokenizer.json"))
    t = load_json(dir + "/tokenizer.json");
  else if (io::path_exists(dir + "/tokenizer.model"))
    t = load_sentencepiece(dir + "/tokenizer.model");
  else
    throw std::invalid_argument("model folder " + dir + " has no tokenizer (neither tokenizer.json nor tokenizer.model)");
  const std::string config_path = dir + "/tokenizer_config.json";
  if (io::path_exists(config_path)) {
    io::JsonValue config;
    try {
      config = io::parse_json(io::read_file(config_path, io::kMetadataFileBytes));
    } catch (const std::exception& e) {
      throw std::invalid_argument(config_path + " is not valid JSON: " + e.what());
    }
    if (!config.is_object()) throw std::invalid_argument(config_path + " must hold a JSON object");
    check_tokenizer_config_fields(config, config_path, io::path_exists(dir + "/tokenizer.json"));
    if (const io::JsonValue* v = config.find("clean_up_tokenization_spaces"); v && !v->is_null()) {
      if (!v->is_bool()) throw std::invalid_argument(config_path + ": clean_up_tokenization_spaces must be true or false");
      t.clean_up_spaces_ = v->as_bool();
    }
    auto token = [&](const char* key, int32_t& id) {
      const io::JsonValue* v = config.find(key);
      if (!v || v->is_null()) return;
      const io::JsonValue* content = v->is_object() ? v->find("content") : v;
      if (!content || !content->is_string()) throw std::invalid_argument(config_path + ": " + key + " must be a token string");
      id = t.token_id(content->as_string());
      if (id < 0)
        throw std::invalid_argument(config_path + ": " + key + " '" + content->as_string() + "' is not in the tokenizer's vocabulary");
    };
    token("bos_token", t.bos_);
    token("eos_token", t.eos_);
    for (const char* key : {"add_bos_token", "add_eos_token"}) {
      const io::JsonValue* v = config.find(key);
      if (!v || v->is_null()) continue;
      if (!v->is_bool()) throw std::invalid_argument(config_path + ": " + key + " must be true or false");
      (key[4] == 'b' ? t.add_bos_ : t.add_eos_) = v->as_bool();
      t.config_add_special_ = true;
    }
    // The chat template is kept to be written back (save_folder); data/examples.h reads it to
    // render chats (folder_chat_template).
    if (const io::JsonValue* v = config.find("chat_template"); v && v->is_string()) t.chat_template_ = v->as_string();
    if (t.eos_ < 0) throw std::invalid_argument(config_path + " names no eos_token and the tokenizer has none of the usual ones");
    t.fingerprint_ = fnv1a64(t.fingerprint_ + "|eos=" + std::to_string(t.eos_));
  }
  // transformers 5 saves the chat template as chat_template.jinja, which wins over the config's.
  if (io::path_exists(dir + "/chat_template.jinja")) t.chat_template_ = io::read_file(dir + "/chat_template.jinja", io::kMetadataFileBytes);
  if (t.eos_ < 0)
    throw std::invalid_argument("tokenizer in " + dir + " has no end-of-sequence token (set eos_token in tokenizer_config.json)");
  if (t.add_bos_ && t.bos_ < 0) t.add_bos_ = false;
  if (t.add_eos_ && t.eos_ < 0) t.add_eos_ = false;
  return t;
}

std::string Tokenizer::token_text(int32_t id) const {
  if (hf_) return hf_->id_to_token(id);
  char buf[512] = {};
  api().id_to_piece(sp_.get(), id, buf, sizeof(buf));
  return buf;
}

int32_t Tokenizer::token_id(const std::string& token) const {
  if (hf_) return hf_->token_to_id(token);
  return api().piece_to_id(sp_.get(), token.c_str());
}

int32_t Tokenizer::token_to_id(const std::string& token) const {
  if (hf_) return hf_->token_to_id(token);
  if (!sp_) return -1;
  const int32_t id = token_id(token);  // SentencePiece answers an unknown piece with <unk>'s id
  return id >= 0 && id < vocab_ && token_text(id) == token ? id : -1;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  if (id < 0 || id >= vocab_ || (!hf_ && !sp_)) return "";
  return token_text(id);
}

void Tokenizer::save_folder(const std::string& dir) const {
  io::make_directories(dir);
  std::string json_text;
  if (hf_) {
    json_text = hf_->json();
  } else {
    io::write_file_atomic(dir + "/tokenizer.model", spm_bytes_);
    try {
      json_text = sentencepiece_to_tokenizer_json(dir + "/tokenizer.model");
    } catch (const std::invalid_argument&) {
      json_text.clear();  // not expressible exactly: AutoTokenizer converts tokenizer.model itself
    }
  }
  if (!json_text.empty()) io::write_file_atomic(dir + "/tokenizer.json", json_text);
  std::ostringstream config;
  io::JsonWriter w(config);
  w.begin_object();
  // PreTrainedTokenizerFast reads tokenizer.json as it is (transformers 5 maps it to TokenizersBackend);
  // without one, LlamaTokenizer converts tokenizer.model.
  w.key("tokenizer_class").value(json_text.empty() ? "LlamaTokenizer" : "PreTrainedTokenizerFast");
  if (bos_ >= 0) w.key("bos_token").value(token_text(bos_));
  if (eos_ >= 0) w.key("eos_token").value(token_text(eos_));
  const int32_t unk = token_id("<unk>");
  if (unk >= 0) w.key("unk_token").value("<unk>");
  w.key("add_bos_token").value(add_bos_).key("add_eos_token").value(add_eos_);
  w.key("clean_up_tokenization_spaces").value(clean_up_spaces_);
  if (!chat_template_.empty()) w.key("chat_template").value(chat_template_);
  w.end_object();
  // transformers 5 reads chat_template.jinja before the config: one left from an earlier save
  // would win over the template written here.
  if (io::path_exists(dir + "/chat_template.jinja")) io::remove_tree(dir + "/chat_template.jinja");
  config << "\n";
  io::write_file_atomic(dir + "/tokenizer_config.json", config.str());
}

Tokenizer Tokenizer::load_sentencepiece(const std::string& model_path) {
  // SentencePiece's own messages for these name its stream internals, not the problem.
  // The bytes read once, through the one checked opening (a FIFO, a device or a folder is refused
  // by name), then handed to SentencePiece.
  std::string bytes = io::read_file(model_path, io::kTokenizerFileBytes, "tokenizer");
  const SentencePieceApi& spm = api();
  char err[512] = {};
  void* handle = spm.load_bytes(bytes.data(), bytes.size(), err, sizeof(err));
  if (!handle) {
    // SentencePiece's reason, unless it is its source location and a failed check ("Internal:
    // ./src/sentencepiece_processor.cc(1101) [model_proto->ParseFromArray(...)]"): no words for a user.
    const std::string why = io::printable(err, 200);
    throw std::invalid_argument("tokenizer " + model_path + " is not a SentencePiece model (" +
                                (why.find(".cc(") != std::string::npos || why.empty() ? "its bytes do not parse as one" : why) + ")");
  }
  Tokenizer t;
  t.sp_ = std::shared_ptr<void>(handle, [free_model = spm.free_model](void* h) { free_model(h); });
  t.path_ = model_path;
  t.vocab_ = spm.piece_size(handle);
  t.bos_ = spm.bos_id(handle);
  t.eos_ = spm.eos_id(handle);
  // Documents end with EOS in the token file: without one the ids would fall outside the vocabulary.
  if (t.eos_ < 0 || t.eos_ >= t.vocab_) throw std::invalid_argument("tokenizer " + model_path + " has no end-of-sequence piece (eos_id)");
  if (t.bos_ >= t.vocab_) t.bos_ = -1;
  t.add_bos_ = t.bos_ >= 0;  // as Llama's
  t.spm_bytes_ = std::move(bytes);
  // add_dummy_prefix (with remove_extra_whitespaces a leading space goes anyway, so dropping one is harmless)
  t.prepends_space_ = hf::sentencepiece_prepends_space(t.spm_bytes_, model_path);
  t.fingerprint_ = fnv1a64("spm:" + t.spm_bytes_);
  return t;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text, bool add_special_tokens) const {
  if (hf_ && (!add_special_tokens || !config_add_special_)) return hf_->encode(text, add_special_tokens);
  std::vector<int32_t> out;
  if (add_special_tokens && add_bos_) out.push_back(bos_);
  if (hf_) {
    const auto ids = hf_->encode(text);
    out.insert(out.end(), ids.begin(), ids.end());
  } else {
    hf::check_utf8(text, "tokenizer: the text");
    const auto ids = encode_sentencepiece(text);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  if (add_special_tokens && add_eos_) out.push_back(eos_);
  return out;
}

std::vector<int32_t> Tokenizer::encode_sentencepiece(const std::string& text) const {
  const SentencePieceApi& spm = api();
  int* ids = nullptr;
  size_t n = 0;
  char err[512] = {};
  if (spm.encode(sp_.get(), text.data(), text.size(), &ids, &n, err, sizeof(err)) != 0) {
    throw std::runtime_error(std::string("tokenizer: cannot encode: ") + err);
  }
  std::vector<int32_t> out(ids, ids + n);
  spm.free_buffer(ids);
  return out;
}

namespace {

// transformers' clean_up_tokenization_spaces: the space a word-level tokenizer left before
// punctuation and English contractions is dropped (" ." -> ".", " n't" -> "n't", ...).
std::string clean_up_tokenization_spaces(std::string text) {
  static const std::pair<const char*, const char*> kRules[] = {{" .", "."},     {" ?", "?"},     {" !", "!"},   {" ,", ","},
                                                               {" ' ", "'"},    {" n't", "n't"}, {" 'm", "'m"}, {" 's", "'s"},
                                                               {" 've", "'ve"}, {" 're", "'re"}};
  for (const auto& [from, to] : kRules) {
    const std::string f(from), t(to);
    std::string out;
    size_t pos = 0;
    for (size_t hit; (hit = text.find(f, pos)) != std::string::npos; pos = hit + f.size()) out.append(text, pos, hit - pos).append(t);
    out.append(text, pos, std::string::npos);
    text.swap(out);
  }
  return text;
}

}  // namespace

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text = decode_raw(ids);
  return clean_up_spaces_ ? clean_up_tokenization_spaces(std::move(text)) : text;
}

std::string Tokenizer::decode_raw(const std::vector<int32_t>& ids) const {
  if (hf_) return hf_->decode(ids);
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_) throw std::invalid_argument("tokenizer: id " + std::to_string(id) + " is outside the vocabulary");
  }
  const SentencePieceApi& spm = api();
  const std::vector<int> in(ids.begin(), ids.end());
  char* text = nullptr;
  size_t len = 0;
  char err[512] = {};
  if (spm.decode(sp_.get(), in.data(), in.size(), &text, &len, err, sizeof(err)) != 0) {
    throw std::runtime_error(std::string("tokenizer: cannot decode: ") + err);
  }
  std::string out(text, len);
  spm.free_buffer(text);
  return out;
}

void train_tokenizer(const std::vector<std::string>& documents, const std::string& model_prefix, const TokenizerTrainOptions& options) {
  if (documents.empty()) throw std::invalid_argument("tokenizer: no text to train on");
  if (options.vocab_size() < 16) throw std::invalid_argument("tokenizer: vocab_size must be at least 16");
  if (options.model_type() != "bpe" && options.model_type() != "unigram") {
    throw std::invalid_argument("tokenizer: model_type must be bpe or unigram, got '" + options.model_type() + "'");
  }
  // SentencePiece reads sentences from a file, one per line: a copy in a temporary folder (with the
  // helper's log), removed on every way out, SIGINT, SIGTERM and SIGHUP included; a folder of a
  // run killed with SIGKILL is removed by the next one (io::TempDir).
  const std::string pid = std::to_string(::getpid());
  const io::TempDir work(kTokenizerTempPrefix);
  const std::string corpus_path = work.path() + "/corpus.txt";
  {
    std::ofstream out(corpus_path, std::ios::binary);
    for (const std::string& doc : documents) {
      out << doc;
      if (doc.empty() || doc.back() != '\n') out << '\n';
    }
    out.flush();
    if (!out) throw std::runtime_error("tokenizer: cannot write the temporary corpus file " + corpus_path);
  }
  const std::string args = std::string("--input=") + corpus_path + " --model_prefix=" + model_prefix +
                           " --vocab_size=" + std::to_string(options.vocab_size()) + " --model_type=" + options.model_type() +
                           " --character_coverage=" + std::to_string(options.character_coverage()) +
                           " --byte_fallback=" + (options.byte_fallback() ? "true" : "false") +
                           " --input_sentence_size=" + std::to_string(options.max_sentences()) +
                           " --shuffle_input_sentence=true --split_digits=true --minloglevel=2"
                           // Whitespace as Llama's tokenizer keeps it: no NFKC, no collapsing of runs
                           // of spaces, whitespace-only pieces allowed; "▁" in front of each text.
                           " --normalization_rule_name=identity --remove_extra_whitespaces=false"
                           " --allow_whitespace_only_pieces=true --add_dummy_prefix=true --split_by_whitespace=true"
                           " --bos_id=1 --eos_id=2 --unk_id=0 --pad_id=-1 --hard_vocab_limit=false";
  std::string trainer;
  for (const auto& c : io::helper_candidates("FRUGAL_SPM_TRAIN", "frugal-spm-train")) {
    if (::access(c.c_str(), X_OK) == 0) {
      trainer = c;
      break;
    }
  }
  if (trainer.empty()) throw std::runtime_error("tokenizer: cannot find the frugal-spm-train helper next to the executable");
  const std::string log_path = work.path() + "/log.txt";
  const int err_fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  pid_t child = -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (err_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, err_fd, STDERR_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err_fd, STDOUT_FILENO);
  }
  // The helper asks to die with us (PR_SET_PDEATHSIG) and checks it still has this parent.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e; ++e) {
    if (std::strncmp(*e, "FRUGAL_SPM_PARENT=", 18) != 0) env_strings.emplace_back(*e);
  }
  env_strings.push_back("FRUGAL_SPM_PARENT=" + pid);
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(&e[0]);
  envp.push_back(nullptr);
  char* const argv[] = {const_cast<char*>(trainer.c_str()), const_cast<char*>(args.c_str()), nullptr};
  const int spawn_rc = ::posix_spawn(&child, trainer.c_str(), &actions, nullptr, argv, envp.data());
  posix_spawn_file_actions_destroy(&actions);
  int status = 0;
  if (spawn_rc == 0) {
    while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
    }
  }
  std::string log;
  if (err_fd >= 0) {
    ::close(err_fd);
    try {
      log = io::read_file(log_path, io::kMetadataFileBytes);
    } catch (const std::invalid_argument&) {
      // a log too large to read: the exit status still says what happened
    }
  }
  if (spawn_rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    // Only the helper's own one-line summary: SentencePiece's log lines name its source files.
    const std::string tag = "frugal-spm-train: error: ";
    const auto at = log.rfind(tag);
    std::string why = "the trainer did not run";
    if (at != std::string::npos) {
      why = log.substr(at + tag.size());
      why = io::printable(why.substr(0, why.find('\n')), 300);
    } else if (spawn_rc == 0) {
      why = "the trainer stopped (" +
            (WIFSIGNALED(status) ? "signal " + std::to_string(WTERMSIG(status)) : "exit status " + std::to_string(WEXITSTATUS(status))) +
            ")";
    }
    // What SentencePiece refuses is the input's fault (too few characters for the vocabulary...).
    if (at != std::string::npos) throw std::invalid_argument("tokenizer: training on the corpus failed: " + why);
    throw std::runtime_error("tokenizer: training failed: " + why);
  }
}

void remove_stale_tokenizer_files(const std::string& dir) {
  io::TempDir::remove_stale(kTokenizerTempPrefix, dir.empty() ? io::TempDir::base() : dir);
}

}  // namespace data
}  // namespace frugal
