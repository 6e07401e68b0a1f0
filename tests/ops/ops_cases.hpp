// The fused-op test cases, written once over a backend (CPU in test_ops.cpp, CUDA in
// test_ops_gpu.cu) and checked against float64 references on random non-zero data. Outputs are
// poisoned with NaN first, so an element the op forgot fails the comparison.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <shardkit/ops/ops.hpp>
#include <shardkit/shardkit.hpp>

namespace ops_test {

namespace sk = shardkit;
namespace ops = shardkit::ops;

// f32 results must match the float64 reference to a few roundings: far below 1e-6.
inline constexpr double kF32Tolerance = 4e-7;

// Sizes around the chunk size and the vector width, the empty and one-element tensors.
inline std::vector<std::int64_t> edge_sizes() {
  const std::int64_t c = ops::kChunkElements;
  return {1, 0, 3, 4, 5, 7, 8, 33, 100, c - 1, c, c + 1, c + 3, 2 * c + 5, 3 * c};
}

// A flat buffer holding one segment per size; `gap` elements before each segment make the
// offsets unaligned (offset 1 of a 64-byte-aligned allocation, then drifting).
struct Layout {
  std::vector<std::int64_t> sizes, offsets;
  std::int64_t total = 0;
  Layout(std::vector<std::int64_t> s, std::int64_t gap) : sizes(std::move(s)) {
    for (auto size : sizes) {
      total += gap;
      offsets.push_back(total);
      total += size;
    }
    total += 1;
  }
  std::size_t count() const { return sizes.size(); }
};

// Host values for a flat buffer: sign · uniform[lo, hi), the sign given per element so that
// parameter, gradient and momentum share it (no cancellation blurs the error measure).
inline std::vector<float> random_values(std::int64_t n, double lo, double hi, std::uint32_t seed,
                                        bool signed_values = true) {
  std::mt19937 gen(seed);
  std::mt19937 sign_gen(12345);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (auto& x : v) {
    const double sign = signed_values && (sign_gen() & 1u) ? -1.0 : 1.0;
    x = static_cast<float>(sign * dist(gen));
  }
  return v;
}

inline double rel_error(double got, double want) {
  if (std::isnan(want)) return std::isnan(got) ? 0.0 : INFINITY;
  if (std::isinf(want)) return got == want ? 0.0 : INFINITY;
  if (want == 0) return std::fabs(got);
  return std::fabs(got - want) / std::fabs(want);
}

// Checks every element of each segment against the reference; returns the largest error.
inline double check_close(const std::vector<float>& got, const std::vector<double>& want,
                          const Layout& layout, const char* what,
                          double tolerance = kF32Tolerance) {
  double worst = 0;
  for (std::size_t t = 0; t < layout.count(); ++t)
    for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
      const auto at = static_cast<std::size_t>(layout.offsets[t] + i);
      const double e = rel_error(got[at], want[at]);
      if (!(e <= tolerance)) {
        FAIL_CHECK(what << " tensor " << t << " (size " << layout.sizes[t] << ") element " << i
                        << ": got " << got[at] << ", want " << want[at]);
        return e;
      }
      worst = std::max(worst, e);
    }
  return worst;
}

inline std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// A flat f32 buffer on the backend's device and its per-segment views.
template <class Backend>
struct Flat {
  sk::Tensor buffer;
  std::vector<sk::Tensor> views;
  Flat(Backend& b, const std::vector<float>& values, const Layout& layout,
       sk::DType dtype = sk::DType::f32) {
    sk::Context host;
    auto h = sk::from_vector(host, values, {static_cast<std::int64_t>(values.size())});
    buffer = b.upload(dtype == sk::DType::f32 ? h : sk::cast(host, h, dtype));
    for (std::size_t t = 0; t < layout.count(); ++t)
      views.push_back(buffer.flat_view(layout.offsets[t], {layout.sizes[t]}));
  }
  std::vector<float> values(Backend& b) const {
    sk::Context host;
    auto h = b.download(buffer);
    if (h.dtype() != sk::DType::f32) h = sk::cast(host, h, sk::DType::f32);
    return sk::to_vector<float>(host, h);
  }
  // The raw 16-bit patterns of an f16/bf16 buffer.
  std::vector<std::uint16_t> bits16(Backend& b) const {
    const auto h = b.download(buffer);
    std::vector<std::uint16_t> out(static_cast<std::size_t>(h.numel()));
    std::memcpy(out.data(), h.data_ptr(), h.nbytes());
    return out;
  }
};

inline const std::vector<float> kNaNs(std::size_t n) {
  return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
}

// float64 SGD reference on flat vectors, per docs/semantics.md; coefficients per segment.
struct SgdReference {
  std::vector<double> w, buf;
  void step(const std::vector<double>& g, const ops::SgdOptions& o, const Layout& layout,
            const std::vector<double>& grad_coef, const std::vector<double>& param_coef) {
    for (std::size_t t = 0; t < layout.count(); ++t)
      for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
        const auto at = static_cast<std::size_t>(layout.offsets[t] + i);
        double gg = grad_coef[t] * g[at];
        if (param_coef[t] != 0) gg += param_coef[t] * w[at];
        double d = gg;
        if (o.momentum != 0) {
          buf[at] = o.first_step ? gg : o.momentum * buf[at] + (1.0 - o.dampening) * gg;
          d = o.nesterov ? gg + o.momentum * buf[at] : buf[at];
        }
        w[at] -= static_cast<double>(o.lr) * d;
      }
  }
};

// LARC coefficients of one tensor in float64 (apex's rule, docs/semantics.md).
inline void larc_reference(double wsq, double gsq, const ops::LarcOptions& l, double lr,
                           double inv_scale, double& grad_coef, double& param_coef) {
  const double wn = std::sqrt(wsq), gn = std::sqrt(gsq) * inv_scale;
  if (!(wn != 0 && gn != 0)) {
    grad_coef = inv_scale;
    param_coef = 0;
    return;
  }
  double rate = l.trust_coefficient * wn / (gn + wn * l.weight_decay + l.eps);
  if (l.clip) rate = std::min(rate / lr, 1.0);
  grad_coef = rate * inv_scale;
  param_coef = rate * l.weight_decay;
}

inline void sums_reference(const std::vector<float>& v, const Layout& layout,
                           std::vector<double>& out) {
  out.assign(layout.count(), 0.0);
  for (std::size_t t = 0; t < layout.count(); ++t)
    for (std::int64_t i = 0; i < layout.sizes[t]; ++i) {
      const double x = v[static_cast<std::size_t>(layout.offsets[t] + i)];
      out[t] += x * x;
    }
}

}  // namespace ops_test
