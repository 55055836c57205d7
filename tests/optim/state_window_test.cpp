// Optimizer state in files streamed through a bounded window (state_placement file): the same
// bits as state in memory in both modes, every precision, fp32 and bf16 parameters; only the
// window resident during and after a step, a checkpoint's writing and a restore; an exact resume
// from saved state; a folder too small for the files refused before anything is made; reading
// ahead off the caller's thread.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "frugal/io/safetensors.h"
#include "frugal/memory/process.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/state_buffer.h"
#include "optim/state_window.h"

#include <torch/nn/modules/linear.h>

using namespace frugal;
using namespace frugal::optim;

namespace {

// Two large weights (and a bias under the small-tensor rule), in fp32 or bf16.
struct Net : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  Net(uint64_t seed, int64_t d, at::ScalarType dtype) {
    torch::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(d, 2 * d));
    b = register_module("b", torch::nn::Linear(torch::nn::LinearOptions(2 * d, d).bias(false)));
    to(dtype);
  }
  at::Tensor loss(const at::Tensor& x) { return (b(at::gelu(a(x))) - x.flip(1)).to(at::kFloat).pow(2).mean(); }
};

std::vector<at::Tensor> batches(int n, int64_t d, at::ScalarType dtype) {
  torch::manual_seed(7);
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(at::randn({8, d}).to(dtype));
  return out;
}

void run_steps(Net& net, Optimizer& opt, const std::vector<at::Tensor>& xs) {
  for (const auto& x : xs) {
    opt.backward(net.loss(x));
    opt.step();
    opt.zero_grad();
  }
}

bool same_bits(torch::nn::Module& x, torch::nn::Module& y) {
  const auto px = x.parameters(), py = y.parameters();
  for (size_t i = 0; i < px.size(); ++i) {
    if (!at::equal(px[i], py[i])) return false;
  }
  return true;
}

OptimizerOptions options(StatePrecision p, StatePlacement where, Mode mode, int64_t window) {
  OptimizerOptions o = OptimizerOptions().lr(3e-3).weight_decay(0.01).mode(mode).stochastic_rounding(true);
  o.state(StateOptions().precision(p).placement(where).mmap_dir(::testing::TempDir()).window_bytes(window));
  return o;
}

}  // namespace

// Turns the window's direct I/O off for a scope (files made meanwhile use buffered reads and writes).
struct BufferedIo {
  explicit BufferedIo(bool buffered) : was(optim::detail::WindowPool::direct_io()) { optim::detail::WindowPool::direct_io() = !buffered; }
  ~BufferedIo() { optim::detail::WindowPool::direct_io() = was; }
  bool was;
};

TEST(StateWindow, FileStateGivesTheBitsOfStateInMemory) {
  // A window of 64 KiB: every weight's moments go through it in chunks of 8192 values (2 to 8 of
  // them), each chunk's stochastic rounding drawing the noise the whole parameter's step would;
  // with direct and with buffered writes.
  for (bool buffered : {false, true})
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const BufferedIo io(buffered);
      const auto xs = batches(4, 128, dtype);
      for (StatePrecision p : kAllStatePrecisions) {
        for (Mode mode : {Mode::standard, Mode::in_backward}) {
          SCOPED_TRACE(std::string(c10::toString(dtype)) + " " + precision_name(p) + (mode == Mode::in_backward ? " in backward" : "") +
                       (buffered ? " buffered" : ""));
          Net memory(1, 128, dtype), file(1, 128, dtype);
          Optimizer o_memory(memory.named_parameters(), options(p, StatePlacement::device, mode, 64 << 10));
          Optimizer o_file(file.named_parameters(), options(p, StatePlacement::file, mode, 64 << 10));
          at::manual_seed(3);
          run_steps(memory, o_memory, xs);
          at::manual_seed(3);
          run_steps(file, o_file, xs);
          EXPECT_TRUE(same_bits(memory, file));
        }
      }
    }
}

