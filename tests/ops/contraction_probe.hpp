// mul_rn(a, b) + c compiled apart at -O2 (contraction_probe.cpp): the sum of the product
// rounded on its own and c, never one fused multiply-add.
#pragma once

namespace ops_test {

double mul_rn_then_add(double a, double b, double c);
float mul_rn_then_add(float a, float b, float c);

}  // namespace ops_test
