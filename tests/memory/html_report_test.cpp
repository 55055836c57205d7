// The HTML report: the replay's peak and breakdown, downsampling that keeps the exact peak, step
// tables with and without summaries, and a page that fetches nothing and cannot be broken out of.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <ctime>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "frugal/memory/html_report.h"
#include "frugal/memory/trace.h"

using namespace frugal;
using memory::Category;
using memory::Phase;

namespace {

int64_t bytes_in(const memory::CategoryBytes& b, Category c) { return b[static_cast<int>(c)]; }

// parameter 1000 at step -1; step 0: forward keeps 300 of activations (and a 50-byte temporary),
// backward frees them and makes a 1000-byte gradient; step 1: a smaller forward.
const char* kTrace = R"({"categories": ["parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other"],
"steps": [{"step": 0, "peak_bytes": 2000, "breakdown": {"parameter": 1000, "gradient": 1000}},
          {"step": 1, "peak_bytes": 2100, "breakdown": {"parameter": 1000, "gradient": 1000, "activation": 100}}],
"events": [
{"time_us": 10, "action": "alloc", "bytes": 1000, "category": "parameter", "phase": "idle", "device": "cpu", "step": -1, "addr": 1},
{"time_us": 20, "action": "step", "bytes": 0, "category": "other", "phase": "idle", "device": "cpu", "step": 0, "addr": 0},
{"time_us": 21, "action": "phase_begin", "bytes": 0, "category": "activation", "phase": "forward", "device": "cpu", "step": 0, "addr": 0},
{"time_us": 22, "action": "alloc", "bytes": 300, "category": "activation", "phase": "forward", "device": "cpu", "step": 0, "addr": 2},
{"time_us": 23, "action": "alloc", "bytes": 50, "category": "temporary", "phase": "forward", "device": "cpu", "step": 0, "addr": 3},
{"time_us": 24, "action": "free", "bytes": 50, "category": "temporary", "phase": "forward", "device": "cpu", "step": 0, "addr": 3},
{"time_us": 30, "action": "phase_end", "bytes": 0, "category": "activation", "phase": "forward", "device": "cpu", "step": 0, "addr": 0},
{"time_us": 31, "action": "phase_begin", "bytes": 0, "category": "gradient", "phase": "backward", "device": "cpu", "step": 0, "addr": 0},
{"time_us": 32, "action": "alloc", "bytes": 1000, "category": "gradient", "phase": "backward", "device": "cpu", "step": 0, "addr": 4},
{"time_us": 33, "action": "free", "bytes": 300, "category": "activation", "phase": "backward", "device": "cpu", "step": 0, "addr": 2},
{"time_us": 40, "action": "phase_end", "bytes": 0, "category": "gradient", "phase": "backward", "device": "cpu", "step": 0, "addr": 0},
{"time_us": 50, "action": "step", "bytes": 0, "category": "other", "phase": "idle", "device": "cpu", "step": 1, "addr": 0},
{"time_us": 52, "action": "alloc", "bytes": 100, "category": "activation", "phase": "forward", "device": "cpu", "step": 1, "addr": 5},
{"time_us": 53, "action": "free", "bytes": 100, "category": "activation", "phase": "forward", "device": "cpu", "step": 1, "addr": 5}
]})";

}  // namespace

TEST(HtmlReport, ReadsEventsAndStepSummaries) {
  const memory::Trace t = memory::read_trace(kTrace);
  EXPECT_EQ(t.events.size(), 14u);
  ASSERT_EQ(t.steps.size(), 2u);
  EXPECT_EQ(t.steps[1].step, 1);
  EXPECT_EQ(t.steps[1].peak_bytes, 2100);
  EXPECT_EQ(bytes_in(t.steps[1].breakdown, Category::activation), 100);
  EXPECT_EQ(bytes_in(t.steps[1].breakdown, Category::optimizer_state), 0);
  EXPECT_EQ(memory::read_trace(kTrace).events.size(), 14u);
}

TEST(HtmlReport, BadStepSummariesAreErrors) {
  EXPECT_THROW(memory::read_trace(R"({"steps": [{"step": 0, "peak_bytes": 1, "breakdown": {"weights": 1}}], "events": []})"),
               std::invalid_argument);
  EXPECT_THROW(memory::read_trace(R"({"steps": [{"step": 0}], "events": []})"), std::invalid_argument);
  EXPECT_NO_THROW(memory::read_trace(R"({"events": []})"));  // no summaries at all is fine
}

