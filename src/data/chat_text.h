// Text helpers shared by the chat templates and the example reader (src/data only).
#pragma once

#include <string>

namespace frugal {
namespace data {

// Python's str.strip() (and Jinja's trim filter, which calls it): Unicode whitespace (str.isspace)
// off both ends of UTF-8 text.
std::string python_strip(const std::string& s);

}  // namespace data
}  // namespace frugal
