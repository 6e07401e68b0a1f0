// The sk::Error hierarchy and the helpers that build messages with file:line and context.
#pragma once

#include <initializer_list>
#include <memory>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>

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

// A message is built from parts of any printable type. Each part travels as its address and the
// function that prints its type, so the one loop that streams them (concat_parts) is compiled
// once per program, and each type's printer once, instead of an ostringstream pipeline for every
// combination of part types that some check or fail names: ~500 distinct combinations in the
// SwAV trainer alone, about 8% of its machine code.
struct MessagePart {
  const void* value;
  void (*print)(std::ostream&, const void*);
};

template <class T>
void print_part(std::ostream& out, const void* value) {
  out << *static_cast<const T*>(value);
}

inline void print_chars(std::ostream& out, const void* value) {
  out << static_cast<const char*>(value);
}

template <class F>
void print_function(std::ostream& out, const void* function) {
  out << reinterpret_cast<F*>(const_cast<void*>(function));
}

template <class T>
MessagePart message_part(const T& value) {
  if constexpr (std::is_array_v<T> &&
                std::is_same_v<std::remove_cv_t<std::remove_extent_t<T>>, char>)
    return {value, &print_chars};            // a literal: one printer for every length
  else if constexpr (std::is_function_v<T>)  // a manipulator such as std::fixed
    return {reinterpret_cast<const void*>(&value), &print_function<T>};
  else
    return {std::addressof(value), &print_part<T>};
}

[[gnu::noinline]] inline std::string concat_parts(std::initializer_list<MessagePart> parts) {
  std::ostringstream out;
  for (const MessagePart& part : parts) part.print(out, part.value);
  return out.str();
}

// The parts printed one after another, as `(out << ... << parts)` would.
template <class... Parts>
std::string concat(const Parts&... parts) {
  return concat_parts({message_part(parts)...});
}

// One per error type: what every fail<ErrorType> calls, so assembling the message and throwing
// stay out of the callers' code.
template <class ErrorType>
[[noreturn, gnu::noinline, gnu::cold]] void throw_message(
    std::initializer_list<MessagePart> parts) {
  throw ErrorType(concat_parts(parts));
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
  detail::throw_message<ErrorType>({detail::message_part(parts)...});
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
