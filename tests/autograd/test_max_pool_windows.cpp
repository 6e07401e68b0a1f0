// The GPU max-pool's per-thread work (autograd/max_pool_windows.hpp), on the CPU: every output's
// window maximum and every input's gathered gradient, with the planes laid out as the kernels
// see them (NCHW planes, or channels-last images), equal the CPU max-pool's y and input
// gradient bit for bit, and each recorded offset points where the CPU found the maximum -- on
// values with many ties and NaNs, for overlapping windows, windows cut by the padding, disjoint
// windows and a window of over 256 values (i32 offsets). The kernels call the same functions
// per thread, so a GPU runs what this checks.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "max_pool_cases.hpp"
#include "shardkit/autograd/cpu_norm_pool.hpp"  // the CPU's pooling loops, called directly
#include "shardkit/autograd/max_pool_windows.hpp"
#include "shardkit/shardkit.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

namespace {

// [N, C, H, W] in NCHW order to the kernels' layout: NCHW itself, or [N, H, W, C].
template <class T>
std::vector<T> in_layout(const std::vector<T>& nchw, const sk::Shape& shape, bool channels_last) {
  if (!channels_last) return nchw;
  const std::int64_t N = shape[0], C = shape[1], HW = shape[2] * shape[3];
  std::vector<T> out(nchw.size());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t p = 0; p < HW; ++p)
        out[static_cast<std::size_t>((n * HW + p) * C + c)] =
            nchw[static_cast<std::size_t>((n * C + c) * HW + p)];
  return out;
}

// The kernels' loops, one thread after another: outputs (forward) then inputs (backward).
template <class T, class O, bool ChannelsLast>
void run_like_the_kernels(const ag::MaxPoolShape& s, const std::vector<T>& x, std::vector<T>& y,
                          std::vector<O>& at, const std::vector<T>& gy, std::vector<T>& gx) {
  const int out_plane = s.OH * s.OW * s.channels, in_plane = s.H * s.W * s.channels;
  for (std::int64_t q = 0; q < s.planes; ++q)
    for (int j = 0; j < out_plane; ++j) {
      const ag::PlanePosition o = ag::plane_position<ChannelsLast>(j, s.OW, s.channels);
      const auto m = ag::window_max<T>(x.data() + q * in_plane + o.channel, s, o.row, o.column);
      y[static_cast<std::size_t>(q * out_plane + j)] = m.value;
      at[static_cast<std::size_t>(q * out_plane + j)] = static_cast<O>(m.at);
    }
  for (std::int64_t q = 0; q < s.planes; ++q)
    for (int j = 0; j < in_plane; ++j) {
      const ag::PlanePosition i = ag::plane_position<ChannelsLast>(j, s.W, s.channels);
      const std::int64_t outputs = q * out_plane + i.channel;
      gx[static_cast<std::size_t>(q * in_plane + j)] =
          ag::gathered_gradient<T>(gy.data() + outputs, at.data() + outputs, s, i.row, i.column);
    }
}

