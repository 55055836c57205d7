# Writes a text file into a C++ header as one string constant, at build time, so that an asset
# (the memory report's HTML page) is edited, linted and diffed as what it is:
#   cmake -DIN=page.html -DOUT=page.inc -DNAME=kPage -P embed_text.cmake
# The header holds `constexpr char NAME[] = R"frugal_asset(...)frugal_asset";`.
file(READ "${IN}" text)
string(FIND "${text}" ")frugal_asset\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${IN} contains the raw string's closing delimiter )frugal_asset\"")
endif()
set(out "// Generated from ${IN} by cmake/embed_text.cmake; edit that file, not this one.\n")
string(APPEND out "constexpr char ${NAME}[] = R\"frugal_asset(${text})frugal_asset\";\n")
# only rewritten when it changes, so that what includes it is not rebuilt for nothing
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
  if(old STREQUAL out)
    return()
  endif()
endif()
file(WRITE "${OUT}" "${out}")
