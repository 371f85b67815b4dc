// SPDX-License-Identifier: Apache-2.0
// Exception types and precondition macros of the owning (host) API. Library code never aborts:
// broken preconditions throw, expected outcomes (a full pool) are returned as values.
#pragma once

#include <stdexcept>
#include <string>

namespace triattn {

/// Base class of every exception triattn throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A caller broke a documented precondition (bad argument, bad shape, unknown sequence...).
class logic_error : public error {
 public:
  using error::error;
};

/// A run-time value names a combination that was not compiled in (head_dim, dtype...).
class unsupported : public error {
 public:
  using error::error;
};

/// Malformed, truncated or unsupported input file. The message names the file, the entry and
/// the problem.
class format_error : public error {
 public:
  using error::error;
};

/// Host memory for a valid request could not be had (the configuration is larger than the
/// machine's memory, or the allocation failed). The message names the bytes and the request.
class out_of_memory : public error {
 public:
  using error::error;
};

namespace detail {
[[noreturn]] inline void throw_logic(const char* file, int line, const std::string& what) {
  throw logic_error(std::string("triattn: ") + what + " [" + file + ":" + std::to_string(line) + "]");
}
}  // namespace detail
}  // namespace triattn

/// Throws triattn::logic_error carrying `msg` (anything convertible to std::string) and file:line
/// when `cond` is false.
#define TRIATTN_EXPECTS(cond, msg)                                        \
  do {                                                                    \
    if (!(cond)) ::triattn::detail::throw_logic(__FILE__, __LINE__, (msg)); \
  } while (0)

/// Unconditionally throws triattn::logic_error.
#define TRIATTN_FAIL(msg) ::triattn::detail::throw_logic(__FILE__, __LINE__, (msg))
