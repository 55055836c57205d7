#include "frugal/train/run_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "frugal/data/tokenizer.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/safetensors.h"
#include "frugal/io/tensor_values.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace train {
namespace {

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
  return buf;
}

bool is_step_folder_name(const std::string& n) { return n.rfind("step-", 0) == 0 && n.size() == 13; }

// One rank's optimizer file in a checkpoint of a data-parallel run.
std::string shard_file_name(int64_t rank, int64_t world_size) {
  char buf[96];
  std::snprintf(buf, sizeof(buf), "optimizer.rank-%05lld-of-%05lld.safetensors", static_cast<long long>(rank),
                static_cast<long long>(world_size));
  return buf;
}

}  // namespace

std::string rng_state_to_hex() {
  const at::Tensor state = at::detail::getDefaultCPUGenerator().get_state();
  const auto* p = state.data_ptr<uint8_t>();
  static const char* digits = "0123456789abcdef";
  std::string hex;
  hex.reserve(static_cast<size_t>(state.numel()) * 2);
  for (int64_t i = 0; i < state.numel(); ++i) {
    hex += digits[p[i] >> 4];
    hex += digits[p[i] & 15];
  }
  return hex;
}

int64_t rng_state_bytes() { return at::detail::getDefaultCPUGenerator().get_state().numel(); }

void rng_state_from_hex(const std::string& hex) {
  // set_state's own complaint names a LibTorch struct; say what is wrong in our terms.
  const int64_t want = rng_state_bytes();
  if (static_cast<int64_t>(hex.size()) != 2 * want) {
    throw std::invalid_argument("the RNG state has " + std::to_string(hex.size()) + " hex digits; the CPU generator's has " +
                                std::to_string(2 * want));
  }
  at::Tensor state = at::empty({want}, at::kByte);
  auto* p = state.data_ptr<uint8_t>();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::invalid_argument("the RNG state holds a character that is not a lower-case hex digit");
  };
  for (size_t i = 0; i < hex.size() / 2; ++i) p[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  at::Generator gen = at::detail::getDefaultCPUGenerator();  // shares the default generator
  gen.set_state(state);
}

namespace {

// A step that left a parameter NaN or infinite must not become `latest`: a resume would continue
// from it and every later step would be lost too. Every rank checks (the parameters are the same on
// each), so all stop together before the first collective of the save.
void check_parameters_finite(models::DecoderImpl& model, int64_t step) {
  for (const auto& p : model.named_parameters()) {
    if (!io::all_finite(p.value())) {
      throw std::runtime_error("step " + std::to_string(step) + " made parameter '" + p.key() +
                               "' not finite (NaN or infinity); its checkpoint was not saved, so the last one saved stays latest");
    }
  }
}

}  // namespace

