// A training run's position -- the steps taken, the epoch under way and its batches taken --
// and where a resumed run starts when its checkpoint was written under another global batch
// (world size x batch per rank). A checkpoint counts steps of the run that wrote it; taken as
// they are, the steps of another batch put the learning rate's schedule (iteration / total) and
// the epoch's data elsewhere: twice the ranks and the schedule jumps ahead while the rest of the
// epoch's data is skipped; half and it falls behind and the run ends before the schedule does.
// So the position travels in images, as VISSL's schedule follows the samples seen.
#pragma once

#include <climits>
#include <cstdint>

#include "shardkit/core/error.hpp"

namespace shardkit::data {

struct TrainingPosition {
  std::int64_t iteration = 0;  // steps taken (the schedule's position)
  std::int64_t epoch = 0;      // the epoch under way, from 0
  std::int64_t batch = 0;      // the epoch's batches taken
};

// `p`, written at `written_images` images a step, for a run of `images` a step and `per_epoch`
// steps an epoch: the same epoch, the batch that covers the epoch's images taken so far (the
// last partial step's images are seen again), and the iteration this run has there. (A caller's
// own counters that follow the iteration -- SwAV's loss, whose queue starts at one -- keep their
// distance from it.)
inline TrainingPosition converted_position(const TrainingPosition& p, std::int64_t written_images,
                                           std::int64_t images, std::int64_t per_epoch) {
  check(written_images >= 1 && images >= 1 && per_epoch >= 0, "converted_position: images a step ",
        written_images, " -> ", images, " and steps an epoch ", per_epoch, " must be positive");
  if (written_images == images) return p;
  check(p.epoch >= 0 && p.batch >= 0 && p.batch <= INT64_MAX / written_images &&
            (per_epoch == 0 ||
             p.epoch <= (INT64_MAX - p.batch * written_images / images) / per_epoch),
        "a checkpoint's position (epoch ", p.epoch, ", batch ", p.batch,
        ") is not one a run reaches; resume from another checkpoint");
  TrainingPosition out;
  out.epoch = p.epoch;
  out.batch = p.batch * written_images / images;
  out.iteration = p.epoch * per_epoch + out.batch;
  return out;
}

}  // namespace shardkit::data
