// A channel's batch statistics in training-mode batch-norm, shared by the CPU loops and the CUDA
// kernels (one formula, both devices): folding ranks' moments together (a synchronised
// batch-norm), and turning a channel's moments into what the normalisation, the backward and the
// running statistics keep. All in double.
#pragma once

#include <cmath>
#include <cstdint>

#include "shardkit/core/config.hpp"

namespace shardkit::autograd {

// Moments of one channel: `count` values, their mean, and m2, the sum of squared deviations from
// that mean.
struct ChannelMoments {
  double count = 0, mean = 0, m2 = 0;
};

// Folds another member's moments (n values with mean and m2) into `acc`: Chan et al.'s pairwise
// update, exact in real arithmetic and free of the cancellation that sums of squares suffer.
// Members are folded in rank order, so every member computes the same bits.
SK_HOST_DEVICE SK_INLINE void fold_moments(ChannelMoments& acc, double n, double mean, double m2) {
  if (n == 0) return;
  const double total = acc.count + n;
  const double delta = mean - acc.mean;
  acc.mean += delta * (n / total);
  acc.m2 += m2 + delta * delta * (acc.count * n / total);
  acc.count = total;
}

// What training-mode batch-norm keeps of channel c's moments m: `stats` (double, [2 * channels])
// gets {mean, invstd} for the affine map, with invstd = 1 / sqrt(var + eps) of the biased
// variance; save_mean / save_invstd (the statistics dtype S) the same for backward; and, when
// running_mean is not null, PyTorch's running statistics: running = (1 - momentum) running +
// momentum batch, with the unbiased variance. A SyncBatchNorm group's batch of one value per
// channel, or none, has no unbiased variance: the running statistics stay as they are (PyTorch's
// would take an infinite or NaN variance), the output is the bias, and nothing is normalised.
template <class S>
SK_HOST_DEVICE SK_INLINE void store_batch_stats(const ChannelMoments& m, double momentum,
                                                double eps, std::int64_t c, std::int64_t channels,
                                                double* stats, S* save_mean, S* save_invstd,
                                                S* running_mean, S* running_var) {
  const double var = m.m2 / m.count;
  const double invstd = 1.0 / sqrt(var + eps);
  stats[c] = m.mean;
  stats[channels + c] = invstd;
  save_mean[c] = static_cast<S>(m.mean);
  save_invstd[c] = static_cast<S>(invstd);
  if (running_mean != nullptr && m.count > 1) {
    const double unbiased = m.m2 / (m.count - 1);
    running_mean[c] = static_cast<S>((1 - momentum) * running_mean[c] + momentum * m.mean);
    running_var[c] = static_cast<S>((1 - momentum) * running_var[c] + momentum * unbiased);
  }
}

}  // namespace shardkit::autograd