std::string save_run_state(const std::string& out_dir, const RunState& state, models::DecoderImpl& model, const optim::Optimizer& optimizer,
                           const std::string& recipe_yaml, const std::string& tokenizer_path, int64_t keep, dist::Group* group) {
  check_parameters_finite(model, state.step);
  const bool sharded = group && group->size() > 1;
  const bool rank0 = !group || group->rank() == 0;
  const std::string name = step_name(state.step);
  const std::string final_dir = out_dir + "/" + name;
  // The temporary folder carries rank 0's PID (a stale one is recognised by it); the others learn it.
  at::Tensor pid = at::full({1}, static_cast<int64_t>(::getpid()), at::kLong);
  if (rank0) {
    io::make_directories(out_dir);
    io::remove_tree(out_dir + "/." + name + ".tmp-" + std::to_string(::getpid()));
    io::make_directories(out_dir + "/." + name + ".tmp-" + std::to_string(::getpid()));
  }
  if (sharded) group->broadcast_async(pid, 0, "the start of checkpoint " + name)();
  const std::string tmp_dir = out_dir + "/." + name + ".tmp-" + std::to_string(pid.item<int64_t>());
  if (sharded) {
    // Each rank's own parameters' state, then rank 0 goes on once every file is in place.
    save_optimizer_state(tmp_dir + "/" + shard_file_name(group->rank(), group->size()), optimizer);
    group->barrier("the writing of checkpoint " + name);
    if (!rank0) {
      group->barrier("the commit of checkpoint " + name);
      return final_dir;
    }
  }
  try {
    models::save_hf_checkpoint(model, tmp_dir);
    if (sharded) {
      std::ostringstream index;
      io::JsonWriter w(index);
      w.begin_object().key("format").value("frugal optimizer shards").key("world_size").value(group->size()).key("files").begin_array();
      for (int64_t r = 0; r < group->size(); ++r) {
        w.value(shard_file_name(r, group->size()));
      }
      w.end_array().end_object();
      io::write_file_atomic(tmp_dir + "/optimizer_index.json", index.str());
    } else {
      save_optimizer_state(tmp_dir + "/optimizer.safetensors", optimizer);
    }
    std::ostringstream json;
    io::JsonWriter w(json);
    w.begin_object()
        .key("step")
        .value(state.step)
        .key("schedule_step")
        .value(state.schedule_step)
        .key("last_loss")
        .value(state.last_loss)
        .key("rng_cpu")
        .value(state.rng_state_hex)
        .end_object();
    io::write_file_atomic(tmp_dir + "/trainer_state.json", json.str());
    io::write_file_atomic(tmp_dir + "/recipe.yaml", recipe_yaml);
    // The tokenizer as AutoTokenizer reads it back (tokenizer.json, tokenizer.model when there is
    // one, tokenizer_config.json): the checkpoint is a model folder whole.
    if (!tokenizer_path.empty()) data::Tokenizer::load(tokenizer_path).save_folder(tmp_dir);
    io::sync_directory(tmp_dir);
    io::remove_tree(final_dir);  // a same-step folder left by an earlier attempt
    if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) throw std::runtime_error("cannot move " + tmp_dir + " into place");
  } catch (...) {
    io::remove_tree(tmp_dir);  // a failed save (a full disk) leaves nothing behind
    throw;
  }
  struct CommitBarrier {  // the other ranks return once the checkpoint is committed (or this one failed)
    dist::Group* group;
    ~CommitBarrier() {
      if (group) group->barrier("the commit of the checkpoint");
    }
  };
  const CommitBarrier committed{sharded ? group : nullptr};
  io::sync_directory(out_dir);
  io::write_file_atomic(out_dir + "/latest", name + "\n");
  // Prune all but the newest `keep` checkpoints.
  std::vector<std::string> steps;
  if (DIR* dir = ::opendir(out_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (is_step_folder_name(n)) steps.push_back(n);
    }
    ::closedir(dir);
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    if (steps[i] != name) io::remove_tree(out_dir + "/" + steps[i]);
  }
  return final_dir;
}

int64_t checkpoint_bytes(int64_t tensor_bytes, const std::string& tokenizer_path) {
  struct stat st {};
  const int64_t tokenizer = !tokenizer_path.empty() && ::stat(tokenizer_path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : 0;
  return tensor_bytes + 2 * tokenizer + (int64_t{1} << 20);
}

namespace {

// The sizes of the files directly in `dir` (a checkpoint folder is flat).
int64_t folder_bytes(const std::string& dir) {
  int64_t total = 0;
  DIR* d = ::opendir(dir.c_str());
  if (!d) return 0;
  while (dirent* e = ::readdir(d)) {
    struct stat st {};
    if (::fstatat(::dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode)) total += static_cast<int64_t>(st.st_size);
  }
  ::closedir(d);
  return total;
}

}  // namespace

int64_t checkpoint_space_needed(const std::string& out_dir, const std::vector<int64_t>& saves, int64_t bytes, int64_t keep) {
  std::map<std::string, int64_t> on_disk;  // step folder -> bytes, in save_run_state's pruning order
  if (DIR* dir = ::opendir(out_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (is_step_folder_name(n)) on_disk[n] = folder_bytes(out_dir + "/" + n);
    }
    ::closedir(dir);
  }
  int64_t grown = 0, most = 0;
  for (int64_t step : saves) {
    const std::string name = step_name(step);
    grown += bytes;  // the new folder, whole, beside a same-step one
    most = std::max(most, grown);
    const auto same = on_disk.find(name);
    if (same != on_disk.end()) grown -= same->second;
    on_disk[name] = bytes;
    // The oldest size - keep folders go, the one just written excepted.
    int64_t over = static_cast<int64_t>(on_disk.size()) - keep;
    for (auto it = on_disk.begin(); over > 0 && it != on_disk.end(); --over) {
      if (it->first == name) {
        ++it;
        continue;
      }
      grown -= it->second;
      it = on_disk.erase(it);
    }
  }
  return most;
}

namespace {

bool is_dead_pid_suffix(const std::string& digits) {
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return false;
  const pid_t pid = static_cast<pid_t>(std::stol(digits));
  // Our own PID has written nothing yet: a folder under it is an earlier process's.
  return pid > 0 && (pid == ::getpid() || (::kill(pid, 0) != 0 && errno == ESRCH));
}

}  // namespace

int remove_stale_checkpoint_temps(const std::string& out_dir) {
  int removed = 0;
  DIR* dir = ::opendir(out_dir.c_str());
  if (!dir) return 0;
  std::vector<std::string> stale;
  while (dirent* e = ::readdir(dir)) {
    // Only save_run_state's own names: ".step-NNNNNNNN.tmp-PID".
    const std::string n = e->d_name;
    if (n.size() > 19 && n.rfind(".step-", 0) == 0 && n.compare(14, 5, ".tmp-") == 0 &&
        n.substr(6, 8).find_first_not_of("0123456789") == std::string::npos && is_dead_pid_suffix(n.substr(19))) {
      stale.push_back(n);
    }
  }
  ::closedir(dir);
  for (const auto& n : stale) {
    io::remove_tree(out_dir + "/" + n);
    ++removed;
  }
  return removed;
}

std::string latest_checkpoint(const std::string& out_dir) {
  const std::string path = out_dir + "/latest";
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "";
  // One short line, read through the one checked opening (a FIFO, a device or a folder is refused
  // by name; a large file by its size); quoted escaped and cut.
  const std::string text = io::read_file(path, io::kPointerFileBytes);
  const std::string name = text.substr(0, text.find('\n'));
  if (name.rfind("step-", 0) != 0 || name.find('/') != std::string::npos || name.find('\0') != std::string::npos) {
    throw std::invalid_argument(path + " does not name a checkpoint (it holds '" + io::printable(name) + "')");
  }
  const std::string dir = out_dir + "/" + name;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::invalid_argument(path + " points at a missing " + io::printable(name));
  }
  return dir;
}