TEST(HtmlReport, ReplayGivesThePeakAndItsBreakdown) {
  const memory::Trace t = memory::read_trace(kTrace);
  const auto samples = memory::replay_live_bytes(t.events);
  ASSERT_EQ(samples.size(), 8u);  // one per alloc or free
  EXPECT_EQ(samples.back().total(), 2000);
  const memory::LiveSample peak = memory::peak_sample(samples);
  EXPECT_EQ(peak.total(), 2300);  // parameter + activation + gradient, before backward frees the activation
  EXPECT_EQ(peak.time_us, 32);
  EXPECT_EQ(peak.step, 0);
  EXPECT_EQ(peak.phase, Phase::backward);
  EXPECT_EQ(bytes_in(peak.bytes, Category::parameter), 1000);
  EXPECT_EQ(bytes_in(peak.bytes, Category::activation), 300);
  EXPECT_EQ(bytes_in(peak.bytes, Category::gradient), 1000);
  EXPECT_EQ(bytes_in(peak.bytes, Category::temporary), 0);
}

TEST(HtmlReport, ViewHasStepsPhasesAndTheTraceSummaries) {
  const memory::TraceView v = memory::view_trace(memory::read_trace(kTrace));
  EXPECT_EQ(v.start_us, 10);
  EXPECT_EQ(v.end_us, 53);
  EXPECT_EQ(v.n_events, 14u);
  EXPECT_EQ(v.peak.total(), 2300);
  const std::vector<std::pair<int64_t, int64_t>> starts{{0, 20}, {1, 50}};
  EXPECT_EQ(v.step_starts, starts);
  ASSERT_EQ(v.phases.size(), 2u);
  EXPECT_EQ(v.phases[0].phase, Phase::forward);
  EXPECT_EQ(v.phases[0].begin_us, 21);
  EXPECT_EQ(v.phases[0].end_us, 30);
  EXPECT_EQ(v.phases[1].phase, Phase::backward);
  EXPECT_FALSE(v.steps_from_events);
  EXPECT_EQ(v.steps.size(), 2u);
  EXPECT_EQ(v.note, "");
  EXPECT_EQ(v.devices, std::vector<std::string>{"cpu"});
}

TEST(HtmlReport, StepTableIsTheTracesSummariesAndItsPeakCoversTheirSteps) {
  const memory::TraceView v = memory::view_trace(memory::read_trace(kTrace));
  ASSERT_EQ(v.steps.size(), 2u);
  EXPECT_EQ(v.steps[1].peak_bytes, 2100);  // as written: the tracker's summaries are final
  EXPECT_EQ(v.steps_peak.peak_bytes, 2100);
  EXPECT_EQ(v.steps_peak.peak_step, 1);
  EXPECT_EQ(v.steps_peak.covers_first_step, 0);
  EXPECT_EQ(v.steps_peak.covers_last_step, 1);
  EXPECT_EQ(memory::describe_coverage(v.steps_peak), "steps 0-1");
  const std::string page = memory::html_report({{"a.json", memory::read_trace(kTrace)}});
  EXPECT_NE(page.find(R"("steps_peak":{"bytes":2100,"step":1,"phase":"idle","covers":"steps 0-1"})"), std::string::npos);
}

TEST(HtmlReport, StepPeaksComeFromTheEventsWithoutSummaries) {
  memory::Trace t = memory::read_trace(kTrace);
  t.steps.clear();
  const memory::TraceView v = memory::view_trace(t);
  ASSERT_TRUE(v.steps_from_events);
  ASSERT_EQ(v.steps.size(), 3u);  // -1, 0, 1
  EXPECT_EQ(v.steps[0].step, -1);
  EXPECT_EQ(v.steps[0].peak_bytes, 1000);
  EXPECT_EQ(v.steps[1].peak_bytes, 2300);
  EXPECT_EQ(bytes_in(v.steps[1].breakdown, Category::activation), 300);
  EXPECT_EQ(v.steps[2].peak_bytes, 2100);  // started at 2000 (parameter + gradient), plus 100
}

