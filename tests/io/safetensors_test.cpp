// safetensors: round trips, hand-corrupted files rejected with clear errors, and a bounded
// random-mutation fuzz of the header and its length (every mutant is rejected or reads cleanly).
#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "frugal/io/json_value.h"
#include "frugal/io/safetensors.h"
#include "frugal/io/units.h"
#include "frugal/memory/process.h"
#include "frugal/memory/tracker.h"
#include "../support/common.h"

using namespace frugal::io;

namespace {

using frugal::testing::temp_path;

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file made of a given header and data section.
std::string make_file(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((header.size() >> (8 * i)) & 0xFF);
  return out + header + data;
}

void expect_rejected(const std::string& bytes, const std::string& needle) {
  const std::string path = temp_path("bad");
  write_all(path, bytes);
  try {
    SafetensorsReader r(path);
    FAIL() << "accepted a bad file; expected: " << needle;
  } catch (const SafetensorsError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeAndShape) {
  torch::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"f32", at::randn({3, 4})},
      {"bf16", at::randn({5}).to(at::kBFloat16)},
      {"f16", at::randn({2, 2}).to(at::kHalf)},
      {"i64", at::arange(7, at::kLong)},
      {"bool", at::rand({4}) > 0.5},
      {"scalar", at::scalar_tensor(3.5)},
      {"empty", at::zeros({0, 3})},
      {"strided", at::randn({4, 6}).t()},  // stored contiguous
  };
  const std::string path = temp_path("roundtrip.safetensors");
  write_safetensors(path, tensors, {{"format", "pt"}});
  SafetensorsReader r(path);
  ASSERT_EQ(r.tensors().size(), tensors.size());
  EXPECT_EQ(r.metadata().at("format"), "pt");
  for (const auto& [name, t] : tensors) {
    const at::Tensor back = r.load(name);
    EXPECT_EQ(back.scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(back.sizes(), t.sizes()) << name;
    EXPECT_TRUE(at::equal(back, t.contiguous())) << name;
  }
  EXPECT_THROW(r.load("nope"), SafetensorsError);
  EXPECT_THROW(write_safetensors(path, {{"a", at::zeros({1})}, {"a", at::zeros({1})}}), SafetensorsError);
}

TEST(Safetensors, HandCorruptedFilesAreRejectedWithTheReason) {
  const std::string ok_header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data(8, '\x01');
  expect_rejected("short", "too short");
  std::string huge_len = make_file(ok_header, data);
  huge_len[7] = '\x7f';  // header length ~ 9e18
  expect_rejected(huge_len, "exceeds the file");
  expect_rejected(make_file(ok_header, data).substr(0, 30), "exceeds the file");
  expect_rejected(make_file(ok_header, data.substr(0, 4)), "ends at byte 8 but the data section has 4");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", data), "not valid JSON");
  expect_rejected(make_file(R"([1,2])", data), "not a JSON object");
  expect_rejected(make_file(R"({"w":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", data), "unsupported dtype 'Q7'");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data), "need 12");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data), "non-negative");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", data), "bad data_offsets");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data), "data_offsets");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,8]}})", data), "overflows");
  expect_rejected(make_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                            R"("b":{"dtype":"U8","shape":[4],"data_offsets":[4,8]}})",
                            data),
                  "overlap");
  expect_rejected(make_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"w":{}})", data), "duplicate key");
  expect_rejected(make_file(std::string(200, '[') + std::string(200, ']'), data), "deeper than 64");
  expect_rejected(make_file(R"({"__metadata__":{"a":1}})", data), "not a string");
}

