// frugal-spm-train: trains a SentencePiece model in its own process. Usage: frugal-spm-train ARGS
// where ARGS is SentencePiece's flag string. Run by frugal::data::train_tokenizer; a process of
// its own because SentencePiece's trainer logs through iostreams, which do not survive the
// private loading the in-process tokenizer needs (see sentencepiece_shim.cpp).
#include <sentencepiece_trainer.h>

#include <iostream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: frugal-spm-train 'SENTENCEPIECE FLAGS'\n";
    return 2;
  }
  const auto status = sentencepiece::SentencePieceTrainer::Train(argv[1]);
  if (!status.ok()) {
    std::cerr << status.ToString() << "\n";
    return 1;
  }
  return 0;
}