TEST(HtmlReport, NestedPhasesAndUnclosedOnes) {
  auto marker = [](int64_t t, memory::Action a, Phase p) {
    memory::MemoryEvent e;
    e.time_us = t;
    e.action = a;
    e.phase = p;
    return e;
  };
  memory::Trace t;
  t.events = {marker(0, memory::Action::phase_begin, Phase::backward), marker(10, memory::Action::phase_begin, Phase::optimizer),
              marker(12, memory::Action::phase_end, Phase::optimizer),
              marker(20, memory::Action::phase_begin, Phase::forward),  // never closed
              marker(30, memory::Action::step, Phase::idle)};
  const auto spans = memory::view_trace(t).phases;
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].phase, Phase::backward);
  EXPECT_EQ(spans[0].end_us, 10);
  EXPECT_EQ(spans[1].phase, Phase::optimizer);
  EXPECT_EQ(spans[2].phase, Phase::backward);
  EXPECT_EQ(spans[2].begin_us, 12);
  EXPECT_EQ(spans[3].phase, Phase::forward);
  EXPECT_EQ(spans[3].end_us, 30);
}

TEST(HtmlReport, DownsamplingKeepsTheExactPeak) {
  std::mt19937_64 rng(7);
  std::vector<memory::MemoryEvent> events;
  std::vector<memory::MemoryEvent> live;  // a stack: the newest allocation is freed first
  for (int i = 0; i < 200000; ++i) {
    memory::MemoryEvent e;
    if (!live.empty() && rng() % 2 && i != 123457) {
      e = live.back();
      e.action = memory::Action::free;
      live.pop_back();
    } else {
      e.action = memory::Action::alloc;
      e.category = memory::kAllCategories[rng() % memory::kNumCategories];
      e.bytes = static_cast<int64_t>(rng() % 4096) + (i == 123457 ? 1 << 20 : 0);  // one spike
      live.push_back(e);
    }
    e.time_us = i / 3;  // several events per microsecond, as on a busy allocator
    events.push_back(e);
  }
  const auto full = memory::replay_live_bytes(events);
  const auto reduced = memory::downsample_keep_peaks(full, 1000);
  EXPECT_LE(reduced.size(), 2001u);
  const memory::LiveSample exact = memory::peak_sample(full), kept = memory::peak_sample(reduced);
  EXPECT_EQ(kept.total(), exact.total());
  EXPECT_EQ(kept.time_us, exact.time_us);
  EXPECT_EQ(kept.bytes, exact.bytes);
  EXPECT_EQ(reduced.back().total(), full.back().total());  // the chart ends where the run did
  EXPECT_TRUE(std::is_sorted(reduced.begin(), reduced.end(),
                             [](const memory::LiveSample& a, const memory::LiveSample& b) { return a.time_us < b.time_us; }));
  // The dips survive too: the smallest total after the spike is in the reduced series.
  int64_t low_full = INT64_MAX, low_kept = INT64_MAX;
  for (const auto& s : full) low_full = std::min(low_full, s.total());
  for (const auto& s : reduced) low_kept = std::min(low_kept, s.total());
  EXPECT_EQ(low_kept, low_full);
}

TEST(HtmlReport, PageFetchesNothing) {
  const std::string page = memory::html_report({{"a.json", memory::read_trace(kTrace)}, {"b.json", memory::read_trace(kTrace)}});
  EXPECT_EQ(page.find("<script src"), std::string::npos);
  EXPECT_EQ(page.find("http://"), std::string::npos);
  EXPECT_EQ(page.find("https://"), std::string::npos);
  const std::regex link(R"((src|href)\s*=\s*["']?([^"'\s>]*))", std::regex::icase);
  for (auto it = std::sregex_iterator(page.begin(), page.end(), link); it != std::sregex_iterator(); ++it) {
    EXPECT_EQ((*it)[2].str().rfind("data:", 0), 0u) << "the page links to " << (*it)[2].str();
  }
  EXPECT_NE(page.find("\"name\":\"b.json\""), std::string::npos);
  EXPECT_NE(page.find("id=\"errors\""), std::string::npos);
  EXPECT_NE(page.find("dataset.rendered"), std::string::npos);
}

TEST(HtmlReport, ANameCannotCloseTheScript) {
  const std::string evil = "</script><script>alert(1)</script><!--";
  const std::string page = memory::html_report({{evil, memory::read_trace(kTrace)}});
  EXPECT_EQ(page.find(evil), std::string::npos);
  EXPECT_EQ(page.find("<script>alert"), std::string::npos);
  EXPECT_EQ(page.find("<!--"), std::string::npos);
  // Three scripts (error catcher, data, drawing) and so exactly three closing tags.
  size_t closes = 0;
  for (size_t pos = page.find("</script>"); pos != std::string::npos; pos = page.find("</script>", pos + 1)) ++closes;
  EXPECT_EQ(closes, 3u);
  EXPECT_NE(page.find(R"(\u003c/script>\u003cscript>alert(1)\u003c/script>\u003c!--)"), std::string::npos);
}

