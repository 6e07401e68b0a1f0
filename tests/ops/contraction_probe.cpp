// mul_rn followed by an add, compiled at -O2 (tests/ops/meson.build) as the CPU kernels are:
// GCC contracts a product into the add it feeds from -O2 on, where the host has FMA, and the
// test executables' own -O1 would not show it.
#include "contraction_probe.hpp"

#include "shardkit/ops/element.hpp"

namespace ops_test {

double mul_rn_then_add(double a, double b, double c) { return shardkit::ops::mul_rn(a, b) + c; }
float mul_rn_then_add(float a, float b, float c) { return shardkit::ops::mul_rn(a, b) + c; }

}  // namespace ops_test
