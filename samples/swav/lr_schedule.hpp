// VISSL's learning-rate schedules (ClassyVision param schedulers): constant, linear, cosine,
// VISSL's cosine_warm_restart and composite, evaluated at where = progress in [0, 1) of the
// training (per step or per epoch), with VISSL's auto-scaling by the global batch (docs/swav.md,
// "Learning rate").
#pragma once

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace swav {

struct Schedule {
  std::string name;  // constant | linear | cosine | cosine_warm_restart
  double start_value = 0, end_value = 0, value = 0;
  // cosine_warm_restart (VISSL's CosineWarmRestartScheduler): a cosine from a peak down to
  // end_value that restarts every restart_interval_length of the part -- a half wave (down), or
  // a full one (down and back up, the peak changing at its bottom) -- each restart's peak
  // start_value x lr_multiplier^k, or with is_adaptive the value the first wave (a single
  // cosine over the part) has there.
  double restart_interval_length = 0;
  bool full_wave = false;
  double lr_multiplier = 1.0;
  bool is_adaptive = false;

  double at(double where) const {
    if (name == "constant") return value;
    if (name == "linear") return start_value + where * (end_value - start_value);
    if (name == "cosine") return cosine(start_value, where);
    if (name == "cosine_warm_restart") {
      const std::vector<double> restarts = restart_points();
      std::size_t k = 0;  // the last restart at or before `where`
      while (k + 1 < restarts.size() && restarts[k + 1] <= where) ++k;
      const double L = restart_interval_length;
      return cosine(restart_peak(k, restarts[k]), full_wave ? where / L : std::fmod(where, L) / L);
    }
    shardkit::fail<shardkit::InvalidArgument>(
        "OPTIMIZER.param_schedulers.lr: scheduler '", name,
        "' is not supported; use constant, linear, cosine, cosine_warm_restart or composite");
  }

 private:
  double cosine(double peak, double where) const {
    return end_value + 0.5 * (peak - end_value) * (1 + std::cos(std::numbers::pi * where));
  }
  // Where the peaks change: 0, then from restart_interval_length on every interval (a half
  // wave) or every second one (a full wave), below 1 (numpy's arange, as VISSL's).
  std::vector<double> restart_points() const {
    const double L = restart_interval_length;
    const double stride = full_wave ? 2 * L : L;
    std::vector<double> points{0.0};
    const double count = std::ceil((1.0 - L) / stride);
    for (int i = 0; i < static_cast<int>(count); ++i) points.push_back(L + i * stride);
    return points;
  }
  double restart_peak(std::size_t k, double point) const {
    double multiplier = std::pow(lr_multiplier, static_cast<double>(k));
    if (is_adaptive) {
      const double phase = full_wave ? restart_interval_length + point : point;
      multiplier = cosine(start_value, phase) / start_value;
    }
    return start_value * multiplier;
  }
};

struct LrSchedule {
  std::vector<Schedule> parts;       // one, or the composite's parts
  std::vector<double> lengths{1.0};  // fractions of the training, summing to 1
  std::vector<bool> rescaled{true};  // interval_scaling: rescaled (true) or fixed
  bool per_step = true;              // update_interval: step | epoch

  double at(double where) const {
    double begin = 0;
    for (std::size_t i = 0; i < parts.size(); ++i) {
      const double end = begin + lengths[i];
      if (where < end || i + 1 == parts.size()) {
        const double local = rescaled[i] ? (where - begin) / lengths[i] : where;
        return parts[i].at(std::min(std::max(local, 0.0), 1.0));
      }
      begin = end;
    }
    return parts.back().at(where);
  }
  // The rate of iteration `iteration` (0-based) of `total` iterations, `per_epoch` a epoch.
  double rate(std::int64_t iteration, std::int64_t total, std::int64_t per_epoch) const {
    const double where = per_step
                             ? double(iteration) / double(total)
                             : double(iteration / per_epoch) * double(per_epoch) / double(total);
    return at(where);
  }
};

}  // namespace swav
