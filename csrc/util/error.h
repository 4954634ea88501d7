// error.h — the one error type of the core.
//
// Internals throw dfl::Error with a one-line, user-facing message; the C API
// catches it at the boundary, stores the message for dfl_last_error() and
// returns a status code.  Nothing below the API prints or aborts on bad input.
#pragma once
#include <cstdarg>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace dfl {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

[[noreturn]] inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void fail(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  throw Error(buf);
}

}  // namespace dfl
