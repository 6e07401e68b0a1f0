// CPU batch-norm (training statistics and evaluation) and max-pooling, f32 and f64, with
// statistics accumulated in double.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "shardkit/autograd/cpu_kernels.hpp"

namespace shardkit::autograd::cpu {

// Training: normalises with the batch statistics of each channel over (outer, inner), saves
// mean and 1/sqrt(var + eps), and (when running_mean is defined) folds them into the running
// statistics with PyTorch's momentum rule and the unbiased variance.
inline void batch_norm_train_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                     const Tensor& running_mean, const Tensor& running_var,
                                     double momentum, double eps, const Tensor& y,
                                     const Tensor& save_mean, const Tensor& save_invstd,
                                     std::int64_t outer, std::int64_t channels,
                                     std::int64_t inner) {
  visit_real(x.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* b = static_cast<const T*>(bias.data_ptr());
    T* sm = static_cast<T*>(save_mean.data_ptr());
    T* si = static_cast<T*>(save_invstd.data_ptr());
    const double count = double(outer * inner);
    for (std::int64_t c = 0; c < channels; ++c) {
      double sum = 0;
      for (std::int64_t n = 0; n < outer; ++n) {
        const T* row = in + (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) sum += row[i];
      }
      const double mean = sum / count;
      double sq = 0;
      for (std::int64_t n = 0; n < outer; ++n) {
        const T* row = in + (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) sq += (row[i] - mean) * (row[i] - mean);
      }
      const double var = sq / count;
      const double invstd = 1.0 / std::sqrt(var + eps);
      sm[c] = static_cast<T>(mean);
      si[c] = static_cast<T>(invstd);
      const double scale = w[c] * invstd, shift = b[c] - mean * scale;
      for (std::int64_t n = 0; n < outer; ++n) {
        const std::int64_t at = (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i)
          out[at + i] = static_cast<T>(in[at + i] * scale + shift);
      }
      if (running_mean.defined()) {
        T* rm = static_cast<T*>(running_mean.data_ptr());
        T* rv = static_cast<T*>(running_var.data_ptr());
        const double unbiased = count > 1 ? sq / (count - 1) : var;
        rm[c] = static_cast<T>((1 - momentum) * rm[c] + momentum * mean);
        rv[c] = static_cast<T>((1 - momentum) * rv[c] + momentum * unbiased);
      }
    }
  });
}

inline void batch_norm_eval_forward(const Tensor& x, const Tensor& weight, const Tensor& bias,
                                    const Tensor& mean, const Tensor& var, double eps,
                                    const Tensor& y, std::int64_t outer, std::int64_t channels,
                                    std::int64_t inner) {
  visit_real(x.dtype(), "batch_norm", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* b = static_cast<const T*>(bias.data_ptr());
    const T* m = static_cast<const T*>(mean.data_ptr());
    const T* v = static_cast<const T*>(var.data_ptr());
    for (std::int64_t n = 0; n < outer; ++n)
      for (std::int64_t c = 0; c < channels; ++c) {
        const double scale = w[c] / std::sqrt(double(v[c]) + eps), shift = b[c] - m[c] * scale;
        const std::int64_t at = (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i)
          out[at + i] = static_cast<T>(in[at + i] * scale + shift);
      }
  });
}

