// frugal-spm-train: trains a SentencePiece model in its own process. Usage: frugal-spm-train ARGS
// where ARGS is SentencePiece's flag string. Run by frugal::data::train_tokenizer; a process of
// its own because SentencePiece's trainer logs through iostreams, which do not survive the
// private loading the in-process tokenizer needs (see sentencepiece_shim.cpp).
#include <sentencepiece_trainer.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: frugal-spm-train 'SENTENCEPIECE FLAGS'\n";
    return 2;
  }
  // Die with the parent: a killed `frugal tokenizer train` must not leave a trainer running. The
  // parent may already be gone before prctl took effect, hence the check after it.
  if (const char* parent = std::getenv("FRUGAL_SPM_PARENT")) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (std::to_string(::getppid()) != parent) return 1;
  }
  const auto status = sentencepiece::SentencePieceTrainer::Train(argv[1]);
  if (!status.ok()) {
    // The message without the source location SentencePiece puts in front ("x.cc(428) [cond] ").
    std::string why = status.message() ? status.message() : status.ToString();
    const auto cc = why.find(".cc(");
    if (cc != std::string::npos) {
      const auto close = why.find(") ", cc);
      if (close != std::string::npos) why = why.substr(close + 2);
      if (!why.empty() && why[0] == '[') {
        // "[condition] reason"; some checks carry no reason, and then the condition is all there is.
        const auto end = why.find("] ");
        if (end != std::string::npos) {
          const std::string condition = why.substr(1, end - 1), reason = why.substr(end + 2);
          why = reason.find_first_not_of(' ') != std::string::npos ? reason : "its check failed: " + condition;
        }
      }
    }
    std::cerr << "\nfrugal-spm-train: error: " << why << "\n";
    return 1;
  }
  return 0;
}