TEST(HtmlReport, ManyEventsGiveASmallPage) {
  memory::Trace t;
  for (int i = 0; i < 300000; ++i) {
    memory::MemoryEvent e;
    e.time_us = i;
    e.action = i % 2 ? memory::Action::free : memory::Action::alloc;
    e.bytes = 1000 + (i / 2) % 977;
    e.category = memory::kAllCategories[(i / 2) % memory::kNumCategories];
    t.events.push_back(e);
  }
  const std::string page = memory::html_report({{"big.json", t}});
  EXPECT_LT(page.size(), 200u * 1024) << "the page grows with the events";
}

namespace {

std::string event_json(int64_t time_us, const char* action, const std::string& bytes, const char* category) {
  return std::string(R"({"time_us": )") + std::to_string(time_us) + R"(, "action": ")" + action + R"(", "bytes": )" + bytes +
         R"(, "category": ")" + category + R"(", "phase": "idle", "device": "cpu", "step": 0, "addr": 1})";
}

std::string events_json(const std::vector<std::string>& events) {
  std::string out = R"({"events": [)";
  for (size_t i = 0; i < events.size(); ++i) out += (i ? ", " : "") + events[i];
  return out + "]}";
}

}  // namespace

// Every way a hostile trace could make the replay or the page draw negative or wrapped-around
// values is refused by the reader, with the culprit named.
TEST(HtmlReport, TracesThatWouldDrawNegativeMemoryAreRefused) {
  const std::string half = "4611686018427387904";  // 2^62: two of them reach 2^63
  auto refused = [](const std::string& text, const std::string& says) {
    try {
      memory::read_trace(text);
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "accepted: " << text;
  };
  // Allocations whose sum passes 2^63, in one category or spread over several.
  refused(events_json({event_json(0, "alloc", half, "other"), event_json(1, "alloc", half, "other")}), "2^63");
  refused(events_json({event_json(0, "alloc", half, "parameter"), event_json(1, "alloc", half, "activation")}), "2^63");
  // A free of more than its category holds, whether nothing, less, or only other categories are live.
  refused(events_json({event_json(0, "free", "1", "other")}), "frees 1 other bytes but only 0 are live");
  refused(events_json({event_json(0, "alloc", "10", "activation"), event_json(1, "free", "11", "activation")}),
          "event 1 frees 11 activation bytes but only 10 are live");
  refused(events_json({event_json(0, "alloc", half, "parameter"), event_json(1, "free", half, "gradient")}), "gradient");
  refused(events_json({event_json(0, "alloc", "-5", "other")}), "negative size");
  // Times far apart would overflow end - start.
  refused(events_json({event_json(-9223372036854775807, "alloc", "1", "other"), event_json(9223372036854775807, "free", "1", "other")}),
          "time_us -9223372036854775807 is outside 0 to 2^53");
  refused(R"({"steps": [{"step": 0, "peak_bytes": 1, "time_us": -1, "breakdown": {"other": 1}}], "events": []})", "negative time_us");
  refused(R"({"steps": [{"step": 0, "peak_bytes": 1, "breakdown": {"other": )" + half + R"(, "input": )" + half + "}}], \"events\": []}",
          "2^63");
  // What stays legal: allocations up to 2^63 - 1 in all, freed back to zero.
  const memory::Trace ok =
      memory::read_trace(events_json({event_json(0, "alloc", half, "other"), event_json(1, "alloc", "4611686018427387903", "input"),
                                      event_json(2, "free", half, "other")}));
  const auto samples = memory::replay_live_bytes(ok.events);
  for (const memory::LiveSample& s : samples) EXPECT_GE(s.total(), 0);
  EXPECT_EQ(memory::peak_sample(samples).total(), INT64_MAX);
}

namespace {

// A trace of n training steps as write_trace writes them: a summary per step, phase markers and
// an alloc/free pair per phase, and a parameter live throughout.
std::string trace_of_steps(int n) {
  memory::Trace t;
  memory::MemoryEvent param;
  param.action = memory::Action::alloc;
  param.bytes = 4096;
  param.category = Category::parameter;
  param.step = -1;
  t.events.push_back(param);
  int64_t now = 1;
  for (int s = 0; s < n; ++s) {
    for (Phase p : {Phase::forward, Phase::backward, Phase::optimizer}) {
      for (memory::Action a : {memory::Action::phase_begin, memory::Action::alloc, memory::Action::free, memory::Action::phase_end}) {
        memory::MemoryEvent e;
        e.time_us = now++;
        e.action = a;
        e.phase = p;
        e.step = s;
        e.bytes = a == memory::Action::alloc || a == memory::Action::free ? 100 + s % 7 : 0;
        e.category = memory::default_category(p);
        e.addr = static_cast<uint64_t>(s) + 10;
        t.events.push_back(e);
      }
    }
    memory::Tracker::StepSummary sum;
    sum.step = s;
    sum.peak_bytes = 4096 + 100 + s % 7;
    sum.time_us = now;
    sum.breakdown[static_cast<int>(Category::parameter)] = 4096;
    sum.breakdown[static_cast<int>(Category::activation)] = 100 + s % 7;
    t.steps.push_back(sum);
  }
  std::ostringstream out;
  memory::write_trace(out, t);
  return out.str();
}

double cpu_seconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// CPU seconds per step to read a trace of n steps and make its page (best of two: a busy
// machine slows one run, not both).
double report_seconds_per_step(int n) {
  const std::string text = trace_of_steps(n);
  double best = 1e9;
  for (int i = 0; i < 2; ++i) {
    const double t0 = cpu_seconds();
    const std::string page = memory::html_report({{"t.json", memory::read_trace(text)}});
    best = std::min(best, cpu_seconds() - t0);
    EXPECT_GT(page.size(), 0u);
  }
  return best / n;
}

}  // namespace

// The report's cost per step stays flat as the trace grows (a quadratic part would make it 8x
// from 5k to 40k steps); measured as a ratio within this one run, so machine speed cancels.
TEST(HtmlReport, TimePerStepIsFlatAsTheTraceGrows) {
  report_seconds_per_step(2000);  // warm the allocator
  const double small = report_seconds_per_step(5000), large = report_seconds_per_step(40000);
  EXPECT_LT(large / small, 2.0) << small * 1e6 << " us per step at 5k steps, " << large * 1e6 << " at 40k";
}

// Labels (frugal account's experiments) and the evaluation and sampling phases survive the file
// and reach the page, which names them on the chart.
TEST(HtmlReport, LabelsAndEvaluationPhasesReachThePage) {
  auto tracker = memory::Tracker::create();
  tracker->label("none");
  tracker->label("every_2");
  memory::Trace t = tracker->trace();
  ASSERT_EQ(t.labels.size(), 2u);
  EXPECT_EQ(t.labels[1].text, "every_2");
  EXPECT_LE(t.labels[0].time_us, t.labels[1].time_us);
  for (Phase p : {Phase::evaluation, Phase::sampling}) {
    for (memory::Action a : {memory::Action::phase_begin, memory::Action::phase_end}) {
      memory::MemoryEvent e;
      e.action = a;
      e.phase = p;
      e.time_us = static_cast<int64_t>(t.events.size()) + 5;
      t.events.push_back(e);
    }
  }
  std::ostringstream out;
  memory::write_trace(out, t);
  const memory::Trace back = memory::read_trace(out.str());
  ASSERT_EQ(back.labels.size(), 2u);
  EXPECT_EQ(back.labels[0].text, "none");
  EXPECT_EQ(back.labels[1].time_us, t.labels[1].time_us);
  ASSERT_EQ(back.events.size(), 4u);
  EXPECT_EQ(back.events[2].phase, Phase::sampling);
  const memory::TraceView v = memory::view_trace(back);
  ASSERT_EQ(v.phases.size(), 2u);
  EXPECT_EQ(v.phases[0].phase, Phase::evaluation);
  const std::string page = memory::html_report({{"a.json", back}});
  EXPECT_NE(page.find(R"("labels":[[)"), std::string::npos);
  EXPECT_NE(page.find(R"(,"every_2"])"), std::string::npos);
  EXPECT_NE(page.find(R"(["evaluation",)"), std::string::npos);
  EXPECT_THROW(memory::read_trace(R"({"labels": [{"time_us": -1, "text": "x"}], "events": []})"), std::invalid_argument);
  EXPECT_THROW(memory::read_trace(R"({"labels": [{"time_us": 1}], "events": []})"), std::invalid_argument);
}
