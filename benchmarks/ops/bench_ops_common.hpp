// Workloads of the fused-op benchmarks (CPU and GPU): ResNet-50's 161 parameter tensors, each
// its own allocation, or one flat buffer; the minimum bytes each step must move; names.
#pragma once

#include <cstdint>
#include <vector>

#include <shardkit/shardkit.hpp>
#include "workloads/resnet50_params.hpp"

namespace shardkit::bench {

// One list of tensors per operand; `flat` puts a single tensor of `flat_elements` instead.
struct OpsWorkload {
  std::vector<Tensor> w, g, buf, m, v, low, half;
  std::int64_t params = 0;

  OpsWorkload(Context& ctx, bool flat, std::int64_t flat_elements, bool adam = false) {
    std::vector<Shape> shapes;
    if (flat)
      shapes.push_back({flat_elements});
    else
      for (const auto& s : workloads::kResNet50Shapes) shapes.push_back(s.shape());
    for (const auto& shape : shapes) {
      auto make = [&](double lo, double hi, DType dtype = DType::f32) {
        Tensor t = empty(ctx, shape, dtype);
        uniform_(ctx, t, lo, hi);
        return t;
      };
      w.push_back(make(1, 2));
      g.push_back(make(0.5, 1.5));
      buf.push_back(make(0.5, 1.5));
      low.push_back(make(0, 1, DType::bf16));
      half.push_back(make(0, 1, DType::f16));
      if (adam) {
        m.push_back(make(0.5, 1.5));
        v.push_back(make(0.5, 1.5));
      }
      params += shape_numel(shape);
    }
  }
};

// The options every SGD and LARC benchmark steps with: small steps keep the parameters finite
// over thousands of iterations.
inline ops::SgdOptions bench_sgd_options() {
  ops::SgdOptions o;
  o.lr = 1e-3f;
  o.momentum = 0.9f;
  o.first_step = false;
  return o;
}
inline ops::LarcOptions bench_larc_options() {
  ops::LarcOptions l;
  l.trust_coefficient = 0.001f;
  l.clip = false;
  l.weight_decay = 1e-6f;
  return l;
}

// Minimum bytes per parameter of each step (f32 = 4 bytes, bf16 = 2).
inline constexpr double kSgdMomentumBytes = 20;  // read w, g, buf; write w, buf
inline constexpr double kSgdBf16CopyBytes = 22;  // + write the bf16 copy
inline constexpr double kAdamBytes = 28;         // read w, g, m, v; write w, m, v
inline constexpr double kCastBytes = 6;          // read f32, write bf16 or f16 (or back)
inline constexpr double kUnscaleBytes = 8;       // read and write g
inline constexpr double kNormsPairBytes = 8;     // read w, g (LARC's norms pass alone)

// LARC-SGD's floor per parameter. Over ResNet-50's tensors the norms pass's reads of w and g can
// be served from cache by the update that follows (SGD's 20 bytes). Over one tensor larger than
// the caches (the flat workloads) no element can be updated before the whole tensor's norms are
// known, so w and g come from memory twice: 28 bytes, or 24 with the params' squares kept from
// the step before (LarcParamSquares: only g is read twice). Scoring the flat rows against 20
// capped them at 71% (83% kept) of copy however good the kernels were.
inline double larc_sgd_floor_bytes(bool one_large_tensor, bool squares_kept = false) {
  if (!one_large_tensor) return kSgdMomentumBytes;
  return squares_kept ? 24 : 28;
}

// The block-quantised gather's codes (ops/quantize.hpp; qwZ's format, int8 / E4M3 / int4), in
// blocks of kDefaultQuantBlock, of a flat f32 buffer: quantising reads the values and writes a
// code and a share of the block's f32 scale; dequantising reads those and writes the values.
// (The maxima's pass re-reads a block from cache.)
inline constexpr std::int64_t kQuantFormats = 3;  // the benchmarks' format argument: 0, 1, 2
inline ops::QuantFormat bench_quant_format(std::int64_t arg) {
  constexpr ops::QuantFormat kFormats[kQuantFormats] = {
      ops::QuantFormat::int8, ops::QuantFormat::f8_e4m3, ops::QuantFormat::int4};
  return kFormats[arg];
}
inline double quant_bytes_per_value(ops::QuantFormat format) {
  const double code = format == ops::QuantFormat::int4 ? 0.5 : 1.0;
  return 4.0 + code + 4.0 / static_cast<double>(ops::kDefaultQuantBlock);
}
inline Tensor quant_payload(Context& ctx, std::int64_t n, ops::QuantFormat format) {
  return empty(ctx, {ops::quant_payload_bytes(n, ops::kDefaultQuantBlock, format)}, DType::u8);
}

}  // namespace shardkit::bench
