// VISSL's learning-rate schedules (ClassyVision param schedulers): constant, linear, cosine and
// composite, evaluated at where = progress in [0, 1) of the training (per step or per epoch),
// with VISSL's auto-scaling by the global batch (docs/swav.md, "Learning rate").
#pragma once

#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "shardkit/core/error.hpp"

namespace swav {

struct Schedule {
  std::string name;  // constant | linear | cosine
  double start_value = 0, end_value = 0, value = 0;

  double at(double where) const {
    if (name == "constant") return value;
    if (name == "linear") return start_value + where * (end_value - start_value);
    if (name == "cosine")
      return end_value + 0.5 * (start_value - end_value) * (1 + std::cos(std::numbers::pi * where));
    shardkit::fail<shardkit::InvalidArgument>(
        "OPTIMIZER.param_schedulers.lr: scheduler '", name,
        "' is not supported; use constant, linear, cosine or composite");
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
