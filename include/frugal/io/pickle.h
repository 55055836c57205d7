// frugal/io/pickle.h — write Python pickles (protocol 2) of dicts, lists, strings and numbers.
//
// Only the opcodes small unpicklers accept (PyTorch's memory viewer among them): PROTO, MARK,
// EMPTY_DICT, SETITEMS, EMPTY_LIST, APPENDS, BININT, LONG1, BINUNICODE, BINFLOAT, NONE,
// NEWTRUE, NEWFALSE, TUPLE2, STOP. Values are written as they come, like JsonWriter.
//
//   frugal::io::PickleWriter p;
//   p.begin_dict().key("segments").begin_list().end_list().end_dict();
//   std::string bytes = p.finish();
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace frugal {
namespace io {

// Builds one pickle in memory, value by value, like JsonWriter; finish() returns its bytes.
class PickleWriter {
 public:
  PickleWriter();
  PickleWriter& begin_dict();                 // opens a dict: key() and a value for each item
  PickleWriter& end_dict();                   // closes the innermost dict; std::logic_error outside one or after a key without its value
  PickleWriter& begin_list();                 // opens a list
  PickleWriter& end_list();                   // closes the innermost list; std::logic_error outside one
  PickleWriter& key(const std::string& k);    // in a dict: the next value's key
  PickleWriter& value(const std::string& s);  // a str (the bytes as given, meant to be UTF-8)
  // A str.
  PickleWriter& value(const char* s) { return value(std::string(s)); }
  PickleWriter& value(int64_t v);  // an int
  // An int.
  PickleWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  PickleWriter& value(double v);             // a float
  PickleWriter& value(bool v);               // True or False
  PickleWriter& none();                      // None
  PickleWriter& pair(int64_t a, int64_t b);  // a 2-tuple of integers
  std::string finish();                      // appends STOP; the writer is then spent

 private:
  // Dicts and lists are built with MARK ... SETITEMS / APPENDS, flushed every 1000 items.
  struct Level {
    bool is_dict;
    int64_t pending;
  };
  void item_written();
  std::string out_;
  std::vector<Level> stack_;
};

}  // namespace io
}  // namespace frugal
