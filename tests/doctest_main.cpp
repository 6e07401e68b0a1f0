// The doctest runner shared by the CPU test executables; `--fixture NAME ARGS...` runs instead
// one of the fixture programs compiled into the executable (fixtures.hpp).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <string_view>

#include "fixtures.hpp"

int main(int argc, char** argv) {
  if (argc >= 2 && std::string_view(argv[1]) == "--fixture")
    return shardkit::testing::run_fixture(argc - 2, argv + 2);
  doctest::Context context(argc, argv);
  return context.run();
}