TEST(Safetensors, RandomMutationsAreRejectedOrReadCleanly) {
  torch::manual_seed(1);
  const std::string path = temp_path("seed.safetensors");
  write_safetensors(path, {{"alpha", at::randn({3, 5})}, {"beta", at::arange(6, at::kLong)}, {"gamma", at::randn({2}).to(at::kBFloat16)}},
                    {{"k", "v"}});
  const std::string seed = read_all(path);
  const size_t header_end = 8 + static_cast<size_t>(static_cast<unsigned char>(seed[0]) | (static_cast<unsigned char>(seed[1]) << 8));
  std::mt19937 rng(12345);
  const char alphabet[] = "{}[]\":,0123456789-eE.FUIB \\ux";
  int accepted = 0, rejected = 0;
  const std::string mutant_path = temp_path("mutant.safetensors");
  for (int iter = 0; iter < 3000; ++iter) {
    std::string m = seed;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const uint32_t kind = rng() % 10;
      if (m.size() <= 8) break;
      if (kind == 0) {
        m[rng() % 8] = static_cast<char>(rng());  // the length field
      } else if (kind == 1) {
        m.resize(rng() % m.size());  // truncation
      } else if (kind == 2 && m.size() > 9) {
        m.erase(8 + rng() % (m.size() - 9), 1 + rng() % 3);
      } else {
        const size_t pos = 8 + rng() % std::max<size_t>(1, std::min(m.size(), header_end) - 8);
        m[std::min(pos, m.size() - 1)] = kind < 6 ? alphabet[rng() % (sizeof(alphabet) - 1)] : static_cast<char>(rng());
      }
    }
    write_all(mutant_path, m);
    try {
      SafetensorsReader r(mutant_path);
      for (const auto& t : r.tensors()) {
        const at::Tensor loaded = r.load(t.name);
        ASSERT_EQ(static_cast<uint64_t>(loaded.numel()) * loaded.element_size(), t.end - t.begin);
      }
      ++accepted;
    } catch (const SafetensorsError&) {
      ++rejected;
    }
  }
  EXPECT_GT(rejected, 1000);
  EXPECT_GT(accepted, 0);  // some mutations (e.g. in white space or data) are harmless
}

#if defined(__GLIBC__)
// A loader copies most of what it reads into place and drops it, while keeping smaller blocks it made
// meanwhile (resuming a checkpoint: each parameter's state read, restored, dropped; its scales kept).
// The dropped tensors go back to the system at once: under the trainer's heap settings
// (keep_freed_heap keeps freed heap resident, up to 1 GiB here) and below a live block, heap blocks
// would stay resident (1.4 GiB of them when the 7B recipe resumed). The tracker sees them come and go.
TEST(Safetensors, LoadedTensorsGiveTheirPagesBackWhenDroppedBelowLiveBlocks) {
  constexpr int kTensors = 32;
  constexpr int64_t kBytes = int64_t{4} << 20;  // under glibc's 32 MiB mmap threshold: heap blocks
  auto name = [](int i) {
    std::string n = "t";  // (not "t" + to_string: GCC 12 warns of a bogus overflow there)
    return n += std::to_string(i);
  };
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (int i = 0; i < kTensors; ++i) tensors.emplace_back(name(i), at::full({kBytes}, i, at::kByte));
  const std::string path = temp_path("pages.safetensors");
  write_safetensors(path, tensors);
  tensors.clear();
  {
    SafetensorsReader r(path);
    auto tracker = frugal::memory::Tracker::create();
    frugal::memory::TrackingGuard on(tracker);
    at::Tensor t = r.load("t3");
    EXPECT_EQ(tracker->live_bytes(), kBytes);
    EXPECT_TRUE(at::equal(t, at::full({kBytes}, 3, at::kByte)));
    t = at::Tensor();
    EXPECT_EQ(tracker->live_bytes(), 0);
  }
  // The heap's thresholds are the process's: set in a child.
  const int status = frugal::testing::in_child([&] {
    if (!frugal::memory::keep_freed_heap(int64_t{1} << 30)) return 4;
    SafetensorsReader r(path);
    std::vector<at::Tensor> loaded;
    for (int i = 0; i < kTensors; ++i) {
      loaded.push_back(r.load(name(i)));
      if (loaded.back().data_ptr<uint8_t>()[kBytes - 1] != i) return 7;
    }
    const at::Tensor live = at::ones({4096}, at::kByte);  // made after them: the heap's top stays in use
    const int64_t all = frugal::memory::process_memory().rss;
    loaded.clear();
    const int64_t after = frugal::memory::process_memory().rss;
    std::fprintf(stderr, "resident %lld MiB with the tensors, %lld MiB once dropped\n", static_cast<long long>(all >> 20),
                 static_cast<long long>(after >> 20));
    if (all <= 0 || live.data_ptr<uint8_t>()[4095] != 1) return 5;
    return all - after >= kTensors * kBytes * 15 / 16 ? 0 : 6;  // nearly all of the 128 MiB
  });
  EXPECT_EQ(status, 0) << "4: keep_freed_heap refused, 5: no resident figure, 6: the dropped tensors stayed resident, 7: wrong bytes";
}
#endif

