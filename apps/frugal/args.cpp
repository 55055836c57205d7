#include "args.h"

#include "frugal/io/numbers.h"
#include "frugal/io/units.h"

#include <sys/stat.h>
#include <unistd.h>

#include <iostream>
#include <sstream>

namespace frugal {
namespace cli {

Args::Args(std::string command, std::string summary) : command_(std::move(command)), summary_(std::move(summary)) {}

void Args::add_int(const std::string& name, int64_t* target, const std::string& help, int64_t min_value, int64_t max_value,
                   const std::string& metavar) {
  // A default outside the range means "unset" (--stop-after's -1): the help shows none.
  const bool has_default = *target >= min_value && *target <= max_value;
  flags_.push_back({name, help, metavar, has_default ? std::to_string(*target) : "", io::int_range(min_value, max_value), true,
                    [=](const std::string& text) {
                      try {
                        *target = io::parse_int(text, "--" + name, min_value, max_value);
                      } catch (const std::invalid_argument& e) {
                        throw UsageError(e.what());
                      }
                    }});
}

void Args::add_double(const std::string& name, double* target, const std::string& help, double min_value, double max_value,
                      const std::string& metavar) {
  std::ostringstream def;
  def << *target;
  flags_.push_back({name, help, metavar, def.str(), io::double_range(min_value, max_value), true, [=](const std::string& text) {
                      try {
                        *target = io::parse_double(text, "--" + name, min_value, max_value);
                      } catch (const std::invalid_argument& e) {
                        throw UsageError(e.what());
                      }
                    }});
}

void Args::add_rest(std::vector<std::string>* target, const std::string& metavar) {
  rest_ = target;
  rest_metavar_ = metavar;
}

void Args::add_string(const std::string& name, std::string* target, const std::string& help, const std::string& metavar) {
  flags_.push_back({name, help, metavar, *target, "", true, [=](const std::string& text) {
                      if (text.empty()) throw UsageError("--" + name + " needs a non-empty value");
                      *target = text;
                    }});
}

void Args::add_output(const std::string& name, std::string* target, const std::string& help, const std::string& metavar) {
  add_string(name, target, help, metavar);
  auto set = flags_.back().set;
  flags_.back().set = [=](const std::string& text) {
    set(text);
    check_output_path("--" + name, text);
  };
}

void Args::add_bytes(const std::string& name, int64_t* target, const std::string& help, int64_t min_value, int64_t max_value) {
  const std::string range = io::bytes_range(min_value, max_value);
  flags_.push_back({name, help, "BYTES", *target >= 0 ? std::to_string(*target) : "", range, true, [=](const std::string& text) {
                      const auto bytes = io::parse_bytes(text);
                      if (!bytes || *bytes < min_value || *bytes > max_value) {
                        throw UsageError("--" + name + " must be " + range + ", such as 50000000, 64MiB or 1.5GiB, not " +
                                         io::quote_text(text));
                      }
                      *target = *bytes;
                    }});
}

void Args::add_device(const std::string& name, c10::Device* target, const std::string& help) {
  flags_.push_back({name, help, "DEVICE", target->str(), "", true, [=](const std::string& text) {
                      const bool ok = text == "cpu" || text == "cuda" ||
                                      (text.rfind("cuda:", 0) == 0 && text.size() > 5 && text.size() < 9 &&
                                       text.find_first_not_of("0123456789", 5) == std::string::npos);
                      if (!ok) throw UsageError("--" + name + " must be cpu, cuda or cuda:N, got '" + text + "'");
                      *target = c10::Device(text);
                    }});
}

void Args::add_flag(const std::string& name, bool* target, const std::string& help) {
  flags_.push_back({name, help, "", "", "", false, [=](const std::string&) { *target = true; }});
}

void Args::add_positional(const std::string& name, std::string* target, const std::string& help) {
  positionals_.push_back({name, help, name, "", "", true, [=](const std::string& text) { *target = text; }});
}

void Args::add_short(char letter, const std::string& name) { shorts_.emplace_back(std::string("-") + letter, name); }

bool Args::parse(int argc, char** argv, int first) {
  size_t next_positional = 0;
  for (int i = first; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << help();
      return false;
    }
    for (const auto& [alias, name] : shorts_) {
      if (arg == alias) arg = "--" + name;
    }
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      if (next_positional < positionals_.size()) {
        positionals_[next_positional++].set(arg);
        continue;
      }
      if (rest_) {
        rest_->push_back(arg);
        continue;
      }
      throw UsageError("unexpected argument '" + arg + "' (see 'frugal " + command_ + " --help')");
    }
    std::string name = arg.substr(2), value;
    bool has_inline_value = false;
    const auto eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline_value = true;
    }
    const Flag* flag = nullptr;
    for (const Flag& f : flags_) {
      if (f.name == name) flag = &f;
    }
    if (!flag) throw UsageError("unknown flag --" + name + " (see 'frugal " + command_ + " --help')");
    if (!flag->takes_value) {
      if (has_inline_value) throw UsageError("--" + name + " takes no value");
      flag->set("");
      continue;
    }
    if (!has_inline_value) {
      if (i + 1 >= argc) throw UsageError("--" + name + " needs a value (" + flag->metavar + ")");
      value = argv[++i];
    }
    flag->set(value);
  }
  if (next_positional < positionals_.size()) {
    throw UsageError("missing " + positionals_[next_positional].name + " (see 'frugal " + command_ + " --help')");
  }
  return true;
}

void check_output_path(const std::string& flag, const std::string& path) {
  if (path == "-") return;
  struct stat st {};
  if (path.empty() || path.back() == '/' || (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
    throw UsageError(flag + " " + path + " is a folder: give a file name");
  }
  // The nearest existing ancestor must be a folder we may write into (the rest is made).
  std::string dir = path;
  for (;;) {
    const auto slash = dir.find_last_of('/');
    dir = slash == std::string::npos ? "." : slash == 0 ? "/" : dir.substr(0, slash);
    if (::stat(dir.c_str(), &st) == 0) break;
    if (dir == "." || dir == "/") break;
  }
  if (!S_ISDIR(st.st_mode)) throw UsageError(flag + " " + path + ": " + dir + " is not a folder");
  if (::access(dir.c_str(), W_OK) != 0) throw UsageError(flag + " " + path + ": cannot write into " + dir);
}

std::string Args::help() const {
  std::ostringstream out;
  out << "usage: frugal " << command_;
  for (const Flag& p : positionals_) out << " " << p.name;
  if (rest_) out << " [" << rest_metavar_ << " ...]";
  out << " [flags]\n\n" << summary_ << "\n";
  if (!positionals_.empty()) {
    out << "\narguments:\n";
    for (const Flag& p : positionals_) out << "  " << p.name << "\n      " << p.help << "\n";
  }
  out << "\nflags:\n";
  for (const Flag& f : flags_) {
    out << "  ";
    for (const auto& [alias, name] : shorts_) {
      if (name == f.name) out << alias << ", ";
    }
    out << "--" << f.name << (f.takes_value ? " " + f.metavar : "") << "\n      " << f.help;
    if (f.takes_value && !f.range_text.empty()) {
      out << " (" << f.range_text << (f.default_text.empty() ? "" : "; default: " + f.default_text) << ")";
    } else if (f.takes_value && !f.default_text.empty()) {
      out << " (default: " << f.default_text << ")";
    }
    out << "\n";
  }
  out << "  --help\n      show this help\n";
  return out.str();
}

}  // namespace cli
}  // namespace frugal