template <class T>
void check_against_cpu(const sk::Shape& shape, std::int64_t kernel, std::int64_t stride,
                       std::int64_t padding, bool channels_last, bool nans) {
  const std::string shape_text = sk::shape_str(shape);
  CAPTURE(shape_text);
  CAPTURE(kernel);
  CAPTURE(stride);
  CAPTURE(padding);
  CAPTURE(channels_last);
  CAPTURE(nans);
  CAPTURE(sizeof(T));
  const sk::DType dtype = sizeof(T) == 4 ? sk::DType::f32 : sk::DType::f64;
  sk::Context cpu({.seed = 1});
  const auto values = max_pool_cases::tied_values(sk::shape_numel(shape), 7, nans);
  const ag::Variable x(sk::cast(cpu, sk::from_vector(cpu, values, shape), dtype), true);
  const ag::Variable y = ag::max_pool2d(cpu, x, kernel, stride, padding);
  std::vector<double> grad(static_cast<std::size_t>(y.numel()));
  for (std::size_t i = 0; i < grad.size(); ++i)
    grad[i] = (double(i % 97) - 48) / 7.3;  // (rounded: the order of additions shows)
  const sk::Tensor gy = sk::cast(cpu, sk::from_vector(cpu, grad, y.shape()), dtype);
  ag::backward(cpu, y, gy);
  const auto y_cpu = sk::to_vector<T>(cpu, y.data());
  const auto gx_cpu = sk::to_vector<T>(cpu, x.grad());

  const ag::MaxPoolShape s{shape[0] * (channels_last ? 1 : shape[1]),
                           int(shape[2]),
                           int(shape[3]),
                           int(y.size(2)),
                           int(y.size(3)),
                           int(channels_last ? shape[1] : 1),
                           int(kernel),
                           int(kernel),
                           int(stride),
                           int(stride),
                           int(padding),
                           int(padding)};
  std::vector<T> x_k = in_layout(sk::to_vector<T>(cpu, x.data()), shape, channels_last);
  std::vector<T> gy_k = in_layout(sk::to_vector<T>(cpu, gy), y.shape(), channels_last);
  std::vector<T> y_k(y_cpu.size()), gx_k(gx_cpu.size());
  // Where the CPU found each maximum (its index in the H x W plane, from its loops called
  // directly), as the offset in the window that the kernels record.
  const sk::Tensor y_again = sk::empty(cpu, y.shape(), dtype);
  const sk::Tensor plane_index = sk::empty(cpu, y.shape(), sk::DType::i64);
  ag::cpu::max_pool_forward(cpu.cpu_pool(), x.data(), y_again, plane_index,
                            {kernel, kernel, stride, stride, padding, padding});
  const auto indices = sk::to_vector<std::int64_t>(cpu, plane_index);
  std::vector<std::int64_t> offsets(indices.size());
  const std::int64_t OH = y.size(2), OW = y.size(3), W = shape[3];
  for (std::size_t i = 0; i < indices.size(); ++i) {
    const std::int64_t oh = std::int64_t(i) / OW % OH, ow = std::int64_t(i) % OW;
    const std::int64_t row = indices[i] / W, column = indices[i] % W;
    offsets[i] = (row - (oh * stride - padding)) * kernel + (column - (ow * stride - padding));
  }
  const auto compare = [&](const auto& at) {
    const auto y_ref = in_layout(y_cpu, y.shape(), channels_last);
    const auto gx_ref = in_layout(gx_cpu, shape, channels_last);
    const auto offsets_ref = in_layout(offsets, y.shape(), channels_last);
    CHECK(max_pool_cases::values_differing(y_ref, y_k) == 0);
    CHECK(max_pool_cases::values_differing(gx_ref, gx_k) == 0);
    REQUIRE(at.size() == offsets_ref.size());
    std::size_t offsets_differing = 0;
    for (std::size_t i = 0; i < at.size(); ++i)
      offsets_differing += std::int64_t(at[i]) != offsets_ref[i];
    CHECK(offsets_differing == 0);
  };
  const bool wide = kernel * kernel > 256;
  if (wide) {
    std::vector<std::int32_t> at(y_cpu.size());
    if (channels_last)
      run_like_the_kernels<T, std::int32_t, true>(s, x_k, y_k, at, gy_k, gx_k);
    else
      run_like_the_kernels<T, std::int32_t, false>(s, x_k, y_k, at, gy_k, gx_k);
    compare(at);
  } else {
    std::vector<std::uint8_t> at(y_cpu.size());
    if (channels_last)
      run_like_the_kernels<T, std::uint8_t, true>(s, x_k, y_k, at, gy_k, gx_k);
    else
      run_like_the_kernels<T, std::uint8_t, false>(s, x_k, y_k, at, gy_k, gx_k);
    compare(at);
  }
}

}  // namespace

TEST_CASE("the GPU max-pool's windows and gathers equal the CPU's max-pool bit for bit") {
  for (const auto& g : max_pool_cases::geometries())
    for (const bool channels_last : {false, true})
      for (const bool nans : {false, true}) {
        check_against_cpu<float>(g.shape, g.kernel, g.stride, g.padding, channels_last, nans);
        check_against_cpu<double>(g.shape, g.kernel, g.stride, g.padding, channels_last, nans);
      }
}
