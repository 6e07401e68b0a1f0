// Fixture programs: code that writes the inputs of the checks run outside C++ (PyTorch, the
// checkpoint tool's round trip), compiled into a layer's test executable instead of an
// executable of its own, which would compile the same engines again. doctest_main.cpp runs one
// instead of the tests when asked:  test_autograd --fixture torch OUT_DIR
#pragma once

#include <cstdio>
#include <map>
#include <string>

namespace shardkit::testing {

// A fixture's main: argv[0] is its name, the rest its arguments.
using FixtureMain = int (*)(int argc, char** argv);

inline std::map<std::string, FixtureMain>& fixtures() {
  static std::map<std::string, FixtureMain> registry;
  return registry;
}

// Registers a fixture before main, as doctest registers test cases:
//   const shardkit::testing::FixtureRegistration registration("torch", torch_fixture_main);
struct FixtureRegistration {
  FixtureRegistration(const char* name, FixtureMain main) { fixtures()[name] = main; }
};

// Runs the fixture named argv[0] with its arguments; an unknown name is a usage error that
// lists the executable's fixtures.
inline int run_fixture(int argc, char** argv) {
  const auto it = argc > 0 ? fixtures().find(argv[0]) : fixtures().end();
  if (it != fixtures().end()) return it->second(argc, argv);
  std::string names;
  for (const auto& [name, main] : fixtures()) names += (names.empty() ? "" : ", ") + name;
  std::fprintf(stderr, "usage: --fixture NAME ARGS... with NAME one of: %s (got '%s')\n",
               names.empty() ? "(none in this executable)" : names.c_str(),
               argc > 0 ? argv[0] : "");
  return 2;
}

}  // namespace shardkit::testing
