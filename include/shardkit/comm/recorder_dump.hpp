// A job that hangs says where each rank is: install_recorder_dump(SIGUSR1) makes
// `kill -USR1 <pid>` print the last calls of every live communicator of that process to
// stderr (call_record.hpp's flight recorders) while the job carries on -- for a rank blocked
// in a collective, its last call is the one it waits in. PyTorch's NCCL flight recorder dumps
// on demand the same way. A timeout's message lists the same calls by itself.
//
// The signal handler only writes a byte to a pipe (async-signal-safe); a thread of its own,
// started by the first install, formats and prints the dump. POSIX only.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <string>
#include <thread>

#include "shardkit/comm/call_record.hpp"
#include "shardkit/core/error.hpp"

namespace shardkit::comm {

namespace detail {

inline int& recorder_dump_pipe_in() {
  static int fd = -1;  // the handler's end
  return fd;
}

inline void recorder_dump_on_signal(int) {
  const int saved = errno;
  const char byte = 1;
  [[maybe_unused]] const auto written = ::write(recorder_dump_pipe_in(), &byte, 1);
  errno = saved;
}

}  // namespace detail

// What the dump prints: a header naming the process, then a line per live communicator.
inline std::string recorder_dump_text() {
  return "shardkit flight recorder, pid " + std::to_string(::getpid()) + ":\n" +
         RecorderRegistry::instance().dump();
}

// From now on `signal` (SIGUSR1 unless told) prints recorder_dump_text() to stderr. The pipe
// and the printing thread are made once; installing for another signal adds that signal.
inline void install_recorder_dump(int signal = SIGUSR1) {
  static const bool started = [] {
    int fds[2];
    check<StateError>(::pipe(fds) == 0, "install_recorder_dump: pipe() failed (errno ", errno, ")");
    ::fcntl(fds[1], F_SETFL, O_NONBLOCK);  // a burst of signals never blocks the handler
    detail::recorder_dump_pipe_in() = fds[1];
    std::thread([read_end = fds[0]] {
      for (;;) {
        char byte;
        const auto got = ::read(read_end, &byte, 1);
        if (got < 0 && errno == EINTR) continue;
        if (got != 1) return;
        const std::string text = recorder_dump_text();
        std::fwrite(text.data(), 1, text.size(), stderr);
        std::fflush(stderr);
      }
    }).detach();
    return true;
  }();
  (void)started;
  struct sigaction action {};
  action.sa_handler = detail::recorder_dump_on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  check<StateError>(::sigaction(signal, &action, nullptr) == 0,
                    "install_recorder_dump: sigaction for signal ", signal, " failed (errno ",
                    errno, ")");
}

}  // namespace shardkit::comm
