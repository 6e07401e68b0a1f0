// Runner for GPU test executables: exits 77 (Meson's "skipped") when no CUDA GPU is usable, so
// a machine without a GPU reports these tests as skipped, never as passed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "shardkit/core/device.hpp"

int main(int argc, char** argv) {
  if (shardkit::cuda_device_count() == 0) {
    std::printf("no usable CUDA GPU (no device or no driver): skipping GPU tests\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
