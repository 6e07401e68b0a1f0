// The doctest runner of the test executables that also hold MPI cases (TEST_SUITE "mpi"): meson
// runs the same executable twice, alone and under mpirun. Started by an MPI launcher it runs
// only the "mpi" cases, inside an MpiSession, and every rank returns the worst result over
// ranks (a failure on any rank fails the test); started alone it runs the rest. One executable
// instead of two halves the build of the layer's tests: both compile the same engines.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <memory>

#include "shardkit/comm/launch.hpp"
#include "shardkit/comm/mpi_session.hpp"
#include "shardkit/core/mpi_check.hpp"

int main(int argc, char** argv) {
  namespace comm = shardkit::comm;
  if (comm::detect_launch().kind != comm::LaunchKind::mpi) {
    doctest::Context context(argc, argv);
    context.addFilter("test-suite-exclude", "mpi");
    return context.run();
  }
  auto session = std::make_shared<comm::MpiSession>(&argc, &argv);
  int result = 0;
  {
    doctest::Context context(argc, argv);
    context.addFilter("test-suite", "mpi");
    result = context.run();
  }
  int worst = 0;
  SK_MPI_CHECK(MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
  return worst;
}
