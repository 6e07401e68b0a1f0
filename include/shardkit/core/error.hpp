// The sk::Error hierarchy and the helpers that build messages with file:line and context.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace shardkit {

// Base of every exception shardkit throws. Messages say what failed, the value, and the fix.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// A caller passed something the API cannot accept (shape, dtype, size, option value...).
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// The caller asked for something in the wrong order or state (e.g. step before gradients finish).
class StateError : public Error {
 public:
  using Error::Error;
};

// Something a captured step (core/step_graph.hpp) did cannot be replayed from a CUDA graph (a
// host wait, a random draw, a host value that changed): the message names it and the way out.
class CaptureRefused : public StateError {
 public:
  using StateError::StateError;
};

// An allocation failed on the host or a device.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

// A feature was compiled out (e.g. CUDA in a CPU-only build) or is not provided by a backend.
class NotAvailable : public Error {
 public:
  using Error::Error;
};

// Errors reported by a library shardkit calls; `code` is the library's own status value.
class LibraryError : public Error {
 public:
  LibraryError(const std::string& what, long code) : Error(what), code_(code) {}
  long code() const noexcept { return code_; }

 private:
  long code_;
};

class CudaError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};
class CublasError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};
class CudnnError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};
class NcclError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};
class MpiError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};
class DnnlError : public LibraryError {
 public:
  using LibraryError::LibraryError;
};

// A collective or other blocking operation did not complete in time (peer dead or missing).
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// Reading or writing files (datasets, checkpoints, configs) failed.
class IoError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// "file.hpp:42: " with the path shortened to what follows the last "include/" or "/".
inline std::string where(const char* file, int line) {
  std::string path(file);
  auto pos = path.rfind("include/");
  if (pos != std::string::npos) path = path.substr(pos + 8);
  return concat(path, ":", line, ": ");
}

// Builds the message of a failed library call: "<where><library> call `<call>` failed: <msg>".
inline std::string library_failure(const char* library, const char* call, long code,
                                   const std::string& message, const char* file, int line) {
  return concat(where(file, line), library, " call `", call, "` failed with status ", code, ": ",
                message);
}

}  // namespace detail

// Throws ErrorType with the message parts concatenated, e.g.
//   sk::fail<InvalidArgument>("bucket size is 0; pass a positive number of bytes");
template <class ErrorType = Error, class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw ErrorType(detail::concat(parts...));
}

// Validates a user-facing precondition; the message should name the thing, value and fix.
template <class ErrorType = InvalidArgument, class... Parts>
void check(bool condition, const Parts&... parts) {
  if (!condition) fail<ErrorType>(parts...);
}

}  // namespace shardkit

// Internal invariants: checked in debug builds only (they are bugs, not bad input).
#ifdef NDEBUG
#define SK_ASSERT(cond) ((void)0)
#else
#define SK_ASSERT(cond)                                                                        \
  ((cond) ? (void)0                                                                            \
          : ::shardkit::fail<::shardkit::Error>(::shardkit::detail::where(__FILE__, __LINE__), \
                                                "internal invariant violated: " #cond))
#endif
