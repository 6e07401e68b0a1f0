// The CPU side of the shared fused-op test cases: how the cases move data to and from the
// backend's memory. The cases call the ops themselves, as sk::ops::xxx(b.ctx, ...): the context's
// device picks the table (ops/device_ops.hpp).
#pragma once

#include "ops_cases.hpp"

namespace ops_test {

struct CpuBackend {
  static constexpr double leaf_tolerance = 0;  // the same function, the same bits
  sk::Context ctx;

  sk::Tensor upload(const sk::Tensor& host) { return sk::clone(ctx, host); }
  sk::Tensor download(const sk::Tensor& t) { return sk::clone(ctx, t); }
  sk::Tensor zeros(sk::Shape shape, sk::DType dtype) {
    return sk::zeros(ctx, std::move(shape), dtype);
  }
  void fill(const sk::Tensor& t, double value) { sk::fill(ctx, t, value); }
};

}  // namespace ops_test
