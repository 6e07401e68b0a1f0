// The CPU backend of the shared fused-op test cases.
#pragma once

#include "ops_cases.hpp"

namespace ops_test {

struct CpuBackend {
  sk::Context ctx;

  sk::Tensor upload(const sk::Tensor& host) { return sk::clone(ctx, host); }
  sk::Tensor download(const sk::Tensor& t) { return sk::clone(ctx, t); }
  sk::Tensor zeros(sk::Shape shape, sk::DType dtype) { return sk::zeros(ctx, std::move(shape), dtype); }
  void fill(const sk::Tensor& t, double value) { sk::fill(ctx, t, value); }

  template <class... A> void sgd_step(A&&... a) { ops::cpu::sgd_step(ctx, a...); }
  template <class... A> void larc_sgd_step(A&&... a) { ops::cpu::larc_sgd_step(ctx, a...); }
  template <class... A> void adam_step(A&&... a) { ops::cpu::adam_step(ctx, a...); }
  template <class... A> void cast(A&&... a) { ops::cpu::cast(ctx, a...); }
  template <class... A> void unscale_and_check(A&&... a) { ops::cpu::unscale_and_check(ctx, a...); }
  template <class... A> void larc_coefficients(A&&... a) { ops::cpu::larc_coefficients(ctx, a...); }
  template <class... A> void segment_sums_of_squares(A&&... a) {
    ops::cpu::segment_sums_of_squares(ctx, a...);
  }
};

}  // namespace ops_test
