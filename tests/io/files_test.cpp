// The one file-opening function (a FIFO, a device, a folder or a socket refused by name without
// blocking; a size bound; reads stop at the size at open), every library reader going through it,
// and the one temporary-folder owner (removed on an exception and on SIGINT, SIGTERM, SIGHUP).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "frugal/data/corpus.h"
#include "frugal/data/examples.h"
#include "frugal/data/tokenizer.h"
#include "frugal/io/files.h"
#include "frugal/io/safetensors.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/train/recipe.h"
#include "frugal/train/run_state.h"
#include "../support/common.h"

namespace io = frugal::io;

namespace {

using frugal::testing::write_file;

std::string fresh_dir(const std::string& name) {
  const std::string d = "/tmp/frugal_files_test_" + std::to_string(::getpid()) + "_" + name;
  io::remove_tree(d);
  io::make_directories(d);
  return d;
}

// Runs f in a child process that SIGALRM ends after `seconds` (a reader blocked in open fails the
// test instead of hanging it); returns what the child reported: "ok:<message>" when f threw
// std::invalid_argument or a SafetensorsError, else a description of what happened.
std::string in_child(const std::function<void()>& f, unsigned seconds = 5) {
  int fds[2];
  if (::pipe(fds) != 0) return "no pipe";
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    ::alarm(seconds);
    std::string report;
    try {
      f();
      report = "returned without an error";
    } catch (const std::invalid_argument& e) {
      report = std::string("ok:") + e.what();
    } catch (const io::SafetensorsError& e) {
      report = std::string("ok:") + e.what();
    } catch (const std::exception& e) {
      report = std::string("another exception: ") + e.what();
    }
    (void)!::write(fds[1], report.data(), report.size());
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string got;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) > 0;) got.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return "the child was ended by signal " + std::to_string(WTERMSIG(status)) + " (blocked or too slow)";
  return got;
}

bool has_control_byte(const std::string& s) {
  for (const char c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) return true;
  }
  return false;
}

// The things that are not regular files, each made at `path`, with the word the refusal uses.
struct Hostile {
  const char* name;
  const char* says;
  std::function<void(const std::string&)> make;
};

const std::vector<Hostile>& hostile_kinds() {
  static const std::vector<Hostile> kinds = {
      {"fifo", "is a FIFO, not a regular file", [](const std::string& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0644), 0); }},
      {"dev_zero_link", "is a character device, not a regular file",
       [](const std::string& p) { ASSERT_EQ(::symlink("/dev/zero", p.c_str()), 0); }},
      {"folder", "is a folder, not a regular file", [](const std::string& p) { io::make_directories(p); }},
  };
  return kinds;
}

}  // namespace

TEST(Files, OpenRefusesAFifoWithoutBlocking) {
  const std::string d = fresh_dir("fifo");
  ASSERT_EQ(::mkfifo((d + "/f").c_str(), 0644), 0);
  EXPECT_EQ(in_child([&] { io::open_regular_file(d + "/f", "token file"); }), "ok:token file " + d + "/f is a FIFO, not a regular file");
  EXPECT_EQ(in_child([&] { io::read_file(d + "/f", io::kPointerFileBytes); }), "ok:" + d + "/f is a FIFO, not a regular file");
  io::remove_tree(d);
}

TEST(Files, OpenRefusesADevZeroLinkAFolderAndASocketByName) {
  const std::string d = fresh_dir("kinds");
  ASSERT_EQ(::symlink("/dev/zero", (d + "/zero").c_str()), 0);
  io::make_directories(d + "/dir");
  const int s = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s/sock", d.c_str());
  ASSERT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  for (const auto& [name, says] : std::vector<std::pair<std::string, std::string>>{{"zero", "is a character device, not a regular file"},
                                                                                   {"dir", "is a folder, not a regular file"},
                                                                                   {"sock", "is a socket, not a regular file"},
                                                                                   {"missing", "does not exist"}}) {
    EXPECT_EQ(in_child([&] { io::read_file(d + "/" + name, io::kMetadataFileBytes, "config"); }),
              "ok:config " + d + "/" + name + " " + says);
  }
  ::close(s);
  io::remove_tree(d);
}

TEST(Files, AFileWithoutAKnownSizeIsRefusedAnEmptyOneRead) {
  // /proc's files say they hold 0 bytes: what they hold is not bounded by a size, so refused.
  EXPECT_EQ(in_child([] { io::read_file("/proc/self/status", io::kMetadataFileBytes, "corpus file"); }),
            "ok:corpus file /proc/self/status has no size the system knows (a file such as those under /proc); copy it to a regular "
            "file");
  const std::string d = fresh_dir("empty");
  write_file(d + "/empty", "");
  EXPECT_EQ(io::read_file(d + "/empty", io::kPointerFileBytes), "");
  io::remove_tree(d);
}

