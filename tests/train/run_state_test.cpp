// Optimizer state through its checkpoint file: read back one parameter at a time, it gives exactly
// the state and the steps that an in-memory state dict gives (every precision and placement), and
// restoring it needs the final state plus one parameter's saved entries, not the whole file.
#include <gtest/gtest.h>

#include <dirent.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <limits>

#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/safetensors.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/decoder.h"
#include "frugal/optim/optimizer.h"
#include "frugal/train/run_state.h"
#include "../support/common.h"

using namespace frugal;
using namespace frugal::optim;

namespace {

using frugal::testing::temp_path;

// Two matrices (quantized state) and a bias (small: fp32 state) fitting y = flip(x).
struct Regression {
  std::vector<std::string> names = {"w1", "w2", "bias"};
  std::vector<at::Tensor> params;
  explicit Regression(uint64_t seed) {
    torch::manual_seed(seed);
    params = {(at::randn({64, 96}) * 0.1).requires_grad_(), (at::randn({96, 64}) * 0.1).requires_grad_(), at::zeros({64}).requires_grad_()};
  }
  Regression(const Regression& other) : names(other.names) {
    for (const auto& p : other.params) params.push_back(p.detach().clone().requires_grad_());
  }
  std::vector<ParamGroup> groups() const { return {ParamGroup{names, params, std::nullopt, std::nullopt}}; }
  // x: (B, 64) -> tanh(x w1): (B, 96) -> (B, 64)
  at::Tensor loss(const at::Tensor& x) const { return (at::tanh(x.mm(params[0])).mm(params[1]) + params[2] - x.flip(1)).pow(2).mean(); }
  void train(Optimizer& opt, int64_t first, int64_t steps) const {
    for (int64_t i = first; i < first + steps; ++i) {
      torch::manual_seed(100 + static_cast<uint64_t>(i));
      opt.backward(loss(at::randn({16, 64})));
      opt.step();
      opt.zero_grad();
    }
  }
};

void expect_same_state(const TensorDict& a, const TensorDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_EQ(v.scalar_type(), b.at(k).scalar_type()) << k;
    EXPECT_TRUE(at::equal(v, b.at(k))) << k;  // bit for bit
  }
}

}  // namespace

TEST(RunState, OptimizerStateFromItsFileEqualsTheStateDictInEveryPrecisionAndPlacement) {
  for (StatePrecision precision : kAllStatePrecisions) {
    for (StatePlacement placement : kAllStatePlacements) {
      SCOPED_TRACE(std::string(precision_name(precision)) + " " + placement_name(placement));
      const auto opts = OptimizerOptions().lr(3e-3).weight_decay(0.01).state(StateOptions().precision(precision).placement(placement));
      Regression straight(1);
      Optimizer o_straight(straight.groups(), opts);
      straight.train(o_straight, 0, 4);
      const std::string path = temp_path(std::string(precision_name(precision)) + placement_name(placement));
      train::save_optimizer_state(path, o_straight);
      TensorDict saved;
      for (const auto& [k, v] : o_straight.state_dict()) saved[k] = v.clone();

      Regression from_dict(straight), from_file(straight);
      Optimizer o_dict(from_dict.groups(), opts), o_file(from_file.groups(), opts);
      o_dict.load_state_dict(saved);
      train::load_optimizer_state(path, o_file);
      ::unlink(path.c_str());
      expect_same_state(o_file.state_dict(), o_dict.state_dict());
      expect_same_state(o_file.state_dict(), saved);

      straight.train(o_straight, 4, 4);
      from_dict.train(o_dict, 4, 4);
      from_file.train(o_file, 4, 4);
      for (size_t i = 0; i < straight.params.size(); ++i) {
        EXPECT_TRUE(at::equal(from_file.params[i], from_dict.params[i])) << straight.names[i];
        EXPECT_TRUE(at::equal(from_file.params[i], straight.params[i])) << straight.names[i];
      }
      expect_same_state(o_file.state_dict(), o_dict.state_dict());
    }
  }
}

