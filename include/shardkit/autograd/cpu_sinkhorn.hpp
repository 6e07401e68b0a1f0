// The CPU loops of Sinkhorn-Knopp's passes (device_table.hpp's sinkhorn_* entries): one pass per
// entry, in the order VISSL's distributed_sinkhorn takes the steps, every sum in index order, so
// the codes are the same bits whichever build runs them.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "shardkit/core/error.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::autograd::cpu {

namespace sinkhorn_detail {

// Calls fn(T{}) for q's dtype: f32 or f64.
template <class Fn>
void visit(const Tensor& q, const char* op, Fn&& fn) {
  if (q.dtype() == DType::f32) return fn(float{});
  if (q.dtype() == DType::f64) return fn(double{});
  fail<InvalidArgument>(op, ": the Sinkhorn matrix is f32 or f64, got ", dtype_name(q.dtype()),
                        "; use_double_precision picks between the two");
}

template <class T>
T* values(const Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Entries that are +/-inf become the largest finite entry (0 when none is finite): VISSL's
// safeguard.
template <class T>
void replace_infinities(T* v, std::int64_t n) {
  bool any = false;
  T largest = -std::numeric_limits<T>::infinity();
  for (std::int64_t i = 0; i < n; ++i) {
    if (std::isinf(v[i]))
      any = true;
    else
      largest = std::max(largest, v[i]);
  }
  if (!any) return;
  if (!std::isfinite(largest)) largest = 0;
  for (std::int64_t i = 0; i < n; ++i)
    if (std::isinf(v[i])) v[i] = largest;
}

}  // namespace sinkhorn_detail

inline void sinkhorn_scale(const Tensor& scores, const Tensor& q, const Tensor& largest,
                           double epsilon) {
  sinkhorn_detail::visit(q, "sinkhorn_scale", [&](auto tag) {
    using T = decltype(tag);
    const float* s = sinkhorn_detail::values<const float>(scores);
    T* out = sinkhorn_detail::values<T>(q);
    T best = -std::numeric_limits<T>::infinity();
    for (std::int64_t i = 0; i < q.numel(); ++i) {
      out[i] = static_cast<T>(s[i]) / static_cast<T>(epsilon);
      best = std::max(best, out[i]);
    }
    sinkhorn_detail::values<T>(largest)[0] = best;
  });
}

inline void sinkhorn_exp(const Tensor& q, const Tensor& shift, const Tensor& total) {
  sinkhorn_detail::visit(q, "sinkhorn_exp", [&](auto tag) {
    using T = decltype(tag);
    T* v = sinkhorn_detail::values<T>(q);
    const T by = sinkhorn_detail::values<const T>(shift)[0];
    T sum = 0;
    for (std::int64_t i = 0; i < q.numel(); ++i) {
      v[i] = std::exp(v[i] - by);
      sum += v[i];
    }
    sinkhorn_detail::values<T>(total)[0] = sum;
  });
}

inline void sinkhorn_column_sums(const Tensor& q, const Tensor& divisor, const Tensor& zero_in,
                                 const Tensor& u, std::int64_t rows, std::int64_t cols) {
  sinkhorn_detail::visit(q, "sinkhorn_column_sums", [&](auto tag) {
    using T = decltype(tag);
    T* v = sinkhorn_detail::values<T>(q);
    T* sums = sinkhorn_detail::values<T>(u);
    std::fill(sums, sums + cols, T(0));
    if (zero_in.defined()) {
      const T* w = sinkhorn_detail::values<const T>(zero_in);
      if (std::none_of(w, w + cols, [](T x) { return x == 0; })) return;
      for (std::int64_t i = 0; i < rows * cols; ++i) v[i] += static_cast<T>(1e-12);
    }
    const bool divide = divisor.defined();
    const T by = divide ? sinkhorn_detail::values<const T>(divisor)[0] : T(1);
    for (std::int64_t r = 0; r < rows; ++r) {
      T* row = v + r * cols;
      for (std::int64_t j = 0; j < cols; ++j) {
        if (divide) row[j] /= by;
        sums[j] += row[j];
      }
    }
  });
}

inline void sinkhorn_scale_rows(const Tensor& q, const Tensor& u, const Tensor& u_again,
                                const Tensor& v, std::int64_t rows, std::int64_t cols,
                                std::int64_t global_rows) {
  sinkhorn_detail::visit(q, "sinkhorn_scale_rows", [&](auto tag) {
    using T = decltype(tag);
    const T* first = sinkhorn_detail::values<const T>(u);
    const T* w = std::any_of(first, first + cols, [](T x) { return x == 0; })
                     ? sinkhorn_detail::values<const T>(u_again)
                     : first;
    const T share = T(1) / static_cast<T>(cols);             // each prototype's share
    const T row_share = T(1) / static_cast<T>(global_rows);  // each sample's share
    T* scale = sinkhorn_detail::values<T>(v);
    for (std::int64_t j = 0; j < cols; ++j) scale[j] = share / w[j];
    sinkhorn_detail::replace_infinities(scale, cols);
    T* values = sinkhorn_detail::values<T>(q);
    for (std::int64_t r = 0; r < rows; ++r) {
      T* row = values + r * cols;
      T sum = 0;
      for (std::int64_t j = 0; j < cols; ++j) {
        row[j] *= scale[j];
        sum += row[j];
      }
      const T factor = row_share / sum;
      for (std::int64_t j = 0; j < cols; ++j) row[j] *= factor;
    }
  });
}

inline void sinkhorn_codes(const Tensor& q, const Tensor& codes, std::int64_t code_rows,
                           std::int64_t cols, bool hard) {
  sinkhorn_detail::visit(q, "sinkhorn_codes", [&](auto tag) {
    using T = decltype(tag);
    const T* values = sinkhorn_detail::values<const T>(q);
    float* out = sinkhorn_detail::values<float>(codes);
    for (std::int64_t r = 0; r < code_rows; ++r) {
      const T* row = values + r * cols;
      float* code = out + r * cols;
      T sum = 0;
      for (std::int64_t j = 0; j < cols; ++j) sum += row[j];
      for (std::int64_t j = 0; j < cols; ++j) code[j] = static_cast<float>(row[j] / sum);
      if (hard) {  // the first largest of the f32 codes, as VISSL's argmax over its codes
        // (torch.argmax's rule, the CUDA kernel's too: a NaN goes before any number)
        std::int64_t best = 0;
        for (std::int64_t j = 1; j < cols; ++j)
          if (!std::isnan(code[best]) && (std::isnan(code[j]) || code[j] > code[best])) best = j;
        std::fill(code, code + cols, 0.0f);
        code[best] = 1.0f;
      }
    }
  });
}

}  // namespace shardkit::autograd::cpu
