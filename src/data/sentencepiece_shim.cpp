// A C interface to libsentencepiece, built as its own shared library (libfrugal_spm.so) and
// loaded with dlopen(RTLD_LOCAL | RTLD_DEEPBIND). Debian's libsentencepiece carries its own copy of
// protobuf-lite and exports its symbols; linked into the same process as LibTorch (which uses
// libprotobuf), the two copies bind to each other's symbols and the process crashes while
// loading. Loaded privately, each keeps its own. (Training logs through iostreams, which break
// under RTLD_DEEPBIND, so it runs in the frugal-spm-train helper process instead.)
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

void set_error(char* err, int errlen, const std::string& msg) {
  if (!err || errlen <= 0) return;
  std::strncpy(err, msg.c_str(), static_cast<size_t>(errlen) - 1);
  err[errlen - 1] = '\0';
}

}  // namespace

extern "C" {

// From the model's bytes, which the caller read through io::open_regular_file (SentencePiece's own
// Load(path) would block on a FIFO and read a device to the end).
void* frugal_spm_load_bytes(const char* data, size_t len, char* err, int errlen) {
  auto* sp = new sentencepiece::SentencePieceProcessor();
  const auto status = sp->LoadFromSerializedProto(absl::string_view(data, len));
  if (!status.ok()) {
    set_error(err, errlen, status.ToString());
    delete sp;
    return nullptr;
  }
  return sp;
}

void frugal_spm_free(void* handle) { delete static_cast<sentencepiece::SentencePieceProcessor*>(handle); }

// *ids is malloc'ed; the caller frees it with frugal_spm_free_buffer.
int frugal_spm_encode(void* handle, const char* text, size_t len, int** ids, size_t* n, char* err, int errlen) {
  std::vector<int> out;
  const auto status = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->Encode(std::string(text, len), &out);
  if (!status.ok()) {
    set_error(err, errlen, status.ToString());
    return 1;
  }
  *n = out.size();
  *ids = static_cast<int*>(std::malloc(std::max<size_t>(1, out.size()) * sizeof(int)));
  if (!out.empty()) std::memcpy(*ids, out.data(), out.size() * sizeof(int));
  return 0;
}

int frugal_spm_decode(void* handle, const int* ids, size_t n, char** text, size_t* len, char* err, int errlen) {
  std::string out;
  const auto status = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->Decode(std::vector<int>(ids, ids + n), &out);
  if (!status.ok()) {
    set_error(err, errlen, status.ToString());
    return 1;
  }
  *len = out.size();
  *text = static_cast<char*>(std::malloc(out.size() + 1));
  std::memcpy(*text, out.data(), out.size());
  (*text)[out.size()] = '\0';
  return 0;
}

void frugal_spm_free_buffer(void* p) { std::free(p); }

int frugal_spm_piece_size(void* handle) { return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->GetPieceSize(); }
int frugal_spm_bos_id(void* handle) { return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->bos_id(); }
int frugal_spm_piece_to_id(void* handle, const char* piece) {
  auto* sp = static_cast<sentencepiece::SentencePieceProcessor*>(handle);
  const int id = sp->PieceToId(piece);
  return id == sp->unk_id() && sp->IdToPiece(id) != piece ? -1 : id;
}
// Copies the piece (NUL-terminated, cut to len - 1 bytes); returns its full length.
int frugal_spm_id_to_piece(void* handle, int id, char* out, int len) {
  const std::string& p = static_cast<sentencepiece::SentencePieceProcessor*>(handle)->IdToPiece(id);
  set_error(out, len, p);
  return static_cast<int>(p.size());
}
int frugal_spm_eos_id(void* handle) { return static_cast<sentencepiece::SentencePieceProcessor*>(handle)->eos_id(); }

}  // extern "C"