TEST(RunState, RestoringOptimizerStatePeaksAtTheStatePlusOneParametersEntries) {
  // int8 state of four large matrices, the largest (1.5M values) restored last, when the rest of
  // the state already exists: the peak is then the whole state plus its entries.
  const std::vector<std::string> names = {"w0", "w1", "w2", "w3"};
  const std::vector<std::vector<int64_t>> shapes = {{256, 1024}, {512, 1024}, {1024, 1024}, {1536, 1024}};
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) params.push_back(at::zeros(s).requires_grad_());
  const std::vector<ParamGroup> groups = {ParamGroup{names, params, std::nullopt, std::nullopt}};
  const auto opts = OptimizerOptions().state(StateOptions().precision(StatePrecision::int8));
  const std::string path = temp_path("peak");
  {
    Optimizer trained(groups, opts);
    torch::manual_seed(3);
    for (auto& p : params) p.mutable_grad() = at::randn_like(p);
    trained.step();
    trained.zero_grad();
    train::save_optimizer_state(path, trained);
  }
  int64_t largest_entries = 0;  // bytes of one parameter's saved entries, the most of any
  {
    io::SafetensorsReader file(path);
    for (const auto& name : names) {
      int64_t bytes = 0;
      for (const auto& t : file.tensors()) {
        if (t.name.rfind(name + ".", 0) == 0) bytes += static_cast<int64_t>(t.end - t.begin);
      }
      largest_entries = std::max(largest_entries, bytes);
    }
  }

  Optimizer streamed(groups, opts);  // made first: its shared code tables are not what is measured
  auto tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(tracker);
    train::load_optimizer_state(path, streamed);
  }
  const int64_t state = streamed.state_bytes();
  ASSERT_GT(state, 6 << 20);  // 3.25M values, two moments of a byte each
  EXPECT_LE(static_cast<double>(tracker->peak_bytes()), 1.05 * static_cast<double>(state + largest_entries))
      << "state " << state << ", largest parameter's entries " << largest_entries;

  // Reading the whole file first, as resuming used to, needs about twice the state.
  Optimizer whole(groups, opts);
  auto whole_tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(whole_tracker);
    TensorDict all;
    io::SafetensorsReader file(path);
    for (const auto& t : file.tensors()) all[t.name] = file.load(t.name);
    whole.load_state_dict(all);
  }
  EXPECT_GE(static_cast<double>(whole_tracker->peak_bytes()), 1.9 * static_cast<double>(state));
  expect_same_state(streamed.state_dict(), whole.state_dict());
  std::printf(
      "[ peak ] state %lld bytes, largest parameter's entries %lld: restored one parameter at a time %.3fx "
      "the state, from the whole file read first %.3fx\n",
      static_cast<long long>(state), static_cast<long long>(largest_entries),
      static_cast<double>(tracker->peak_bytes()) / static_cast<double>(state),
      static_cast<double>(whole_tracker->peak_bytes()) / static_cast<double>(state));
  ::unlink(path.c_str());
}

