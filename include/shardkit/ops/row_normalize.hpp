// Rows of a 2-D parameter divided by their L2 norms, the norms summed from the parameter's leaf
// sums of squares (norm_tree.hpp), so they have the same bits whichever rank holds which piece
// of a row: SwAV's prototypes after each step (parallel/param_rows.hpp) as a fused-op functor,
// formed where the parameter lives -- nothing read back.
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/ops/functor.hpp"

namespace shardkit::ops {

// Operand 0: the values (f32, updated in place). Span s lies inside row first_row + s of the
// parameter; leaves holds the whole parameter's leaf sums (f64, leaves_per_row per row, on the
// device the pass runs on). x <- x / max(sqrt(sum of the row's leaves, in order), eps), formed
// in f64 and rounded once. With `gate` set (the optimizer's step gate) a skipped step's pass
// writes nothing.
struct RowNormalizeFunctor {
  static constexpr int kDepth = 1;
  using Types = TypeList<float>;
  static constexpr unsigned kReads = 0b1u;
  static constexpr unsigned kWrites = 0b1u;
  static constexpr int kSums = 0;

  const double* leaves = nullptr;
  std::int64_t first_row = 0;
  std::int64_t leaves_per_row = 0;
  double eps = 1e-12;
  const float* gate = nullptr;

  struct Segment {
    double norm;
  };
  SK_HOST_DEVICE SK_INLINE Segment segment(std::int64_t index) const {
    const double* row = leaves + (first_row + index) * leaves_per_row;
    double sum = 0;
    for (std::int64_t j = 0; j < leaves_per_row; ++j) sum += row[j];
    const double norm = ::sqrt(sum);
    return {norm < eps ? eps : norm};  // std::max(norm, eps)
  }

  SK_HOST_DEVICE SK_INLINE void operator()(float (&x)[1], const Segment& s, double (&)[1]) const {
    x[0] = static_cast<float>(static_cast<double>(x[0]) / s.norm);
  }
};

}  // namespace shardkit::ops