TEST(Files, ReadFileRefusesAFileLargerThanItsBoundNamingTheBound) {
  const std::string d = fresh_dir("bound");
  write_file(d + "/latest", std::string(io::kPointerFileBytes, 'x'));
  EXPECT_EQ(io::read_file(d + "/latest", io::kPointerFileBytes).size(), io::kPointerFileBytes);
  write_file(d + "/latest", std::string(io::kPointerFileBytes + 1, 'x'));
  try {
    io::read_file(d + "/latest", io::kPointerFileBytes);
    ADD_FAILURE() << "a file over its bound was read";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), d + "/latest is 4097 bytes, more than the 4096 (4.0 KiB) frugal reads of a file of its kind");
  }
  io::remove_tree(d);
}

TEST(Files, AGrowingFileIsReadOnlyToItsSizeAtOpen) {
  const std::string d = fresh_dir("grow");
  write_file(d + "/corpus.txt", std::string(1000, 'a'));
  io::ReadableFile f = io::open_regular_file(d + "/corpus.txt");
  EXPECT_EQ(f.size(), 1000u);
  std::ofstream(d + "/corpus.txt", std::ios::app) << std::string(5000, 'b');  // a writer still at work
  std::string got;
  char buf[300];
  for (size_t n; (n = f.read(buf, sizeof(buf))) > 0;) got.append(buf, n);
  EXPECT_EQ(got, std::string(1000, 'a'));
  // read_file likewise: the size at open, whatever is appended after.
  EXPECT_EQ(io::read_file(d + "/corpus.txt", io::kMetadataFileBytes).size(), 6000u);
  io::remove_tree(d);
}

TEST(Files, PrintableEscapesControlBytesKeepsUtf8AndCuts) {
  EXPECT_EQ(io::printable(std::string("step-\0\x1b[2J", 10)), "step-\\x00\\x1b[2J");
  EXPECT_EQ(io::printable("caf\xC3\xA9 \xE2\x96\x81"), "caf\xC3\xA9 \xE2\x96\x81");
  EXPECT_EQ(io::printable("\xC3(\xFF\xC2\x85"), "\\xc3(\\xff\\xc2\\x85");  // broken UTF-8; a C1 control
  EXPECT_EQ(io::printable(std::string(100, 'x'), 10), "xxxxxxxxxx...");
}

// Every library reader of a file goes through the checked opening: each kind of hostile file,
// in each reader's place, is refused by name in a child process that would otherwise hang or read
// /dev/zero until memory runs out; no message carries a control byte.
TEST(Files, EveryReaderRefusesAFifoADevZeroLinkAndAFolderByName) {
  struct Reader {
    const char* name;
    const char* file;  // the hostile file's name in the folder
    std::function<void(const std::string& dir)> read;
  };
  const std::vector<Reader> readers = {
      {"safetensors", "model.safetensors", [](const std::string& d) { io::SafetensorsReader r(d + "/model.safetensors"); }},
      {"token file", "data.tokens", [](const std::string& d) { frugal::data::TokenFile t(d + "/data.tokens"); }},
      {"examples file", "train.examples", [](const std::string& d) { frugal::data::ExampleFile e(d + "/train.examples"); }},
      {"corpus", "corpus.txt", [](const std::string& d) { frugal::data::read_corpus(d + "/corpus.txt"); }},
      {"tokenizer.model", "tok.model", [](const std::string& d) { frugal::data::Tokenizer::load(d + "/tok.model"); }},
      {"tokenizer.json", "tokenizer.json", [](const std::string& d) { frugal::data::Tokenizer::load(d + "/tokenizer.json"); }},
      {"config.json", "config.json", [](const std::string& d) { frugal::models::read_hf_config(d + "/config.json"); }},
      {"recipe", "recipe.yaml", [](const std::string& d) { frugal::train::load_recipe(d + "/recipe.yaml"); }},
      {"latest", "latest", [](const std::string& d) { frugal::train::latest_checkpoint(d); }},
      {"trainer_state.json", "trainer_state.json", [](const std::string& d) { frugal::train::read_trainer_state(d); }},
  };
  for (const Reader& r : readers) {
    for (const Hostile& h : hostile_kinds()) {
      // A corpus and a tokenizer may be folders.
      const std::string reader = r.name;
      if (std::string(h.name) == "folder" && (reader == "corpus" || reader.rfind("tokenizer", 0) == 0)) continue;
      const std::string d = fresh_dir(std::string("readers_") + h.name);
      h.make(d + "/" + r.file);
      const std::string got = in_child([&] { r.read(d); });
      EXPECT_EQ(got.rfind("ok:", 0), 0u) << r.name << " with " << h.name << ": " << got;
      EXPECT_NE(got.find(h.says), std::string::npos) << r.name << " with " << h.name << ": " << got;
      EXPECT_NE(got.find(d + "/" + r.file), std::string::npos) << r.name << " with " << h.name << ": " << got;
      EXPECT_FALSE(has_control_byte(got)) << r.name << " with " << h.name;
      io::remove_tree(d);
    }
  }
}