namespace {

// A checkpoint folder out/step-00000004 holding only a trainer_state.json with `json`.
std::string trainer_state_folder(const std::string& name, const std::string& json) {
  const std::string dir = temp_path(name) + "/step-00000004";
  io::make_directories(dir);
  io::write_file_atomic(dir + "/trainer_state.json", json);
  return dir;
}

std::string state_json(const std::string& step, const std::string& schedule, const std::string& rng) {
  return "{\"step\": " + step + ", \"schedule_step\": " + schedule + ", \"last_loss\": 1.5, \"rng_cpu\": \"" + rng + "\"}";
}

// The error of read_trainer_state, or "" when it accepts the folder.
std::string refusal(const std::string& dir, int64_t max_step) {
  try {
    train::read_trainer_state(dir, max_step);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(RunState, TrainerStateIsRefusedNamingTheFieldWhenAnythingIsOutOfRange) {
  const std::string rng = train::rng_state_to_hex();
  ASSERT_EQ(static_cast<int64_t>(rng.size()), 2 * train::rng_state_bytes());
  const std::string good = trainer_state_folder("good", state_json("4", "4", rng));
  EXPECT_EQ(refusal(good, 10), "");
  EXPECT_EQ(train::read_trainer_state(good, 10).step, 4);
  struct Case {
    std::string json, field;
  };
  const Case cases[] = {
      {state_json("-4", "0", rng), "'step' is -4"},
      {state_json("4000000000000", "0", rng), "'step' is 4000000000000"},
      {state_json("4.5", "0", rng), "'step' must be an integer"},
      {state_json("3", "3", rng), "the folder is step-00000004"},
      {state_json("4", "-1", rng), "'schedule_step' is -1"},
      {state_json("4", "5", rng), "'schedule_step' is 5"},
      {state_json("4", "4", rng.substr(0, 64)), "'rng_cpu' has 64 hex digits"},
      {state_json("4", "4", rng + "00"), "'rng_cpu' has"},
      {state_json("4", "4", ""), "'rng_cpu' has 0 hex digits"},
      {state_json("4", "4", "zz" + rng.substr(2)), "'rng_cpu' is not lower-case hex"},
      {"{\"step\": 4}", "has no 'schedule_step'"},
      {"[]", "is not a JSON object"},
  };
  int i = 0;
  for (const Case& c : cases) {
    const std::string dir = trainer_state_folder("bad" + std::to_string(i++), c.json);
    const std::string why = refusal(dir, 10);
    EXPECT_NE(why.find(dir + "/trainer_state.json"), std::string::npos) << c.json << ": " << why;
    EXPECT_NE(why.find(c.field), std::string::npos) << c.json << ": " << why;
  }
  // A step past the run's train.steps: the state of another run.
  EXPECT_NE(refusal(good, 3).find("'step' is 4, outside [0, train.steps = 3]"), std::string::npos);
}

TEST(RunState, RngStateOfTheWrongSizeIsRefusedInOurWords) {
  const std::string rng = train::rng_state_to_hex();
  for (const std::string& bad : {rng.substr(0, 10), rng + "ab", std::string()}) {
    try {
      train::rng_state_from_hex(bad);
      ADD_FAILURE() << "accepted " << bad.size() << " digits";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("the RNG state has " + std::to_string(bad.size()) + " hex digits"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_NO_THROW(train::rng_state_from_hex(rng));
  EXPECT_EQ(train::rng_state_to_hex(), rng);
}

TEST(RunState, AnOptimizerFileWithoutStateIsRefusedAfterStepZero) {
  Regression model(3);
  Optimizer opt(model.groups(), OptimizerOptions().algorithm(Algorithm::adamw));
  const std::string path = temp_path("empty_opt.safetensors");
  io::write_safetensors(path, {});
  EXPECT_NO_THROW(train::load_optimizer_state(path, opt, /*require_state=*/false));  // step 0: fresh state is right
  try {
    train::load_optimizer_state(path, opt, /*require_state=*/true);
    ADD_FAILURE() << "an empty optimizer file was accepted after step 0";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), path + " holds no optimizer state");
  }
  // A tensor with no elements where a state is expected: named by file and entry, no LibTorch text.
  model.train(opt, 0, 1);
  auto state = opt.state_dict();
  state["w1.exp_avg"] = at::empty({0});
  state["w2.step"] = at::empty({0}, at::kLong);
  std::vector<std::pair<std::string, at::Tensor>> tensors(state.begin(), state.end());
  io::write_safetensors(path, tensors);
  Optimizer fresh(model.groups(), OptimizerOptions().algorithm(Algorithm::adamw));
  try {
    train::load_optimizer_state(path, fresh, true);
    ADD_FAILURE() << "an empty exp_avg was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(path + ": ", 0), 0u) << what;
    EXPECT_NE(what.find("w1.exp_avg"), std::string::npos) << what;
    EXPECT_NE(what.find("w2.step"), std::string::npos) << what;
    EXPECT_EQ(what.find("Tensor with 0 elements"), std::string::npos) << what;
  }
}

// A step that left a parameter NaN or infinite is never committed: the save stops before writing
// anything, names the parameter, and `latest` still names the last good checkpoint.
TEST(RunState, AParameterThatIsNotFiniteIsNeverCommitted) {
  models::DecoderConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.ffn_dim = 64;
  c.max_seq_len = 16;
  auto model = models::make_decoder(c);
  Optimizer opt(model->named_parameters(), OptimizerOptions().algorithm(Algorithm::adamw));
  const std::string out = temp_path("nonfinite");
  io::remove_tree(out);
  train::RunState s;
  s.step = 1;
  s.rng_state_hex = train::rng_state_to_hex();
  train::save_run_state(out, s, *model, opt, "name: t\n", "", 2);
  auto params = model->named_parameters();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    const auto& victim = params[params.size() / 2];
    {
      at::NoGradGuard no_grad;
      victim.value().view({-1})[3] = bad;
    }
    s.step = 2;
    try {
      train::save_run_state(out, s, *model, opt, "name: t\n", "", 2);
      ADD_FAILURE() << "a parameter holding " << bad << " was committed";
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("step 2 made parameter '" + victim.key() + "' not finite"), std::string::npos) << e.what();
    }
    EXPECT_EQ(train::latest_checkpoint(out), out + "/step-00000001");
    std::vector<std::string> names;
    if (DIR* dir = ::opendir(out.c_str())) {
      while (dirent* e = ::readdir(dir)) names.push_back(e->d_name);
      ::closedir(dir);
    }
    std::sort(names.begin(), names.end());
    EXPECT_EQ(names, (std::vector<std::string>{".", "..", "latest", "step-00000001"}));
    at::NoGradGuard no_grad;
    victim.value().view({-1})[3] = 0.0f;
  }
  io::remove_tree(out);
}

TEST(RunState, StaleTemporaryCheckpointFoldersOfDeadProcessesAreRemoved) {
  const std::string out = temp_path("stale");
  io::remove_tree(out);
  // A PID that is surely dead: a child that has exited and been reaped.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  for (const std::string& n : std::vector<std::string>{".step-00000010.tmp-" + dead, ".step-00000020.tmp-" + live,
                                                       ".step-00000030.tmp-x" + dead, "step-00000040", ".other.tmp-" + dead}) {
    io::make_directories(out + "/" + n + "/inner");
  }
  io::write_file_atomic(out + "/.step-00000010.tmp-" + dead + "/inner/model.safetensors", "x");
  EXPECT_EQ(train::remove_stale_checkpoint_temps(out), 1);
  EXPECT_FALSE(io::path_exists(out + "/.step-00000010.tmp-" + dead));
  for (const std::string& n :
       std::vector<std::string>{".step-00000020.tmp-" + live, ".step-00000030.tmp-x" + dead, "step-00000040", ".other.tmp-" + dead}) {
    EXPECT_TRUE(io::path_exists(out + "/" + n)) << n;  // a live writer's, or not ours
  }
  EXPECT_EQ(train::remove_stale_checkpoint_temps(out + "/missing"), 0);
  io::remove_tree(out);
}

