// CapturedStderr: this process's stderr (file descriptor 2) into a temporary file while it
// lives, for tests of what the library says there (a saver's lost checkpoint, the flight
// recorder's dump). text() reads what was written so far (a test may poll it while capturing);
// the destructor puts stderr back and removes the file, also when a REQUIRE leaves early.
#pragma once

#include <doctest/doctest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>

namespace shardkit::testing {

class CapturedStderr {
 public:
  CapturedStderr() {
    file_ = ::mkstemp(path_);
    REQUIRE_MESSAGE(file_ >= 0, "cannot create a file for stderr under /tmp");
    std::fflush(stderr);
    saved_ = ::dup(2);
    REQUIRE_MESSAGE(saved_ >= 0, "cannot duplicate stderr");
    ::dup2(file_, 2);
  }
  CapturedStderr(const CapturedStderr&) = delete;
  CapturedStderr& operator=(const CapturedStderr&) = delete;
  ~CapturedStderr() {
    restore();
    ::close(file_);
    std::remove(path_);
  }

  // What was written to stderr so far (everything, once restore() ran).
  std::string text() const {
    std::fflush(stderr);
    std::ifstream in(path_);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Puts stderr back (the file stays readable until destruction).
  void restore() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    ::dup2(saved_, 2);
    ::close(saved_);
    saved_ = -1;
  }

 private:
  char path_[32] = "/tmp/shardkit_stderr_XXXXXX";
  int file_ = -1;
  int saved_ = -1;
};

}  // namespace shardkit::testing
