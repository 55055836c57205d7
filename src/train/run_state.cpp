#include "frugal/train/run_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/safetensors.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace train {
namespace {

void remove_tree(const std::string& path) {
  DIR* dir = ::opendir(path.c_str());
  if (dir) {
    while (dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = path + "/" + name;
      struct stat st {};
      if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        remove_tree(child);
      } else {
        ::unlink(child.c_str());
      }
    }
    ::closedir(dir);
  }
  ::rmdir(path.c_str());
}

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%08lld", static_cast<long long>(step));
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

void rng_state_from_hex(const std::string& hex) {
  if (hex.empty()) return;
  if (hex.size() % 2) throw std::invalid_argument("trainer state: bad RNG state");
  at::Tensor state = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  auto* p = state.data_ptr<uint8_t>();
  auto nibble = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::invalid_argument("trainer state: bad RNG state");
  };
  for (size_t i = 0; i < hex.size() / 2; ++i) p[i] = static_cast<uint8_t>(nibble(hex[2 * i]) << 4 | nibble(hex[2 * i + 1]));
  at::Generator gen = at::detail::getDefaultCPUGenerator();  // shares the default generator
  gen.set_state(state);
}

std::string save_run_state(const std::string& out_dir, const RunState& state, models::DecoderImpl& model,
                           const optim::Optimizer& optimizer, const std::string& recipe_yaml,
                           const std::string& tokenizer_path, int64_t keep) {
  io::make_directories(out_dir);
  const std::string name = step_name(state.step);
  const std::string final_dir = out_dir + "/" + name;
  const std::string tmp_dir = out_dir + "/." + name + ".tmp-" + std::to_string(::getpid());
  remove_tree(tmp_dir);
  io::make_directories(tmp_dir);
  models::save_hf_checkpoint(model, tmp_dir);
  save_optimizer_state(tmp_dir + "/optimizer.safetensors", optimizer);
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object()
      .key("step").value(state.step)
      .key("schedule_step").value(state.schedule_step)
      .key("last_loss").value(state.last_loss)
      .key("rng_cpu").value(state.rng_state_hex)
      .end_object();
  io::write_file_atomic(tmp_dir + "/trainer_state.json", json.str());
  io::write_file_atomic(tmp_dir + "/recipe.yaml", recipe_yaml);
  if (!tokenizer_path.empty()) io::write_file_atomic(tmp_dir + "/tokenizer.model", io::read_file(tokenizer_path));
  io::sync_directory(tmp_dir);
  remove_tree(final_dir);  // a same-step folder left by an earlier attempt
  if (::rename(tmp_dir.c_str(), final_dir.c_str()) != 0) throw std::runtime_error("cannot move " + tmp_dir + " into place");
  io::sync_directory(out_dir);
  io::write_file_atomic(out_dir + "/latest", name + "\n");
  // Prune all but the newest `keep` checkpoints.
  std::vector<std::string> steps;
  if (DIR* dir = ::opendir(out_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (n.rfind("step-", 0) == 0 && n.size() == 13) steps.push_back(n);
    }
    ::closedir(dir);
  }
  std::sort(steps.begin(), steps.end());
  for (size_t i = 0; i + static_cast<size_t>(keep) < steps.size(); ++i) {
    if (steps[i] != name) remove_tree(out_dir + "/" + steps[i]);
  }
  return final_dir;
}

std::string latest_checkpoint(const std::string& out_dir) {
  std::ifstream in(out_dir + "/latest");
  if (!in) return "";
  std::string name;
  std::getline(in, name);
  if (name.rfind("step-", 0) != 0 || name.find('/') != std::string::npos) {
    throw std::invalid_argument(out_dir + "/latest does not name a checkpoint");
  }
  struct stat st {};
  const std::string dir = out_dir + "/" + name;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw std::invalid_argument(out_dir + "/latest points at a missing " + name);
  return dir;
}

RunState read_trainer_state(const std::string& checkpoint_dir) {
  const std::string path = checkpoint_dir + "/trainer_state.json";
  RunState s;
  try {
    const io::JsonValue j = io::parse_json(io::read_file(path));
    s.step = j.at("step").as_int();
    s.schedule_step = j.at("schedule_step").as_int();
    s.last_loss = j.at("last_loss").is_null() ? 0.0 : j.at("last_loss").as_double();
    s.rng_state_hex = j.at("rng_cpu").as_string();
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
  return s;
}

RunState load_run_state(const std::string& checkpoint_dir, models::DecoderImpl& model, optim::Optimizer& optimizer) {
  const RunState s = read_trainer_state(checkpoint_dir);
  models::load_hf_weights(model, checkpoint_dir);
  load_optimizer_state(checkpoint_dir + "/optimizer.safetensors", optimizer);
  return s;
}

void save_optimizer_state(const std::string& path, const optim::Optimizer& optimizer) {
  // state_dict() refers to the live state and the writer copies one tensor at a time (to the CPU
  // when it lives elsewhere), so no second copy of the whole state is made.
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, tensor] : optimizer.state_dict()) tensors.emplace_back(name, tensor);
  io::write_safetensors(path, tensors);
}

void load_optimizer_state(const std::string& path, optim::Optimizer& optimizer) {
  try {
    io::SafetensorsReader file(path);
    optim::StateDictSource source;
    for (const auto& t : file.tensors()) source.entries.emplace_back(t.name, t.shape);
    source.load = [&file](const std::string& name) { return file.load(name); };
    optimizer.load_state(source);  // checks the header, then reads one parameter's entries at a time
  } catch (const io::SafetensorsError& e) {
    throw std::invalid_argument(e.what());
  }
}

}  // namespace train
}  // namespace frugal