// The growth of out_dir over a run's saves, as save_run_state writes and prunes (the trainer
// refuses a run before step 0 when its file system has less free).
TEST(RunState, CheckpointSpaceIsKeepPlusOneCheckpointsLessWhatPruningFolders) {
  const std::string out = temp_path("space");
  io::remove_tree(out);
  // An empty (here: missing) out_dir: keep + 1 on disk at once, or every save when fewer.
  EXPECT_EQ(train::checkpoint_space_needed(out, {2, 4, 6, 8}, 100, 2), 300);
  EXPECT_EQ(train::checkpoint_space_needed(out, {2, 4, 6, 8}, 100, 1), 200);
  EXPECT_EQ(train::checkpoint_space_needed(out, {2, 4}, 100, 5), 200);
  EXPECT_EQ(train::checkpoint_space_needed(out, {8}, 100, 1), 100);
  // Folders already there free their own size when pruned: here 1000 bytes, so after the first
  // save out_dir shrinks and only that save counts.
  io::make_directories(out + "/step-00000002");
  io::write_file_atomic(out + "/step-00000002/model.safetensors", std::string(1000, 'x'));
  EXPECT_EQ(train::checkpoint_space_needed(out, {4, 6, 8}, 100, 1), 100);
  // ...but with keep 2 it stays: three folders at the second save.
  EXPECT_EQ(train::checkpoint_space_needed(out, {4, 6, 8}, 100, 2), 200);
  // A folder of the same step is replaced only once the new one is whole: both at once.
  io::make_directories(out + "/step-00000004");
  io::write_file_atomic(out + "/step-00000004/model.safetensors", std::string(50, 'x'));
  EXPECT_EQ(train::checkpoint_space_needed(out, {4}, 100, 3), 100);
  // A folder newer than the run's saves outlives them (pruning goes by name): the run's own
  // older ones go first.
  io::remove_tree(out);
  io::make_directories(out + "/step-00000100");
  io::write_file_atomic(out + "/step-00000100/model.safetensors", std::string(10, 'x'));
  EXPECT_EQ(train::checkpoint_space_needed(out, {2, 4, 6}, 100, 1), 200);
  io::remove_tree(out);
}