RunState read_trainer_state(const std::string& checkpoint_dir, int64_t max_step) {
  const std::string path = checkpoint_dir + "/trainer_state.json";
  io::JsonValue j;
  try {
    j = io::parse_json(io::read_file(path, io::kMetadataFileBytes));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(path + " is not a JSON object");
  auto field = [&](const char* key) -> const io::JsonValue& {
    const io::JsonValue* v = j.find(key);
    if (!v) throw std::invalid_argument(path + " has no '" + key + "'");
    return *v;
  };
  auto bad = [&](const char* key, const std::string& why) { return std::invalid_argument(path + ": '" + key + "' " + why); };
  auto integer_in = [&](const char* key, int64_t lo, int64_t hi, const std::string& range) {
    const io::JsonValue& v = field(key);
    if (!v.is_integer()) throw bad(key, "must be an integer");
    const int64_t x = v.as_int();
    if (x < lo || x > hi) throw bad(key, "is " + std::to_string(x) + ", outside " + range);
    return x;
  };
  RunState s;
  s.step = integer_in("step", 0, max_step, "[0, train.steps = " + std::to_string(max_step) + "]");
  // The folder's name is the step it was saved at: a mismatch means the file was edited or moved.
  std::string folder = checkpoint_dir;
  while (folder.size() > 1 && folder.back() == '/') folder.pop_back();
  folder = folder.substr(folder.find_last_of('/') + 1);
  if (folder.rfind("step-", 0) == 0 && folder != step_name(s.step)) {
    throw bad("step", "is " + std::to_string(s.step) + " but the folder is " + folder);
  }
  s.schedule_step = integer_in("schedule_step", 0, s.step, "[0, step = " + std::to_string(s.step) + "]");
  const io::JsonValue& loss = field("last_loss");
  if (!loss.is_null() && !loss.is_number()) throw bad("last_loss", "must be a number");
  s.last_loss = loss.is_null() ? 0.0 : loss.as_double();
  if (!std::isfinite(s.last_loss)) throw bad("last_loss", "is not a finite number");
  const io::JsonValue& rng = field("rng_cpu");
  if (!rng.is_string()) throw bad("rng_cpu", "must be a string");
  s.rng_state_hex = rng.as_string();
  if (static_cast<int64_t>(s.rng_state_hex.size()) != 2 * rng_state_bytes()) {
    throw bad("rng_cpu", "has " + std::to_string(s.rng_state_hex.size()) + " hex digits; the CPU generator's state has " +
                             std::to_string(2 * rng_state_bytes()));
  }
  if (s.rng_state_hex.find_first_not_of("0123456789abcdef") != std::string::npos) throw bad("rng_cpu", "is not lower-case hex");
  return s;
}

RunState load_run_state(const std::string& checkpoint_dir, models::DecoderImpl& model, optim::Optimizer& optimizer, int64_t max_step) {
  // The cheap checks first; nothing is applied to the process (RNG) until everything has loaded.
  const RunState s = read_trainer_state(checkpoint_dir, max_step);
  models::load_hf_weights(model, checkpoint_dir);
  load_checkpoint_optimizer_state(checkpoint_dir, optimizer, /*require_state=*/s.step > 0);
  return s;
}

void save_optimizer_state(const std::string& path, const optim::Optimizer& optimizer) {
  // state_dict() refers to the live state and the writer copies one tensor at a time (to the CPU
  // when it lives elsewhere), so no second copy of the whole state is made.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, tensor] : optimizer.state_dict()) tensors.emplace_back(name, tensor);
  // State in files (file placement) is mapped in as the writer reads it: dropped again tensor by tensor.
  io::write_safetensors(path, tensors, {}, [&tensors](size_t i) { optim::release_state_pages(tensors[i].second); });
}

void load_checkpoint_optimizer_state(const std::string& dir, optim::Optimizer& optimizer, bool require_state) {
  const std::string index_path = dir + "/optimizer_index.json";
  struct stat st {};
  if (::stat(index_path.c_str(), &st) != 0) {
    load_optimizer_state(dir + "/optimizer.safetensors", optimizer, require_state);
    return;
  }
  io::JsonValue j;
  try {
    j = io::parse_json(io::read_file(index_path, io::kMetadataFileBytes));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(index_path + ": " + e.what());
  }
  const io::JsonValue* files = j.is_object() ? j.find("files") : nullptr;
  if (!files || !files->is_array() || files->items().empty() || files->items().size() > 4096) {
    throw std::invalid_argument(index_path + " must be an object whose 'files' lists 1 to 4096 optimizer files");
  }
  // Every file opened (and its header checked) up front; entries are read one parameter at a time.
  std::vector<std::unique_ptr<io::SafetensorsReader>> readers;
  std::map<std::string, const io::SafetensorsReader*> holder;
  optim::StateDictSource source;
  try {
    for (size_t i = 0; i < files->items().size(); ++i) {
      const io::JsonValue& f = files->items()[i];
      if (!f.is_string() || f.as_string().empty() || f.as_string().find('/') != std::string::npos || f.as_string()[0] == '.') {
        throw std::invalid_argument(index_path + ": files[" + std::to_string(i) + "] must be a file name in the checkpoint's folder");
      }
      readers.push_back(std::make_unique<io::SafetensorsReader>(dir + "/" + f.as_string()));
      for (const auto& t : readers.back()->tensors()) {
        source.entries.emplace_back(t.name, t.shape);  // a name in two files is refused by load_state as repeated
        holder.emplace(t.name, readers.back().get());
      }
    }
  } catch (const io::SafetensorsError& e) {
    throw std::invalid_argument(e.what());
  }
  if (require_state && source.entries.empty()) throw std::invalid_argument(index_path + " lists files that hold no optimizer state");
  source.load = [&holder](const std::string& name) { return holder.at(name)->load(name); };
  try {
    optimizer.load_state(source);
  } catch (const io::SafetensorsError& e) {
    throw std::invalid_argument(e.what());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(index_path + ": " + e.what());
  }
}

void load_optimizer_state(const std::string& path, optim::Optimizer& optimizer, bool require_state) {
  try {
    io::SafetensorsReader file(path);
    // After a step every parameter has state: an empty file would silently restart the optimizer.
    if (require_state && file.tensors().empty()) throw std::invalid_argument(path + " holds no optimizer state");
    optim::StateDictSource source;
    for (const auto& t : file.tensors()) source.entries.emplace_back(t.name, t.shape);
    source.load = [&file](const std::string& name) { return file.load(name); };
    optimizer.load_state(source);  // checks the header, then reads one parameter's entries at a time
  } catch (const io::SafetensorsError& e) {
    throw std::invalid_argument(e.what());
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    if (what.rfind(path, 0) == 0) throw;
    throw std::invalid_argument(path + ": " + what);
  }
}

}  // namespace train
}  // namespace frugal