TEST(Files, LatestHoldingBinaryIsQuotedEscapedAndCut) {
  const std::string d = fresh_dir("latest");
  write_file(d + "/latest", std::string("step-\0\0\x1b[31m", 12) + std::string(3000, 'z'));
  try {
    frugal::train::latest_checkpoint(d);
    ADD_FAILURE() << "a binary latest was accepted";
  } catch (const std::invalid_argument& e) {
    const std::string what = e.what();
    EXPECT_FALSE(has_control_byte(what)) << what;
    EXPECT_NE(what.find("step-\\x00\\x00\\x1b[31m"), std::string::npos) << what;
    EXPECT_LT(what.size(), 300u) << what;
  }
  io::remove_tree(d);
}

TEST(FilesTempDir, MadeUnderTmpdirAndRemovedWholeOnAnException) {
  const std::string base = fresh_dir("tmpdir");
  const char* old = std::getenv("TMPDIR");
  const std::string saved = old ? old : "";
  ::setenv("TMPDIR", base.c_str(), 1);
  std::string made;
  try {
    const io::TempDir t("frugal-test");
    made = t.path();
    io::make_directories(made + "/a/b");
    write_file(made + "/a/b/c", "x");
    ASSERT_EQ(::symlink("/etc", (made + "/a/etc").c_str()), 0);  // a link is removed, not followed
    throw std::runtime_error("a failure midway");
  } catch (const std::runtime_error&) {
  }
  if (old)
    ::setenv("TMPDIR", saved.c_str(), 1);
  else
    ::unsetenv("TMPDIR");
  EXPECT_EQ(made.rfind(base + "/frugal-test-" + std::to_string(::getpid()) + "-", 0), 0u) << made;
  EXPECT_FALSE(io::path_exists(made));
  EXPECT_TRUE(io::path_exists("/etc/passwd"));
  io::remove_tree(base);
}

TEST(FilesTempDir, RemovedWhenTheProcessIsEndedBySigintSigtermOrSighup) {
  for (const int sig : {SIGTERM, SIGINT, SIGHUP}) {
    struct sigaction now {};
    ::sigaction(sig, nullptr, &now);
    if (now.sa_handler == SIG_IGN) continue;  // ignored here (nohup): TempDir leaves it ignored, by design
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      ::alarm(20);  // a handler that does not end the process fails the test, never hangs it
      const io::TempDir t("frugal-test-signal");
      io::make_directories(t.path() + "/deep/er");
      write_file(t.path() + "/deep/er/file", std::string(10000, 'x'));
      const std::string line = t.path() + "\n";
      (void)!::write(fds[1], line.data(), line.size());
      for (;;) ::pause();
    }
    ::close(fds[1]);
    std::string path;
    char c;
    while (::read(fds[0], &c, 1) == 1 && c != '\n') path += c;
    ::close(fds[0]);
    ASSERT_FALSE(path.empty());
    EXPECT_TRUE(io::path_exists(path + "/deep/er/file"));
    ::kill(pid, sig);
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "signal " << sig << ": status " << status;
    EXPECT_FALSE(io::path_exists(path)) << "signal " << sig << " left " << path;
    io::remove_tree(path);
  }
}

TEST(FilesTempDir, TheFoldersOfDeadProcessesAreRemovedOthersKept) {
  const std::string base = fresh_dir("stale");
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  const std::string dead = base + "/frugal-test-" + std::to_string(child) + "-abcdef";
  const std::string live = base + "/frugal-test-" + std::to_string(::getppid()) + "-abcdef";
  const std::string other = base + "/frugal-other-" + std::to_string(child) + "-abcdef";
  for (const auto& p : {dead, live, other}) io::make_directories(p + "/x");
  EXPECT_EQ(io::TempDir::remove_stale("frugal-test", base), 1);
  EXPECT_FALSE(io::path_exists(dead));
  EXPECT_TRUE(io::path_exists(live));
  EXPECT_TRUE(io::path_exists(other));
  io::remove_tree(base);
}

// Free space is asked of the folder, or of its nearest existing parent while it does not exist yet
// (a run's train.out_dir before its first checkpoint).
TEST(Files, FreeSpaceOfAMissingFolderIsItsNearestParentsFileSystems) {
  const std::string dir = ::testing::TempDir();
  const int64_t here = frugal::io::free_space(dir);
  ASSERT_GT(here, 0);
  for (const std::string& missing : {dir + "/frugal_no_such/a/b/", dir + "/frugal_no_such"}) {
    const int64_t there = frugal::io::free_space(missing);
    EXPECT_GT(there, 0) << missing;
    EXPECT_LT(std::llabs(there - here), int64_t{1} << 30) << missing;  // the same file system, give or take other writers
  }
  EXPECT_GT(frugal::io::free_space("frugal_no_such_relative/x"), 0);  // the working folder's
  EXPECT_GT(frugal::io::free_space(""), 0);
}