// Training-mode backward through the batch statistics:
//   grad_x = w * invstd / M * (M * g - sum(g) - xhat * sum(g * xhat)).
inline void batch_norm_train_backward(const Tensor& x, const Tensor& grad_y, const Tensor& weight,
                                      const Tensor& save_mean, const Tensor& save_invstd,
                                      const Tensor& grad_x, const Tensor& grad_weight,
                                      const Tensor& grad_bias, std::int64_t outer,
                                      std::int64_t channels, std::int64_t inner) {
  visit_real(x.dtype(), "batch_norm backward", [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(x.data_ptr());
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const T* w = static_cast<const T*>(weight.data_ptr());
    const T* sm = static_cast<const T*>(save_mean.data_ptr());
    const T* si = static_cast<const T*>(save_invstd.data_ptr());
    const double count = double(outer * inner);
    for (std::int64_t c = 0; c < channels; ++c) {
      const double mean = sm[c], invstd = si[c];
      double sum_g = 0, sum_gx = 0;
      for (std::int64_t n = 0; n < outer; ++n) {
        const std::int64_t at = (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) {
          sum_g += gy[at + i];
          sum_gx += gy[at + i] * (in[at + i] - mean);
        }
      }
      const double sum_gxhat = sum_gx * invstd;
      if (grad_weight.defined())
        static_cast<T*>(grad_weight.data_ptr())[c] = static_cast<T>(sum_gxhat);
      if (grad_bias.defined()) static_cast<T*>(grad_bias.data_ptr())[c] = static_cast<T>(sum_g);
      if (!grad_x.defined()) continue;
      T* gx = static_cast<T*>(grad_x.data_ptr());
      const double k = w[c] * invstd / count;
      for (std::int64_t n = 0; n < outer; ++n) {
        const std::int64_t at = (n * channels + c) * inner;
        for (std::int64_t i = 0; i < inner; ++i) {
          const double xhat = (in[at + i] - mean) * invstd;
          gx[at + i] = static_cast<T>(k * (count * gy[at + i] - sum_g - xhat * sum_gxhat));
        }
      }
    }
  });
}

struct PoolGeometry {
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};

// Max-pool x[N, C, H, W] -> y[N, C, OH, OW]; argmax[N, C, OH, OW] (i64) holds the index into
// each H*W plane for backward. Padding never wins (it is -inf, as in PyTorch).
inline void max_pool_forward(const Tensor& x, const Tensor& y, const Tensor& argmax,
                             const PoolGeometry& p) {
  visit_real(x.dtype(), "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t planes = x.size(0) * x.size(1), H = x.size(2), W = x.size(3);
    const std::int64_t OH = y.size(2), OW = y.size(3);
    const T* in = static_cast<const T*>(x.data_ptr());
    T* out = static_cast<T*>(y.data_ptr());
    auto* arg = static_cast<std::int64_t*>(argmax.data_ptr());
    for (std::int64_t q = 0; q < planes; ++q) {
      const T* plane = in + q * H * W;
      for (std::int64_t oh = 0; oh < OH; ++oh)
        for (std::int64_t ow = 0; ow < OW; ++ow) {
          T best = -std::numeric_limits<T>::infinity();
          std::int64_t best_at = -1;
          for (std::int64_t kh = 0; kh < p.kernel_h; ++kh) {
            const std::int64_t ih = oh * p.stride_h - p.pad_h + kh;
            if (ih < 0 || ih >= H) continue;
            for (std::int64_t kw = 0; kw < p.kernel_w; ++kw) {
              const std::int64_t iw = ow * p.stride_w - p.pad_w + kw;
              if (iw < 0 || iw >= W) continue;
              const T v = plane[ih * W + iw];
              if (best_at < 0 || v > best || std::isnan(v)) {
                best = v;
                best_at = ih * W + iw;
              }
            }
          }
          out[(q * OH + oh) * OW + ow] = best;
          arg[(q * OH + oh) * OW + ow] = best_at;
        }
    }
  });
}

inline void max_pool_backward(const Tensor& grad_y, const Tensor& argmax, const Tensor& grad_x) {
  visit_real(grad_y.dtype(), "max_pool2d backward", [&](auto tag) {
    using T = decltype(tag);
    const std::int64_t planes = grad_x.size(0) * grad_x.size(1);
    const std::int64_t HW = grad_x.size(2) * grad_x.size(3);
    const std::int64_t OHW = grad_y.size(2) * grad_y.size(3);
    const T* gy = static_cast<const T*>(grad_y.data_ptr());
    const auto* arg = static_cast<const std::int64_t*>(argmax.data_ptr());
    T* gx = static_cast<T*>(grad_x.data_ptr());
    std::fill(gx, gx + grad_x.numel(), T(0));
    for (std::int64_t q = 0; q < planes; ++q)
      for (std::int64_t o = 0; o < OHW; ++o)
        if (arg[q * OHW + o] >= 0) gx[q * HW + arg[q * OHW + o]] += gy[q * OHW + o];
  });
}

}  // namespace shardkit::autograd::cpu
