// SwAV's codes: the distributed Sinkhorn-Knopp iteration as VISSL's distributed_sinkhornknopp
// computes it (docs/swav.md, "Codes"). Each rank holds the scores of its own samples; the
// prototype sums and the global maximum and total are all-reduced, the per-sample sums stay
// local, so every rank ends with the codes of its samples under one global equipartition.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "shardkit/comm/reduction.hpp"
#include "shardkit/core/error.hpp"

namespace swav {

namespace sk = shardkit;

struct SinkhornOptions {
  double epsilon = 0.05;              // softness of the codes: exp(scores / epsilon)
  int num_iters = 3;                  // alternating normalisations
  bool use_double_precision = false;  // compute in f64 instead of f32
  bool hard_assignment = false;       // one-hot codes (VISSL's temp_hard_assignment_iters)
};

namespace detail {

// Entries that are +inf become the largest finite entry (VISSL's safeguard; the maximum is the
// rank's own, as there).
template <class T>
void replace_infinities(std::span<T> values) {
  bool any = false;
  T largest = -std::numeric_limits<T>::infinity();
  for (T v : values) {
    if (std::isinf(v))
      any = true;
    else
      largest = std::max(largest, v);
  }
  if (!any) return;
  if (!std::isfinite(largest)) largest = 0;  // VISSL zeroes the infinities before its max
  for (T& v : values)
    if (std::isinf(v)) v = largest;
}

// The iteration in T, over q[b * k + j] (sample b, prototype j) of this rank's `batch` samples.
template <class T, class AllReduce>
std::vector<float> sinkhorn_in(std::span<const float> scores, std::int64_t batch, std::int64_t k,
                               int world_size, const SinkhornOptions& options,
                               AllReduce&& all_reduce) {
  const std::size_t n = static_cast<std::size_t>(batch * k);
  std::vector<T> q(n);
  // exp(scores / epsilon - global max): the shift cancels in the normalisation below and keeps
  // exp from overflowing (VISSL shifts in f32; in f64 nothing can overflow, the shift only
  // changes rounding).
  T shift = -std::numeric_limits<T>::infinity();
  for (std::size_t i = 0; i < n; ++i) {
    q[i] = static_cast<T>(scores[i]) / static_cast<T>(options.epsilon);
    shift = std::max(shift, q[i]);
  }
  std::vector<T> reduced{shift};
  all_reduce(std::span<T>(reduced), sk::comm::ReduceOp::max);
  shift = reduced[0];
  for (T& v : q) v = std::exp(v - shift);
  replace_infinities(std::span<T>(q));

  T total = 0;
  for (T v : q) total += v;
  reduced[0] = total;
  all_reduce(std::span<T>(reduced), sk::comm::ReduceOp::sum);
  for (T& v : q) v /= reduced[0];

  const T r = T(1) / static_cast<T>(k);                                 // each prototype's share
  const T c = T(1) / static_cast<T>(batch * std::int64_t{world_size});  // each sample's share
  std::vector<T> u(static_cast<std::size_t>(k));
  auto prototype_sums = [&] {
    std::fill(u.begin(), u.end(), T(0));
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t j = 0; j < k; ++j)
        u[static_cast<std::size_t>(j)] += q[static_cast<std::size_t>(b * k + j)];
    all_reduce(std::span<T>(u), sk::comm::ReduceOp::sum);
  };
  for (int it = 0; it < options.num_iters; ++it) {
    prototype_sums();
    if (std::any_of(u.begin(), u.end(), [](T v) { return v == 0; })) {
      for (T& v : q) v += static_cast<T>(1e-12);  // an empty prototype: VISSL's epsilon
      prototype_sums();
    }
    for (T& v : u) v = r / v;
    replace_infinities(std::span<T>(u));
    for (std::int64_t b = 0; b < batch; ++b) {
      T* row = q.data() + b * k;
      T sum = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        row[j] *= u[static_cast<std::size_t>(j)];
        sum += row[j];
      }
      const T factor = c / sum;
      for (std::int64_t j = 0; j < k; ++j) row[j] *= factor;
    }
  }
  // Every sample's code sums to 1.
  std::vector<float> codes(n);
  for (std::int64_t b = 0; b < batch; ++b) {
    const T* row = q.data() + b * k;
    T sum = 0;
    for (std::int64_t j = 0; j < k; ++j) sum += row[j];
    for (std::int64_t j = 0; j < k; ++j)
      codes[static_cast<std::size_t>(b * k + j)] = static_cast<float>(row[j] / sum);
  }
  if (options.hard_assignment) {
    for (std::int64_t b = 0; b < batch; ++b) {
      float* row = codes.data() + b * k;
      const auto best = std::max_element(row, row + k) - row;
      std::fill(row, row + k, 0.0f);
      row[best] = 1.0f;
    }
  }
  return codes;
}

}  // namespace detail

// Codes [batch, k] (row-major, f32) of this rank's `scores` [batch, k]. `all_reduce(span,
// op)` reduces a host vector over the ranks in place (sum or max); every rank must call with
// the same batch and k.
template <class AllReduce>
std::vector<float> distributed_sinkhorn(std::span<const float> scores, std::int64_t batch,
                                        std::int64_t k, int world_size,
                                        const SinkhornOptions& options, AllReduce&& all_reduce) {
  sk::check(batch > 0 && k > 0 && scores.size() == static_cast<std::size_t>(batch * k),
            "distributed_sinkhorn: ", scores.size(), " scores do not form [", batch, ", ", k,
            "] (samples x prototypes)");
  sk::check(options.epsilon > 0, "distributed_sinkhorn: epsilon ", options.epsilon,
            " must be positive (VISSL's default is 0.05; 0.03 against collapse)");
  sk::check(options.num_iters >= 1, "distributed_sinkhorn: num_iters ", options.num_iters,
            " must be at least 1 (VISSL's default is 3)");
  if (options.use_double_precision)
    return detail::sinkhorn_in<double>(scores, batch, k, world_size, options, all_reduce);
  return detail::sinkhorn_in<float>(scores, batch, k, world_size, options, all_reduce);
}

}  // namespace swav
