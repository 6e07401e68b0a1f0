// Multi-crop batches made on worker threads ahead of the training step. Batch n of an epoch
// holds the images sampler indices [n*B, (n+1)*B) (the last partial batch is dropped, VISSL's
// DROP_LAST); its crops come out the same whichever worker makes them (multicrop.hpp), so the
// number of workers never changes a run.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "multicrop.hpp"
#include "shardkit/data/image_dataset.hpp"

namespace swav {

struct MultiCropBatch {
  std::int64_t number = 0;           // batch number within the epoch
  std::vector<std::int64_t> images;  // dataset indices
  // Per size group: [num_crops[g] x B, channels, side, side], crop-major (all images' first crop,
  // then their second, ...), as SwAV stacks crops of one size through the trunk.
  std::vector<std::vector<float>> groups;
};

class MultiCropLoader {
 public:
  MultiCropLoader(const sk::data::ImageDataset& data, MultiCropConfig config, std::uint64_t seed,
                  int workers, int prefetch)
      : data_(&data),
        config_(std::move(config)),
        seed_(seed),
        workers_(workers),
        prefetch_(prefetch) {
    config_.validate();
    sk::check(workers >= 1, "DATA.NUM_DATALOADER_WORKERS ", workers, " must be >= 1");
    sk::check(prefetch >= 1, "loader prefetch depth ", prefetch, " must be >= 1");
  }
  ~MultiCropLoader() { stop(); }
  MultiCropLoader(const MultiCropLoader&) = delete;
  MultiCropLoader& operator=(const MultiCropLoader&) = delete;

  const MultiCropConfig& config() const { return config_; }

  // Starts making the batches of `epoch` from `indices` (this rank's sampler order, already
  // past any skipped batches); `first_batch` numbers the first one (the sampler's start_iter).
  void start_epoch(std::int64_t epoch, std::vector<std::int64_t> indices, std::int64_t batch_size,
                   std::int64_t first_batch = 0) {
    stop();
    sk::check(batch_size >= 1, "DATA.TRAIN.BATCHSIZE_PER_REPLICA ", batch_size, " must be >= 1");
    epoch_ = epoch;
    indices_ = std::move(indices);
    batch_size_ = batch_size;
    first_batch_ = first_batch;
    batches_ = static_cast<std::int64_t>(indices_.size()) / batch_size;
    next_to_make_ = next_to_take_ = 0;
    ready_.clear();
    error_ = nullptr;  // an earlier epoch's failure, already reported
    stopping_ = false;
    for (int w = 0; w < workers_; ++w) threads_.emplace_back([this] { work(); });
  }

  std::int64_t batches_in_epoch() const { return batches_; }

  // The next batch in order, or nothing at the end of the epoch. Time spent waiting here is
  // time the step waited for data (waited_seconds).
  std::optional<MultiCropBatch> next() {
    std::unique_lock lock(mutex_);
    if (next_to_take_ >= batches_) return std::nullopt;
    const auto begin = std::chrono::steady_clock::now();
    made_.wait(lock, [&] { return ready_.count(next_to_take_) > 0 || error_; });
    waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (error_) std::rethrow_exception(error_);
    auto node = ready_.extract(next_to_take_++);
    taken_.notify_all();
    return std::move(node.mapped());
  }

  double waited_seconds() const { return waited_; }

 private:
  void work() {
    for (;;) {
      std::int64_t n;
      {
        std::unique_lock lock(mutex_);
        taken_.wait(lock, [&] {
          return stopping_ || next_to_make_ >= batches_ ||
                 next_to_make_ < next_to_take_ + prefetch_;
        });
        if (stopping_ || next_to_make_ >= batches_) return;
        n = next_to_make_++;
      }
      try {
        MultiCropBatch batch = make(n);
        std::lock_guard lock(mutex_);
        ready_.emplace(n, std::move(batch));
      } catch (...) {
        // The first failure is the epoch's: a later one from another worker is dropped here,
        // not swapped in while next() may be rethrowing the first.
        std::lock_guard lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
      made_.notify_all();
    }
  }

  MultiCropBatch make(std::int64_t n) const {
    MultiCropBatch batch;
    batch.number = first_batch_ + n;
    batch.images.assign(indices_.begin() + n * batch_size_,
                        indices_.begin() + (n + 1) * batch_size_);
    const std::int64_t channels = data_->channels;
    batch.groups.resize(config_.num_crops.size());
    for (std::size_t g = 0; g < config_.num_crops.size(); ++g)
      batch.groups[g].resize(static_cast<std::size_t>(config_.num_crops[g] * batch_size_ *
                                                      channels * config_.size_crops[g] *
                                                      config_.size_crops[g]));
    int crop = 0;
    for (std::size_t g = 0; g < config_.num_crops.size(); ++g) {
      const std::int64_t crop_size =
          channels * std::int64_t{config_.size_crops[g]} * config_.size_crops[g];
      for (int c = 0; c < config_.num_crops[g]; ++c, ++crop)
        for (std::int64_t i = 0; i < batch_size_; ++i) {
          const std::int64_t image = batch.images[static_cast<std::size_t>(i)];
          make_crop(config_, seed_, epoch_, image, crop, data_->image(image),
                    batch.groups[g].data() + (c * batch_size_ + i) * crop_size);
        }
    }
    return batch;
  }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    taken_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  const sk::data::ImageDataset* data_;
  MultiCropConfig config_;
  std::uint64_t seed_;
  int workers_, prefetch_;
  std::int64_t epoch_ = 0, batch_size_ = 1, first_batch_ = 0, batches_ = 0;
  std::vector<std::int64_t> indices_;
  std::mutex mutex_;
  std::condition_variable made_, taken_;
  std::map<std::int64_t, MultiCropBatch> ready_;
  std::int64_t next_to_make_ = 0, next_to_take_ = 0;
  bool stopping_ = false;
  std::exception_ptr error_;
  std::vector<std::thread> threads_;
  double waited_ = 0;
};

}  // namespace swav