TEST(StateWindow, OnlyTheWindowIsResidentThroughStepsCheckpointsAndRestores) {
  // 2M fp32 parameters: 16 MiB of moments in files. A window of 1 MiB.
  const int64_t d = 1024, window = 1 << 20;
  const auto xs = batches(2, d, at::kFloat);
  // The resident bytes of the state files' mappings (their smaps entries, "frugal-state-..."),
  // not the process's whole RssFile, which grows as code is first run.
  auto resident_files = [] {
    std::ifstream smaps("/proc/self/smaps");
    std::string line;
    bool state = false;
    int64_t kib = 0;
    while (std::getline(smaps, line)) {
      const std::string first = line.substr(0, line.find(' '));
      if (!first.empty() && first.back() != ':' && first.find('-') != std::string::npos) {  // "start-end perms ... path"
        state = line.find("frugal-state-") != std::string::npos;
      } else if (state && line.rfind("Rss:", 0) == 0) {
        kib += std::stoll(line.substr(4));
      }
    }
    return kib * 1024;
  };
  if (!std::ifstream("/proc/self/smaps")) GTEST_SKIP() << "the kernel has no /proc/self/smaps";
  // The measure can fail: mmap placement keeps what a step touched.
  {
    Net net(2, d, at::kFloat);
    const int64_t before = resident_files();
    Optimizer opt(net.named_parameters(), options(StatePrecision::fp32, StatePlacement::mmap, Mode::standard, window));
    run_steps(net, opt, xs);
    EXPECT_GE(resident_files() - before, 15 << 20);
  }
  Net net(2, d, at::kFloat);
  auto tracker = memory::Tracker::create(false);
  memory::TrackingGuard on(tracker);
  const int64_t before = resident_files();
  Optimizer opt(net.named_parameters(), options(StatePrecision::fp32, StatePlacement::file, Mode::in_backward, window));
  run_steps(net, opt, xs);
  EXPECT_EQ(resident_files() - before, 0);
  // The tracker sees the window's buffers as state, from the first update on (kStateWindowSlots of
  // 128 KiB: int8 chunks of 128K codes), and nothing of the files.
  {
    Net other(4, d, at::kFloat);
    Optimizer standard(other.named_parameters(), options(StatePrecision::int8, StatePlacement::file, Mode::standard, window));
    for (int i = 0; i < 2; ++i) {
      standard.backward(other.loss(xs[0]));
      tracker->reset_peak();
      standard.step();
      standard.zero_grad();
    }
    // The fused kernels update the chunk in the window's buffers: no temporary memory (as
    // update_temporary_bytes counts it); the block scales stay in memory, the rest is in files.
    const auto at_peak = tracker->peak_report().breakdown;
    const int64_t scales = (2 * d * d / 256) * 4 * 2 * 2;  // both weights' block scales, both moments
    EXPECT_EQ(at_peak[static_cast<int>(memory::Category::temporary)], 0);
    EXPECT_EQ(at_peak[static_cast<int>(memory::Category::optimizer_state)], scales + window);
    const OptimizerOptions int8_file = options(StatePrecision::int8, StatePlacement::file, Mode::standard, window);
    EXPECT_EQ(update_temporary_bytes(2 * d * d, at::kFloat, at::kCPU, int8_file), 0);
    EXPECT_EQ(kStateWindowSlots * state_bytes_for_parameter(2 * d * d, at::kFloat, int8_file).window, window);
    EXPECT_EQ(optim::detail::WindowPool::get().resident_bytes(), window);
    EXPECT_EQ(tracker->live_by_category()[static_cast<int>(memory::Category::optimizer_state)], scales + window);
    // The codes' files were filled with the zero's code by writes, not through the mapping.
    EXPECT_EQ(resident_files() - before, 0);
  }

  // A checkpoint's writing reads every page of the files: dropped tensor by tensor.
  const std::string path = ::testing::TempDir() + "/state_window_opt.safetensors";
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : opt.state_dict()) tensors.emplace_back(name, t);
  io::write_safetensors(path, tensors, {}, [&tensors](size_t i) { release_state_pages(tensors[i].second); });
  EXPECT_EQ(resident_files() - before, 0);

  // Restored into a fresh optimizer: the restore's writes are dropped too, and the run continues
  // exactly as the one that saved.
  Net resumed(9, d, at::kFloat);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.parameters().size(); ++i) resumed.parameters()[i].copy_(net.parameters()[i]);
  }
  Optimizer opt2(resumed.named_parameters(), options(StatePrecision::fp32, StatePlacement::file, Mode::in_backward, window));
  io::SafetensorsReader file(path);
  TensorDict saved;
  for (const auto& t : file.tensors()) saved[t.name] = file.load(t.name);
  opt2.load_state_dict(saved);
  saved.clear();
  EXPECT_EQ(resident_files() - before, 0);
  const auto more = batches(2, d, at::kFloat);
  run_steps(net, opt, more);
  run_steps(resumed, opt2, more);
  EXPECT_TRUE(same_bits(net, resumed));
  std::remove(path.c_str());
}

