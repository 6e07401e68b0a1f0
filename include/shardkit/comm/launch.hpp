// How this process was launched, read from the environment: under mpirun (OpenMPI's
// OMPI_COMM_WORLD_* or a PMI's PMI_RANK/PMI_SIZE), by torchrun / SLURM-style scripts
// (RANK / WORLD_SIZE / LOCAL_RANK), or alone. make_communicator() builds on it; programs use
// local_rank to pick their GPU before creating the Context.
#pragma once

#include <cerrno>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "shardkit/core/error.hpp"

namespace shardkit::comm {

enum class LaunchKind { single, mpi, env };

struct LaunchInfo {
  LaunchKind kind = LaunchKind::single;
  int rank = 0;
  int size = 1;
  int local_rank = 0;  // rank among the processes of this machine: the GPU to use
  std::string source;  // the variables that decided, for messages
};

// Reads one environment variable; tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

inline std::optional<std::string> process_env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace detail {

inline std::optional<int> env_int(const EnvLookup& env, const char* name) {
  const auto value = env(name);
  if (!value) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long parsed = std::strtol(value->c_str(), &end, 10);
  check(!value->empty() && end != nullptr && *end == '\0' && errno == 0 && parsed >= 0 &&
            parsed <= 1 << 30,
        "environment variable ", name, "='", *value,
        "' is not a non-negative integer; fix or unset it (it tells each process its rank)");
  return static_cast<int>(parsed);
}

inline LaunchInfo checked_launch(LaunchKind kind, int rank, int size, int local_rank,
                                 std::string source) {
  check(size >= 1 && rank < size, source, " say rank ", rank, " of ", size,
        " ranks; the rank must be below the world size");
  return LaunchInfo{kind, rank, size, local_rank, std::move(source)};
}

}  // namespace detail

inline LaunchInfo detect_launch(const EnvLookup& env = process_env) {
  using detail::env_int;
  if (const auto size = env_int(env, "OMPI_COMM_WORLD_SIZE")) {
    const auto rank = env_int(env, "OMPI_COMM_WORLD_RANK");
    check(rank.has_value(),
          "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not; "
          "launch with OpenMPI's mpirun");
    return detail::checked_launch(LaunchKind::mpi, *rank, *size,
                                  env_int(env, "OMPI_COMM_WORLD_LOCAL_RANK").value_or(0),
                                  "OMPI_COMM_WORLD_RANK/SIZE");
  }
  if (const auto size = env_int(env, "PMI_SIZE")) {
    const auto rank = env_int(env, "PMI_RANK");
    check(rank.has_value(), "PMI_SIZE is set but PMI_RANK is not; launch with mpirun / srun");
    const auto local = env_int(env, "MPI_LOCALRANKID");
    return detail::checked_launch(LaunchKind::mpi, *rank, *size, local.value_or(0),
                                  "PMI_RANK/PMI_SIZE");
  }
  const auto rank = env_int(env, "RANK");
  const auto size = env_int(env, "WORLD_SIZE");
  if (rank || size) {
    check(rank && size,
          "only one of RANK and WORLD_SIZE is set; set both (torchrun / SLURM "
          "convention) or neither");
    return detail::checked_launch(LaunchKind::env, *rank, *size,
                                  env_int(env, "LOCAL_RANK").value_or(0), "RANK/WORLD_SIZE");
  }
  return LaunchInfo{};
}

}  // namespace shardkit::comm
