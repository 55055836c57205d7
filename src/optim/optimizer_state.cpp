// The optimizer's state dict: state_dict() (views of the live state, named as torch::optim names
// them), and load_state(), which checks everything that can be checked from names and shapes before
// loading a byte, then restores one parameter at a time, re-sharding slices saved at another
// data-parallel world size and decoding quantized moments where this optimizer keeps them dense.
#include <torch/serialize/archive.h>

#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "frugal/io/numbers.h"
#include "frugal/io/tensor_values.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"
#include "optimizer_impl.h"

namespace frugal {
namespace optim {

TensorDict Optimizer::state_dict() const {
  impl_->finish_updates();  // update_threads: the state as the last backward left it
  TensorDict out;
  for (const auto& p : impl_->params) {
    if (p.state.step == 0) continue;
    // A slice of a parameter split over ranks: "<name>@<begin>:<end>.<field>".
    const std::string key = Impl::whole(p) ? p.name : p.name + "@" + std::to_string(p.begin) + ":" + std::to_string(p.end);
    out[key + ".step"] = at::scalar_tensor(p.state.step, at::kLong);
    if (p.state.exp_avg.defined()) out[key + ".exp_avg"] = p.state.exp_avg;
    if (p.state.exp_avg_sq.defined()) out[key + ".exp_avg_sq"] = p.state.exp_avg_sq;
    if (p.state.m) p.state.m->save(out, key + ".exp_avg");
    if (p.state.v) p.state.v->save(out, key + ".exp_avg_sq");
    if (p.state.momentum_buffer.defined()) out[key + ".momentum_buffer"] = p.state.momentum_buffer;
  }
  return out;
}

namespace {

// The fields a parameter's state can have, as suffixes of its entries' names.
const char* const kStateFields[] = {"step",          "exp_avg",        "exp_avg_sq",       "momentum_buffer",
                                    "exp_avg.codes", "exp_avg.absmax", "exp_avg_sq.codes", "exp_avg_sq.absmax"};

struct SourceEntry {
  std::string name;  // in the source
  at::IntArrayRef shape;
  std::string field;  // which of kStateFields
};

// A loaded entry's values checked against what its field can hold, before anything is restored
// from it: a moment of the wrong type (an integer tensor converts silently), a non-finite value or
// a negative second moment would turn the next update of the parameter into NaN.
void check_state_values(const SourceEntry& entry, const at::Tensor& t) {
  const std::string& f = entry.field;
  auto refuse = [&](const std::string& why) { throw std::invalid_argument("optimizer: state entry " + entry.name + " " + why); };
  const at::ScalarType dtype = t.scalar_type();
  const std::string type = c10::toString(dtype);
  if (f == "step") {
    if (!at::isIntegralType(dtype, /*includeBool=*/false)) refuse("is " + type + "; a step count must be an integer");
    const int64_t step = t.reshape({-1})[0].item<int64_t>();
    // A saved state has taken at least one step (state_dict leaves out parameters that have none).
    if (step < 1 || step > (int64_t{1} << 53)) refuse("is " + std::to_string(step) + "; a step count must be from 1 to 2^53");
    return;
  }
  if (f == "exp_avg.codes" || f == "exp_avg_sq.codes") {
    if (dtype != at::kByte) refuse("is " + type + "; quantized codes must be U8");
    return;
  }
  const bool scales = f == "exp_avg.absmax" || f == "exp_avg_sq.absmax";
  if (scales && dtype != at::kFloat) refuse("is " + type + "; block scales must be F32");
  if (!scales && !at::isFloatingType(dtype)) refuse("is " + type + "; a moment must be floating point, like its parameter");
  if (!io::all_finite(t)) refuse("holds a value that is not finite (NaN or infinity)");
  if ((scales || f == "exp_avg_sq") && io::any_negative(t)) {
    refuse(std::string("holds a negative value; ") + (scales ? "block scales" : "a second moment") + " cannot be negative");
  }
}

// The saved state of a parameter's flattened elements [begin, end): all of them (a name without
// "@"), or the slice one rank of a data-parallel run kept ("<name>@<begin>:<end>").
struct SavedSlice {
  int64_t begin = 0, end = 0;
  bool whole = true;
  std::map<std::string, SourceEntry> fields;  // field -> entry
};

int64_t numel_of(at::IntArrayRef shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// "B:E" -> (B, E); false when it is not two decimal numbers.
bool parse_range(const std::string& text, int64_t& begin, int64_t& end) {
  const size_t colon = text.find(':');
  auto number = [](const std::string& t, int64_t& v) {
    const std::optional<int64_t> n = t.empty() || t[0] == '-' ? std::nullopt : io::to_int(t);
    if (n) v = *n;
    return n.has_value();
  };
  return colon != std::string::npos && number(text.substr(0, colon), begin) && number(text.substr(colon + 1), end);
}

}  // namespace

namespace {

using Param = Optimizer::Impl::Param;

// What a source's names and shapes say, checked against the parameters before a byte is loaded:
// each parameter's saved slices by range, and every problem found, by kind.
struct StatePlan {
  std::map<std::string, std::map<std::pair<int64_t, int64_t>, SavedSlice>> slices;  // parameter -> range -> slice
  std::vector<std::string> unknown, repeated, bad_shape, missing;
};

// Step 1: every entry's name parsed ("<name>[@<begin>:<end>].<field>"), its parameter found and its
// shape checked against what that field holds.
void parse_entries(const StateDictSource& source, const std::map<std::string, Param*>& by_name, StatePlan& plan) {
  for (const auto& [key, shape_vec] : source.entries) {
    const at::IntArrayRef shape(shape_vec);
    bool matched = false;
    for (const char* field : kStateFields) {
      const std::string suffix = std::string(".") + field;
      if (key.size() <= suffix.size() || key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
      const std::string base = key.substr(0, key.size() - suffix.size());
      const size_t at = base.rfind('@');
      const std::string name = at == std::string::npos ? base : base.substr(0, at);
      auto it = by_name.find(name);
      int64_t begin = 0, end = 0;
      if (it == by_name.end() || (at != std::string::npos && !parse_range(base.substr(at + 1), begin, end))) break;
      matched = true;
      const int64_t n = it->second->tensor.numel();
      const bool whole = at == std::string::npos;
      if (whole) {
        end = n;
      } else if (!(begin < end && end <= n)) {
        plan.bad_shape.push_back(key + ": elements " + std::to_string(begin) + ":" + std::to_string(end) + " of a parameter of " +
                                 std::to_string(n));
        break;
      }
      const std::string f(field);
      const at::IntArrayRef param_shape = it->second->tensor.sizes();
      if (f == "step" && numel_of(shape) != 1) {
        std::ostringstream m;
        m << key << " " << shape << " vs a single count";
        plan.bad_shape.push_back(m.str());
      } else if (f != "step" && f.find('.') == std::string::npos &&
                 (whole ? !shape.equals(param_shape) : !(shape.size() == 1 && shape[0] == end - begin))) {
        std::ostringstream m;
        m << key << " " << shape << " vs " << (whole ? "parameter " : "a slice of ");
        if (whole)
          m << param_shape;
        else
          m << "[" << end - begin << "]";
        plan.bad_shape.push_back(m.str());
      }
      SavedSlice& slice = plan.slices[name][{begin, end}];
      slice.begin = begin;
      slice.end = end;
      slice.whole = whole;
      if (!slice.fields.emplace(f, SourceEntry{key, shape, f}).second) plan.repeated.push_back(key);
      break;
    }
    if (!matched) plan.unknown.push_back(key);
  }
}

// Step 2: each parameter's slices complete (a step count, both moments for Adam(W), codes that fit
// 8- or 4-bit blocks) and tiling it (0:a, a:b, ..., z:n); every parameter this rank updates present.
void check_slices(const std::map<std::string, Param*>& by_name, bool adam, StatePlan& plan) {
  for (const auto& [name, slices] : plan.slices) {
    const int64_t n = by_name.at(name)->tensor.numel();
    int64_t covered = 0;
    for (const auto& [range, slice] : slices) {
      const std::string label = slice.whole ? name : name + "@" + std::to_string(range.first) + ":" + std::to_string(range.second);
      const auto& fields = slice.fields;
      if (!fields.count("step")) plan.missing.push_back(label + ".step");
      auto has = [&](const std::string& m) { return fields.count(m) || (fields.count(m + ".codes") && fields.count(m + ".absmax")); };
      if (adam && (!has("exp_avg") || !has("exp_avg_sq"))) plan.missing.push_back(label + ".exp_avg/exp_avg_sq");
      for (const std::string m : {"exp_avg", "exp_avg_sq"}) {
        const auto codes = fields.find(m + ".codes"), absmax = fields.find(m + ".absmax");
        if (codes == fields.end() || absmax == fields.end()) continue;
        const int64_t len = range.second - range.first, c = numel_of(codes->second.shape), a = numel_of(absmax->second.shape);
        if (!quantized_bits_of(len, c, a)) {
          plan.bad_shape.push_back(label + "." + m + ": " + std::to_string(c) + " codes and " + std::to_string(a) +
                                   " scales fit no 8- or 4-bit blocks of " + std::to_string(len) + " values");
        }
      }
      if (range.first != covered) {
        plan.bad_shape.push_back(name + ": the saved slices leave a gap or overlap at element " +
                                 std::to_string(std::min(covered, range.first)));
      }
      covered = std::max(covered, range.second);
    }
    if (covered != n) {
      plan.bad_shape.push_back(name + ": the saved slices end at element " + std::to_string(covered) + " of " + std::to_string(n));
    }
  }
}

// Step 3: one exception naming every problem (at most ten of each kind), or nothing.
void refuse_mismatch(const StatePlan& plan) {
  if (plan.unknown.empty() && plan.repeated.empty() && plan.bad_shape.empty() && plan.missing.empty()) return;
  std::ostringstream m;
  m << "optimizer: the state does not match the parameters.";
  auto list = [&](const char* what, const std::vector<std::string>& items) {
    if (items.empty()) return;
    m << " " << what << ":";
    for (size_t i = 0; i < items.size() && i < 10; ++i) m << (i ? ", " : " ") << items[i];
    if (items.size() > 10) m << " (and " << items.size() - 10 << " more)";
    m << ".";
  };
  list("Unknown entries", plan.unknown);
  list("Repeated entries", plan.repeated);
  list("Wrong shapes", plan.bad_shape);
  list("Missing", plan.missing);
  throw std::invalid_argument(m.str());
}

// Loads one entry and checks that it is what the source listed and that its values fit its field.
at::Tensor load_entry(const StateDictSource& source, const SourceEntry& entry) {
  at::Tensor t = source.load(entry.name);
  if (!t.defined() || !t.sizes().equals(entry.shape)) {
    std::ostringstream m;
    m << "optimizer: state entry " << entry.name << " was listed as " << entry.shape << " but loaded as ";
    if (t.defined())
      m << t.sizes();
    else
      m << "no tensor";
    throw std::invalid_argument(m.str());
  }
  check_state_values(entry, t);
  return t;
}

// One saved moment of a slice as fp32 values, decoded when it was saved as codes and scales.
at::Tensor decoded_moment(const StateDictSource& source, const SavedSlice& slice, const std::string& m, bool is_signed) {
  if (slice.fields.count(m)) return load_entry(source, slice.fields.at(m)).reshape({-1}).to(at::kFloat);
  TensorDict q{{m + ".codes", load_entry(source, slice.fields.at(m + ".codes"))},
               {m + ".absmax", load_entry(source, slice.fields.at(m + ".absmax"))}};
  const int64_t len = slice.end - slice.begin;
  StateBuffer buffer(at::empty({len}, at::kFloat), is_signed, StateOptions().precision(StatePrecision::fp32));
  buffer.restore(q, m);
  return buffer.load(0, len, at::Device(at::kCPU)).reshape({-1});
}

// Step 4a: the fields of the elements [p.begin, p.end) this rank updates: the saved slice's own
// entries where one was saved for exactly that range, else the pieces of the slices it overlaps
// (saved at another world size), decoded to fp32 and joined.
TensorDict fields_for(const StateDictSource& source, const Param& p, const std::map<std::pair<int64_t, int64_t>, SavedSlice>& slices,
                      at::IntArrayRef target_shape) {
  TensorDict f;  // field -> tensor, this parameter's (this range's) only
  const auto exact = slices.find({p.begin, p.end});
  if (exact != slices.end()) {
    for (const auto& [field, entry] : exact->second.fields) f[field] = load_entry(source, entry);
    return f;
  }
  for (const std::string m : {"exp_avg", "exp_avg_sq", "momentum_buffer"}) {
    std::vector<at::Tensor> pieces;
    for (const auto& [range, slice] : slices) {
      const int64_t from = std::max(range.first, p.begin), to = std::min(range.second, p.end);
      if (from >= to) continue;
      if (f.count("step") == 0) f["step"] = load_entry(source, slice.fields.at("step"));
      if (!slice.fields.count(m) && !slice.fields.count(m + ".codes")) continue;
      pieces.push_back(decoded_moment(source, slice, m, m != "exp_avg_sq").narrow(0, from - range.first, to - from));
    }
    if (!pieces.empty()) f[m] = at::cat(pieces).view(target_shape);
  }
  return f;
}

// Step 4b: a parameter's state made from its fields, in the form this optimizer keeps it (state
// buffers of its precision and place, or dense tensors like the parameter, decoding saved codes).
void restore_parameter(Param& p, const TensorDict& f, const Hyper& h, bool adam, const at::Tensor& target) {
  p.state.step = f.at("step").item<int64_t>();
  if (adam && h.buffered(target)) {
    p.state.m = std::make_shared<StateBuffer>(target, true, h.state);
    p.state.v = std::make_shared<StateBuffer>(target, false, h.state);
    try {
      p.state.m->restore(f, "exp_avg");
      p.state.v->restore(f, "exp_avg_sq");
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument("optimizer: parameter '" + p.name + "': " + e.what());
    }
    return;
  }
  const auto opts = target.options();
  auto dense = [&](const std::string& m) {
    if (f.count(m)) return f.at(m).view(target.sizes()).to(opts, /*non_blocking=*/false, /*copy=*/true);
    // codes and scales from a quantized optimizer: decode them
    StateBuffer decoded_state(target, m == "exp_avg", StateOptions().precision(StatePrecision::fp32));
    decoded_state.restore(f, m);
    return decoded_state.load(0, target.numel(), target.device()).view(target.sizes()).to(opts, false, true);
  };
  if (adam) {
    p.state.exp_avg = dense("exp_avg");
    p.state.exp_avg_sq = dense("exp_avg_sq");
  }
  if (f.count("momentum_buffer")) p.state.momentum_buffer = f.at("momentum_buffer").view(target.sizes()).to(opts, false, true);
}

}  // namespace

void Optimizer::load_state(const StateDictSource& source) {
  impl_->finish_updates();
  std::map<std::string, Impl::Param*> by_name;
  for (auto& p : impl_->params) by_name[p.name] = &p;
  const bool adam = impl_->options.algorithm() != Algorithm::sgd;
  // 1-3. Everything that can be checked from names and shapes, before a byte of data is loaded.
  StatePlan plan;
  parse_entries(source, by_name, plan);
  check_slices(by_name, adam, plan);
  if (!source.entries.empty()) {
    for (const auto& p : impl_->params) {
      if (!plan.slices.count(p.name) && impl_->owns(p)) plan.missing.push_back(p.name);
    }
  }
  refuse_mismatch(plan);
  // 4. Parameter by parameter: load its entries, restore its state, drop them. The old state goes
  // first, so old and new never exist together; on any error no state is left half-restored.
  at::NoGradGuard no_grad;
  memory::CategoryScope scope(memory::Category::optimizer_state);
  for (auto& p : impl_->params) p.state = ParamState();
  try {
    for (auto& p : impl_->params) {
      auto it = plan.slices.find(p.name);
      if (it == plan.slices.end() || !impl_->owns(p)) continue;  // another rank's: it loads its own
      const at::Tensor target = Impl::own(p, p.tensor);          // what this rank updates
      const TensorDict f = fields_for(source, p, it->second, target.sizes());
      restore_parameter(p, f, impl_->hyper(p.group), adam, target);
    }
  } catch (...) {
    for (auto& p : impl_->params) p.state = ParamState();
    throw;
  }
}

void Optimizer::load_state_dict(const TensorDict& state) {
  StateDictSource source;
  for (const auto& [name, tensor] : state) source.entries.emplace_back(name, tensor.sizes().vec());
  source.load = [&state](const std::string& name) { return state.at(name); };
  load_state(source);
}

namespace {
constexpr const char* kArchiveKey = "frugal_optimizer_state";
}  // namespace

torch::serialize::OutputArchive& operator<<(torch::serialize::OutputArchive& archive, const Optimizer& optimizer) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, tensor] : optimizer.state_dict()) dict.insert(name, tensor);
  archive.write(kArchiveKey, c10::IValue(dict));
  return archive;
}

torch::serialize::InputArchive& operator>>(torch::serialize::InputArchive& archive, Optimizer& optimizer) {
  c10::IValue value;
  if (!archive.try_read(kArchiveKey, value) || !value.isGenericDict()) {
    throw std::invalid_argument(std::string("optimizer: the archive holds no '") + kArchiveKey +
                                "' entry (it was not written by torch::save of a frugal optimizer)");
  }
  TensorDict state;
  for (const auto& item : value.toGenericDict()) {
    if (!item.key().isString() || !item.value().isTensor()) {
      throw std::invalid_argument(std::string("optimizer: the archive's '") + kArchiveKey +
                                  "' holds an entry that is not a name and a tensor");
    }
    state.emplace(item.key().toStringRef(), item.value().toTensor());
  }
  optimizer.load_state_dict(state);
  return archive;
}

}  // namespace optim
}  // namespace frugal