TEST(StateWindow, AFolderTooSmallForTheFilesIsRefusedByName) {
  const std::string dir = ::testing::TempDir();
  EXPECT_NO_THROW(check_state_dir_space(dir, 4096));
  try {
    check_state_dir_space(dir, int64_t{1} << 60);  // an exbibyte
    ADD_FAILURE() << "an exbibyte of state was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind(dir + " has ", 0), 0u) << what;
    EXPECT_NE(what.find("the optimizer state files need 1073741824.00 GiB"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  EXPECT_THROW(check_state_dir_space(dir + "/no-such-folder", 1), std::invalid_argument);
}

TEST(StateWindow, WindowBytesAndChunksFollowTheWindow) {
  const StateOptions o = StateOptions().placement(StatePlacement::file).window_bytes(1 << 20);
  // One of the kStateWindowSlots buffers per chunk: 128 KiB, 32K fp32 values ... 256K 4-bit ones.
  EXPECT_EQ(state_buffer_bytes(1 << 22, StateOptions(o).precision(StatePrecision::fp32)).window, 128 << 10);
  EXPECT_EQ(state_buffer_bytes(1 << 22, StateOptions(o).precision(StatePrecision::int8)).window, 128 << 10);
  EXPECT_EQ(state_buffer_bytes(1 << 22, StateOptions(o).precision(StatePrecision::int4)).window, 128 << 10);
  EXPECT_EQ(state_buffer_bytes(1 << 22, StateOptions(o).precision(StatePrecision::int8)).in_files, 1 << 22);
  // A parameter smaller than a chunk takes all of its file: whole pages.
  EXPECT_EQ(state_buffer_bytes(8192, StateOptions(o).precision(StatePrecision::int8)).window, 8192);
  EXPECT_EQ(state_buffer_bytes(5000, StateOptions(o).precision(StatePrecision::int8)).window, 8192);
  StateBuffer b(at::zeros({1 << 22}), true, StateOptions(o).precision(StatePrecision::fp32).mmap_dir(::testing::TempDir()));
  EXPECT_EQ(b.chunk(), 32 << 10);
  EXPECT_TRUE(b.windowed());
  // However small the window, a chunk is 8192 values: whole pages of the file in every precision.
  const StateOptions tiny = StateOptions(o).window_bytes(1024);
  EXPECT_EQ(
      StateBuffer(at::zeros({1 << 16}), true, StateOptions(tiny).precision(StatePrecision::int4).mmap_dir(::testing::TempDir())).chunk(),
      8192);
  EXPECT_EQ(state_buffer_bytes(1 << 16, StateOptions(tiny).precision(StatePrecision::int4)).window, 4096);
}

// Reading ahead: prefetch returns at once and the window's reader brings the chunks into its
// buffers, in order, as buffers come free; what the update writes there reaches the file (read
// back through the mapping a checkpoint copies). Direct and buffered writes.
TEST(StateWindow, ChunksAreReadAheadUpdatedInTheWindowAndWrittenBack) {
  for (bool buffered : {false, true}) {
    SCOPED_TRACE(buffered ? "buffered" : "direct");
    const BufferedIo io(buffered);
    const at::Tensor param = at::zeros({64, 8192});  // 64 chunks of 8192 int8 codes: a 64 KiB window holds 8
    StateBuffer state(param, /*is_signed=*/true,
                      StateOptions()
                          .precision(StatePrecision::int8)
                          .placement(StatePlacement::file)
                          .mmap_dir(::testing::TempDir())
                          .window_bytes(64 << 10));
    ASSERT_EQ(state.chunk(), 8192);
    const int64_t n = param.numel(), chunks = n / state.chunk();
    TensorDict saved{{"m", at::randn({n})}};
    state.restore(saved, "m");  // through the mapping, then dropped from it
    std::map<std::string, at::Tensor> views;
    state.save(views, "m");
    const at::Tensor expected = views.at("m.codes").clone();
    ASSERT_EQ(expected.numel(), n);

    state.prefetch(0, 3 * state.chunk());
    for (int i = 0; i < 1000 && optim::detail::WindowPool::get().ready_slots() < 3; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(optim::detail::WindowPool::get().ready_slots(), 3) << "chunks read ahead by the window's reader";
    // The rest queued behind: more than the window holds; each read as a buffer is written back.
    state.prefetch(0, n);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t b = c * state.chunk();
      uint8_t* codes = state.acquire_slot(b, b + state.chunk());
      ASSERT_EQ(std::memcmp(codes, expected.data_ptr<uint8_t>() + b, static_cast<size_t>(state.chunk())), 0) << "chunk " << c;
      for (int64_t i = 0; i < state.chunk(); ++i) codes[i] = static_cast<uint8_t>(codes[i] ^ 0x5a);
      state.release_slot(b, b + state.chunk());
    }
    views.clear();
    state.save(views, "m");  // waits for the writes
    EXPECT_TRUE(at::equal(views.at("m.codes"), expected.bitwise_xor(0x5a))) << "the updates in the file";
    EXPECT_EQ(optim::detail::WindowPool::get().ready_slots(), 0);
  }
}

// With direct I/O, the window's reads and writes leave no pages in the page cache, except the
// chunks said to be read ahead into it (cached), which are copied from there; every chunk whole
// either way, also one said to be cached that is not.
TEST(StateWindow, ReadsTakeThePageCachesPagesAndTheRestFromTheDisk) {
  std::string path = ::testing::TempDir() + "/frugal-window-read-XXXXXX";
  const int fd = ::mkstemp(&path[0]);
  ASSERT_GE(fd, 0);
  const int direct = ::open(path.c_str(), O_RDWR | O_DIRECT | O_CLOEXEC);
  ::unlink(path.c_str());
  if (direct < 0) {
    ::close(fd);
    GTEST_SKIP() << "no direct I/O in " << ::testing::TempDir();
  }
  constexpr size_t kChunk = size_t{256} << 10, kChunks = 4, kBytes = kChunk * kChunks, kPageBytes = 4096;
  std::vector<uint8_t> bytes(kBytes);
  for (size_t i = 0; i < kBytes; ++i) bytes[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  ASSERT_EQ(::pwrite(fd, bytes.data(), kBytes, 0), static_cast<ssize_t>(kBytes));
  ASSERT_EQ(::fsync(fd), 0);
  // The cache emptied, and the kernel's own reading ahead off: a read caches what it asks for.
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
  ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
  void* map = ::mmap(nullptr, kBytes, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(map, MAP_FAILED);
  auto cached_pages = [&](size_t first, size_t n) {
    std::vector<unsigned char> in(n / kPageBytes);
    EXPECT_EQ(::mincore(static_cast<char*>(map) + first, n, in.data()), 0);
    return std::count_if(in.begin(), in.end(), [](unsigned char c) { return (c & 1) != 0; });
  };
  ASSERT_EQ(cached_pages(0, kBytes), 0) << "the file's pages were dropped from the cache";
  // Chunk 1 read ahead into the cache; chunk 3 said to be and not.
  ASSERT_EQ(::readahead(fd, kChunk, kChunk), 0);
  std::vector<uint8_t> sink(kChunk);
  ASSERT_EQ(::pread(fd, sink.data(), kChunk, kChunk), static_cast<ssize_t>(kChunk));  // waits for it
  ASSERT_EQ(cached_pages(kChunk, kChunk), static_cast<long>(kChunk / kPageBytes));

  optim::detail::WindowPool& pool = optim::detail::WindowPool::get();
  pool.attach(fd, direct, kChunk);
  pool.cached(fd, kChunk, kChunk, kChunk);
  pool.cached(fd, 3 * kChunk, kChunk, kChunk);
  pool.read_ahead(fd, 2 * kChunk, 2 * kChunk, kChunk, /*urgent=*/false);  // chunks 2 and 3 by the reader
  for (size_t c = 0; c < kChunks; ++c) {
    const uint8_t* chunk = pool.acquire(fd, c * kChunk, kChunk);
    EXPECT_EQ(std::memcmp(chunk, bytes.data() + c * kChunk, kChunk), 0) << "chunk " << c;
    if (c != 3) {
      EXPECT_EQ(cached_pages(c * kChunk, kChunk), c == 1 ? static_cast<long>(kChunk / kPageBytes) : 0)
          << "chunk " << c << (c == 1 ? " is still in the cache" : " was read past the cache");
    }
    pool.release(fd, c * kChunk);
  }
  pool.settle(fd);
  EXPECT_EQ(cached_pages(0, kBytes), 0) << "the direct writes dropped the pages read before";
  pool.detach(fd);
  ::munmap(map, kBytes);
  ::close(direct);
  ::close(fd);
}