TEST(JsonParse, ValuesAndErrors) {
  const JsonValue v = parse_json(R"( {"a": [1, -2.5e3, true, null, "x\u00e9\n"], "b": {"c": 9007199254740993}} )");
  EXPECT_EQ(v.at("a").items()[0].as_int(), 1);
  EXPECT_DOUBLE_EQ(v.at("a").items()[1].as_double(), -2500.0);
  EXPECT_TRUE(v.at("a").items()[2].as_bool());
  EXPECT_TRUE(v.at("a").items()[3].is_null());
  EXPECT_EQ(v.at("a").items()[4].as_string(), "x\xc3\xa9\n");
  EXPECT_EQ(v.at("b").at("c").as_int(), 9007199254740993LL);
  for (const char* bad : {"", "{", "[1,]", "{\"a\":1,}", "01", "1.", "\"\\q\"", "\"\\ud800\"", "tru", "1 2", "{\"a\" 1}", "\"a\nb\""}) {
    EXPECT_THROW(parse_json(bad), JsonError) << bad;
  }
  // Past int64 an integer literal is still a JSON number (transformers writes 10^30): a double, not
  // an integer, so as_int refuses it rather than wrapping (json_test.cpp has the 10^30 case).
  EXPECT_FALSE(parse_json("99999999999999999999").is_integer());
  EXPECT_THROW(parse_json("99999999999999999999").as_int(), JsonError);
  EXPECT_THROW(v.at("zzz"), JsonError);
  EXPECT_THROW(v.at("a").as_int(), JsonError);
}

TEST(JsonParse, StreamsOneArrayItemByItem) {
  // The streamed member's items reach the sink in order and are not kept; the rest parses as usual,
  // a nested array of the same name is not streamed, and errors after streamed items still throw.
  const std::string text = R"({"head": 1, "events": [{"t": 1}, {"t": 2}, [3]], "x": {"events": [4]}})";
  std::vector<std::string> seen;
  const JsonValue v = parse_json_streaming(text, "events", [&](const JsonValue& item) {
    seen.push_back(item.is_object() ? "t" + std::to_string(item.at("t").as_int()) : "array");
  });
  EXPECT_EQ(seen, (std::vector<std::string>{"t1", "t2", "array"}));
  EXPECT_TRUE(v.at("events").items().empty());
  EXPECT_EQ(v.at("head").as_int(), 1);
  EXPECT_EQ(v.at("x").at("events").items().size(), 1u);
  // the same document parses whole with parse_json
  EXPECT_EQ(parse_json(text).at("events").items().size(), 3u);
  const auto ignore = [](const JsonValue&) {};
  EXPECT_THROW(parse_json_streaming(R"({"events": [1, 2,]})", "events", ignore), JsonError);
  EXPECT_THROW(parse_json_streaming(R"({"events": [1], "events": []})", "events", ignore), JsonError);
  EXPECT_THROW(parse_json_streaming(R"({"events": [1]} x)", "events", ignore), JsonError);
  // not an array: kept as a value, not streamed
  EXPECT_EQ(parse_json_streaming(R"({"events": 5})", "events", ignore).at("events").as_int(), 5);
  // the sink's exception stops the parse
  EXPECT_THROW(parse_json_streaming(R"({"events": [1, 2]})", "events", [](const JsonValue&) { throw std::invalid_argument("no"); }),
               std::invalid_argument);
}

TEST(Units, ParseAndPrintBytes) {
  EXPECT_EQ(parse_bytes("512"), 512);
  EXPECT_EQ(parse_bytes("64MiB"), 64LL << 20);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3LL << 29);
  EXPECT_EQ(parse_bytes("20M"), 20LL << 20);
  EXPECT_EQ(parse_bytes("4K"), 4096);
  for (const char* bad : {"", "-1", "12XB", "1.5", "MiB", " 3", "1e400"}) EXPECT_FALSE(parse_bytes(bad).has_value()) << bad;
  EXPECT_EQ(human_bytes(3 << 20), "3.00 MiB");
  EXPECT_EQ(human_bytes(100), "100 B");
}
