#include "frugal/data/tokenizer.h"

#include <dlfcn.h>
#include <spawn.h>
#include <sys/wait.h>
#include <limits.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <stdexcept>
#include <vector>

extern char** environ;

namespace frugal {
namespace data {

// The functions of libfrugal_spm.so (see sentencepiece_shim.cpp for why it is loaded privately).
struct SentencePieceApi {
  void* (*load)(const char*, char*, int);
  void (*free_model)(void*);
  int (*encode)(void*, const char*, size_t, int**, size_t*, char*, int);
  int (*decode)(void*, const int*, size_t, char**, size_t*, char*, int);
  void (*free_buffer)(void*);
  int (*piece_size)(void*);
  int (*bos_id)(void*);
  int (*eos_id)(void*);
};

namespace {

std::string executable_dir();

// The first of: $FRUGAL_<ENV>, next to the running executable, in the build folder.
std::vector<std::string> helper_candidates(const char* env, const std::string& file) {
  std::vector<std::string> out;
  if (const char* e = std::getenv(env)) out.push_back(e);
  out.push_back(executable_dir() + "/" + file);
#ifdef FRUGAL_HELPER_DIR
  out.push_back(std::string(FRUGAL_HELPER_DIR) + "/" + file);
#endif
  return out;
}

std::string executable_dir() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return ".";
  std::string path(buf, static_cast<size_t>(n));
  const auto slash = path.find_last_of('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

const SentencePieceApi& api() {
  static std::once_flag once;
  static SentencePieceApi table{};
  static std::string error;
  std::call_once(once, [] {
    const auto candidates = helper_candidates("FRUGAL_SPM_SHIM", "libfrugal_spm.so");
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
    table.load = reinterpret_cast<decltype(table.load)>(sym("frugal_spm_load"));
    table.free_model = reinterpret_cast<decltype(table.free_model)>(sym("frugal_spm_free"));
    table.encode = reinterpret_cast<decltype(table.encode)>(sym("frugal_spm_encode"));
    table.decode = reinterpret_cast<decltype(table.decode)>(sym("frugal_spm_decode"));
    table.free_buffer = reinterpret_cast<decltype(table.free_buffer)>(sym("frugal_spm_free_buffer"));
    table.piece_size = reinterpret_cast<decltype(table.piece_size)>(sym("frugal_spm_piece_size"));
    table.bos_id = reinterpret_cast<decltype(table.bos_id)>(sym("frugal_spm_bos_id"));
    table.eos_id = reinterpret_cast<decltype(table.eos_id)>(sym("frugal_spm_eos_id"));
  });
  if (!table.eos_id) throw std::runtime_error("cannot load SentencePiece (libfrugal_spm.so): " + error);
  return table;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& model_path) {
  const SentencePieceApi& spm = api();
  char err[512] = {};
  void* handle = spm.load(model_path.c_str(), err, sizeof(err));
  if (!handle) throw std::invalid_argument("tokenizer " + model_path + " cannot be loaded: " + err);
  Tokenizer t;
  t.sp_ = std::shared_ptr<void>(handle, [free_model = spm.free_model](void* h) { free_model(h); });
  t.path_ = model_path;
  t.vocab_ = spm.piece_size(handle);
  t.bos_ = spm.bos_id(handle);
  t.eos_ = spm.eos_id(handle);
  return t;
}

std::vector<int32_t> Tokenizer::encode(const std::string& text) const {
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

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
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

void train_tokenizer(const std::vector<std::string>& documents, const std::string& model_prefix,
                     const TokenizerTrainOptions& options) {
  if (documents.empty()) throw std::invalid_argument("tokenizer: no text to train on");
  if (options.vocab_size() < 16) throw std::invalid_argument("tokenizer: vocab_size must be at least 16");
  if (options.model_type() != "bpe" && options.model_type() != "unigram") {
    throw std::invalid_argument("tokenizer: model_type must be bpe or unigram, got '" + options.model_type() + "'");
  }
  // SentencePiece reads sentences from a file, one per line.
  char tmp[] = "/tmp/frugal-tokenizer-corpus-XXXXXX";
  const int fd = ::mkstemp(tmp);
  if (fd < 0) throw std::runtime_error("tokenizer: cannot create a temporary corpus file");
  ::close(fd);
  {
    std::ofstream out(tmp, std::ios::binary);
    for (const std::string& doc : documents) {
      out << doc;
      if (doc.empty() || doc.back() != '\n') out << '\n';
    }
  }
  const std::string args = std::string("--input=") + tmp + " --model_prefix=" + model_prefix +
                           " --vocab_size=" + std::to_string(options.vocab_size()) +
                           " --model_type=" + options.model_type() +
                           " --character_coverage=" + std::to_string(options.character_coverage()) +
                           " --byte_fallback=" + (options.byte_fallback() ? "true" : "false") +
                           " --input_sentence_size=" + std::to_string(options.max_sentences()) +
                           " --shuffle_input_sentence=true --split_digits=true --minloglevel=2"
                           " --bos_id=1 --eos_id=2 --unk_id=0 --pad_id=-1 --hard_vocab_limit=false";
  std::string trainer;
  for (const auto& c : helper_candidates("FRUGAL_SPM_TRAIN", "frugal-spm-train")) {
    if (::access(c.c_str(), X_OK) == 0) {
      trainer = c;
      break;
    }
  }
  if (trainer.empty()) {
    std::remove(tmp);
    throw std::runtime_error("tokenizer: cannot find the frugal-spm-train helper next to the executable");
  }
  char err_path[] = "/tmp/frugal-tokenizer-log-XXXXXX";
  const int err_fd = ::mkstemp(err_path);
  pid_t pid = -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (err_fd >= 0) {
    posix_spawn_file_actions_adddup2(&actions, err_fd, STDERR_FILENO);
    posix_spawn_file_actions_adddup2(&actions, err_fd, STDOUT_FILENO);
  }
  char* const argv[] = {const_cast<char*>(trainer.c_str()), const_cast<char*>(args.c_str()), nullptr};
  const int spawn_rc = ::posix_spawn(&pid, trainer.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  int status = 0;
  if (spawn_rc == 0) ::waitpid(pid, &status, 0);
  std::string log;
  if (err_fd >= 0) {
    ::close(err_fd);
    std::ifstream in(err_path);
    log.assign(std::istreambuf_iterator<char>(in), {});
    std::remove(err_path);
  }
  std::remove(tmp);
  if (spawn_rc != 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const auto last = log.find_last_not_of("\n");
    const auto start = log.find_last_of('\n', last == std::string::npos ? 0 : last);
    throw std::runtime_error("tokenizer: training failed: " +
                             (log.empty() ? std::string("the trainer did not run") : log.substr(start == std::string::npos ? 0 : start + 1)));
  }
}

}  // namespace data
}  // namespace frugal
