// One rank of the SwAV trainer (docs/swav.md, "The trainer"): multi-crop batches from the
// loader, the trunk once per crop size through the sharded module (ddp / oss / sdp / fsdp),
// head and prototypes on all crops together, the SwAV loss, SGD or LARC-SGD under the schedule, the
// prototypes frozen for their first iterations and re-normalised after each step; progress
// lines, a JSONL metrics file, step-folder checkpoints that resume mid-epoch on any stage and
// world size, and weighted kNN evaluation beside the raw-pixel kNN.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "datasets.hpp"
#include "knn.hpp"
#include "loader.hpp"
#include "rank_setup.hpp"
#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/checkpoint/step_folders.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/data/stateful_sampler.hpp"
#include "shardkit/data/training_position.hpp"
#include "shardkit/optim/loss_scaler.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "shardkit/parallel/param_rows.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/parallel/sync_batch_norm.hpp"
#include "swav_config.hpp"
#include "swav_loss.hpp"
#include "swav_model.hpp"

namespace swav {

// What a run reports (rank 0's view).
struct RunReport {
  std::int64_t iterations = 0, start_iteration = 0;
  std::vector<double> losses;  // mean over ranks, per logged step
  double knn_init = -1, knn = -1, raw_knn = -1;
  // Every kNN evaluation of the run: when (initial network, epoch N, ...) and each feature set's
  // accuracy, in the order of knn_features (the first is the headline).
  struct KnnRow {
    std::string when;
    std::vector<double> accuracy;
  };
  std::vector<KnnRow> knn_table;
  std::vector<std::string> knn_features;
  // train_seconds: the training loop's wall time, of which paused_seconds went to its periodic
  // evaluations and checkpoints; images_per_second counts the rest (the steps) only.
  double train_seconds = 0, paused_seconds = 0, data_wait_seconds = 0, images_per_second = 0;
  std::int64_t peak_bytes = 0;  // the largest per-rank peak
  std::uint64_t fingerprint = 0;
  bool resumed = false;
};

class SwavTrainer {
 public:
  SwavTrainer(const SwavConfig& c, sk::Context& ctx, sk::comm::Communicator& comm,
              const Datasets& data, std::FILE* log)
      : c_(c),
        ctx_(&ctx),
        comm_(&comm),
        data_(&data),
        log_(comm.rank() == 0 ? log : nullptr),
        live_(log_ != nullptr && ::isatty(::fileno(log_)) != 0),
        model_(build_model(ctx, c)),
        loss_(ctx, c.loss, c.embedding_dim, c.prototypes, comm.rank(), c.seed) {
    {
      std::vector<std::string> names;
      for (const auto& [name, parameter] : model_->named_parameters()) names.push_back(name);
      check_frozen_names(names, c.frozen);
    }
    if (c.sync_bn_group > 0)  // before wrapping: every rank splits the world (collective)
      sk::parallel::convert_sync_batch_norm(
          *model_, sk::parallel::sync_batch_norm_group(comm, c.sync_bn_group));
    const RankSetup setup = rank_setup(*model_, c, comm.size());
    plan_ = setup.memory;
    if (c.parallel.stage == sk::parallel::Stage::fsdp) {
      blocks_ = static_cast<std::int64_t>(model_->trunk->block_paths().size());
      nested_units_ =
          static_cast<std::int64_t>(setup.parallel.fsdp.wrap.unit_paths.size()) - blocks_;
    }
    sharded_ = std::make_unique<sk::parallel::ShardedModule>(ctx, comm, model_, setup.optimizer,
                                                             setup.parallel);
    // VISSL's NormalizePrototypesHook: the prototypes' rows after every update, inside the step.
    sk::parallel::normalize_rows_after_step(sharded_->engine(), SwavModel::kPrototypes);
    sampler_ = std::make_unique<sk::data::StatefulDistributedSampler>(
        data.train.count, comm.size(), comm.rank(), c.batch_size, c.seed);
    check_batch_fits(c, sampler_->samples_per_rank());
    loader_ = std::make_unique<MultiCropLoader>(data.train, c.crops, c.seed, c.workers, 2);
    if (wants_step_graph()) graph_.emplace(ctx, "the SwAV training step");
  }

  RunReport run() {
    RunReport report;
    const std::int64_t per_epoch = sampler_->samples_per_rank() / c_.batch_size;
    const std::int64_t total = per_epoch * c_.num_epochs;
    std::int64_t epoch = 0, batch_in_epoch = 0;
    if (auto found = resume_point()) {
      const auto state = load(*found, per_epoch);
      iteration_ = state.iteration;
      epoch = state.epoch;
      batch_in_epoch = state.batch;
      report.resumed = true;
    } else {
      // A fresh run's metrics start a fresh file: appended to an earlier run's (OVERWRITE_
      // EXISTING over a folder), its curves would jump back to iteration 0 in the plot.
      if (comm_->rank() == 0 && !c_.metrics_path.empty()) {
        std::error_code ignored;
        std::filesystem::remove(c_.metrics_path, ignored);
      }
    }
    if (!report.resumed && c_.test_model) {
      nlohmann::json by_layer;  // the network at initialisation
      report.knn_init = evaluate(report, Evaluation::initial, by_layer, "initial network");
      log_metrics(knn_metrics(
          {{"iteration", 0}, {"knn_init", report.knn_init}, {"raw_knn", report.raw_knn}},
          by_layer));
    }
    report.start_iteration = iteration_;
    say("memory plan per rank: parameters %.2f MB, gradients %.2f MB, optimizer state %.2f MB, "
        "communication and gathered units <= %.2f MB (activations: measured below)\n",
        plan_.parameters / 1e6, plan_.gradients / 1e6, plan_.optimizer_state / 1e6,
        double(plan_.communication + plan_.gathered) / 1e6);
    if (c_.parallel.stage == sk::parallel::Stage::fsdp)
      say("FSDP units: the trunk's %lld blocks%s, and the root (the rest)\n",
          static_cast<long long>(blocks_),
          nested_units_ == 0 ? ""
                             : (", " + std::to_string(nested_units_) +
                                (nested_units_ == 1 ? " convolution" : " convolutions") +
                                " of >= " + std::to_string(c_.fsdp_wrap_threshold) +
                                " parameters nested in them (AUTO_WRAP_THRESHOLD)")
                                   .c_str());
    if (c_.parallel.offload.enabled())
      say("offloaded to the host per rank: parameters %.2f MB, gradients %.2f MB, optimizer "
          "state %.2f MB\n",
          plan_.host_parameters / 1e6, plan_.host_gradients / 1e6,
          plan_.host_optimizer_state / 1e6);
    const std::int64_t last = c_.max_iterations >= 0 ? std::min(total, c_.max_iterations) : total;
    const auto begin = std::chrono::steady_clock::now();
    auto last_log = begin;
    std::int64_t last_log_iteration = iteration_;
    // Time in evaluations and checkpoints inside the loop, kept out of the images/s figures.
    double paused = 0, paused_at_last_log = 0;
    auto pause = [&paused](auto&& work) {
      const auto start = std::chrono::steady_clock::now();
      work();
      paused += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (; epoch < c_.num_epochs && iteration_ < last; ++epoch, batch_in_epoch = 0) {
      sampler_->set_epoch(epoch);
      sampler_->set_start_iter(batch_in_epoch);
      loader_->start_epoch(epoch, sampler_->indices(), c_.batch_size, batch_in_epoch);
      while (iteration_ < last) {
        auto batch = loader_->next();
        if (!batch) break;
        // The loss is read back (a device sync on the GPU) only on the steps that log it: every
        // LOG_FREQUENCY-th, the last, and the run's first, so that the first loss line comes a
        // second after the initial kNN figures rather than LOG_FREQUENCY steps later.
        const bool logs = (iteration_ + 1) % c_.log_frequency == 0 || iteration_ + 1 == last ||
                          iteration_ == report.start_iteration;
        const double loss = step(*batch, c_.lr.rate(iteration_, total, per_epoch), logs);
        ++iteration_;
        batch_in_epoch = batch->number + 1;
        show_status(epoch, last, per_epoch, begin, report.start_iteration);
        if (logs) {
          const auto now = std::chrono::steady_clock::now();
          const double seconds =
              std::chrono::duration<double>(now - last_log).count() - (paused - paused_at_last_log);
          const double mean_loss = mean_over_ranks(loss);
          const double images =
              double((iteration_ - last_log_iteration) * c_.batch_size * comm_->size());
          const double elapsed = std::chrono::duration<double>(now - begin).count();
          const double eta =
              elapsed / double(iteration_ - report.start_iteration) * double(last - iteration_);
          const std::int64_t peak = max_over_ranks(ctx_->memory_stats().peak_total());
          report.losses.push_back(mean_loss);
          report.peak_bytes = peak;
          say("epoch %lld/%d  step %lld/%lld  loss %.4f  lr %.5f  %.1f img/s  ETA %s  "
              "mem/rank %.1f MB (max)  data wait %.1f%%\n",
              static_cast<long long>(epoch + 1), c_.num_epochs, static_cast<long long>(iteration_),
              static_cast<long long>(last), mean_loss, c_.lr.rate(iteration_ - 1, total, per_epoch),
              images / seconds, duration(eta).c_str(), double(peak) / 1e6,
              100.0 * loader_->waited_seconds() / std::max(elapsed, 1e-9));
          log_metrics({{"iteration", iteration_},
                       {"epoch", epoch},
                       {"loss", mean_loss},
                       {"lr", c_.lr.rate(iteration_ - 1, total, per_epoch)},
                       {"images_per_second", images / seconds},
                       {"peak_bytes_per_rank", peak},
                       {"stage", std::string(sk::parallel::stage_name(c_.parallel.stage))}});
          // VISSL's CheckNanLossHook: a loss no longer finite ends the run here, logged, before
          // a checkpoint of diverged weights could take the last good one's place. (Every rank
          // holds the same mean.)
          sk::check<sk::StateError>(
              std::isfinite(mean_loss), "iteration ", iteration_,
              ": the loss averaged over the ranks is ", mean_loss,
              "; the run stops before a checkpoint keeps diverged weights (VISSL's "
              "CheckNanLossHook) -- lower the learning rate, or turn LARC or loss scaling on, "
              "and resume from the last checkpoint");
          last_log = now;
          last_log_iteration = iteration_;
          paused_at_last_log = paused;
        }
        if (c_.checkpoint_every_iters > 0 && iteration_ % c_.checkpoint_every_iters == 0)
          pause([&] { save(epoch, batch_in_epoch); });
      }
      const bool epoch_done = batch_in_epoch >= per_epoch;
      if (!epoch_done) {  // stopped by MAX_ITERATIONS inside the epoch: saved where it stopped
        const bool saving = c_.checkpoint_every_epochs > 0 || c_.checkpoint_every_iters > 0;
        const bool saved_here =
            c_.checkpoint_every_iters > 0 && iteration_ % c_.checkpoint_every_iters == 0;
        if (saving && !saved_here && iteration_ > report.start_iteration)
          pause([&] { save(epoch, batch_in_epoch); });
        break;
      }
      // (the run's last epoch always, as VISSL's is_checkpoint_phase: else the epochs after the
      // last multiple of CHECKPOINT_FREQUENCY were trained and then lost)
      if (c_.checkpoint_every_epochs > 0 &&
          ((epoch + 1) % c_.checkpoint_every_epochs == 0 || epoch + 1 == c_.num_epochs))
        pause([&] { save(epoch + 1, 0); });
      // (the final evaluation below covers the run's last epoch, and one that MAX_ITERATIONS
      // ended)
      if (c_.test_model && c_.knn_every_epochs > 0 && (epoch + 1) % c_.knn_every_epochs == 0 &&
          epoch + 1 < c_.num_epochs && iteration_ < last) {
        nlohmann::json by_layer;
        double knn = 0;
        pause([&] {
          knn = evaluate(report, Evaluation::periodic, by_layer,
                         "epoch " + std::to_string(epoch + 1));
        });
        say("epoch %lld: kNN top-1 %.2f%%\n", static_cast<long long>(epoch + 1), 100 * knn);
        log_metrics(
            knn_metrics({{"epoch", epoch + 1}, {"iteration", iteration_}, {"knn", knn}}, by_layer));
      }
    }
    report.train_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    report.paused_seconds = paused;
    report.images_per_second =
        double((iteration_ - report.start_iteration) * c_.batch_size * comm_->size()) /
        std::max(report.train_seconds - paused, 1e-9);
    report.data_wait_seconds = loader_->waited_seconds();
    report.iterations = iteration_;
    if (graph_)
      say("step graph (MACHINE.CUDA_GRAPH): %lld warm-up steps, %lld captured, %lld replayed; "
          "%.2f MB kept for its graphs\n",
          static_cast<long long>(graph_->stats().eager),
          static_cast<long long>(graph_->stats().captures),
          static_cast<long long>(graph_->stats().replays), graph_->reserved_bytes() / 1e6);
    const auto memory = ctx_->memory_stats().snapshot();
    using sk::MemoryCategory;
    say("memory measured on rank 0: parameters %.2f MB, gradients %.2f MB, optimizer state "
        "%.2f MB (planned %.2f / %.2f / %.2f); peaks: communication %.2f MB, activations "
        "%.2f MB, total %.2f MB%s\n",
        memory.current_of(MemoryCategory::parameters) / 1e6,
        memory.current_of(MemoryCategory::gradients) / 1e6,
        memory.current_of(MemoryCategory::optimizer_state) / 1e6, plan_.parameters / 1e6,
        plan_.gradients / 1e6, plan_.optimizer_state / 1e6,
        memory.peak_of(MemoryCategory::communication) / 1e6,
        memory.peak_of(MemoryCategory::activations) / 1e6, memory.peak_total / 1e6,
        kept_for_reuse().c_str());
    if (c_.test_model) {
      nlohmann::json by_layer;
      const bool at_epoch_end = per_epoch > 0 && iteration_ > 0 && iteration_ % per_epoch == 0;
      report.knn = evaluate(report, Evaluation::final, by_layer,
                            at_epoch_end ? "epoch " + std::to_string(iteration_ / per_epoch)
                                         : "iteration " + std::to_string(iteration_));
      log_metrics(knn_metrics(
          {{"iteration", iteration_}, {"knn", report.knn}, {"raw_knn", report.raw_knn}}, by_layer));
    }
    report.fingerprint = fingerprint();
    return report;
  }

  // Takes the run's first training step (epoch 0's first batch) and returns the host memory it
  // held at its peak beyond what it keeps in use after it: activations, the loss's and the
  // kernels' scratch. What step_memory.hpp measures before the ranks start.
  std::int64_t step_transient_bytes() {
    const std::int64_t per_epoch = sampler_->samples_per_rank() / c_.batch_size;
    sampler_->set_epoch(0);
    loader_->start_epoch(0, sampler_->indices(), c_.batch_size, 0);
    const auto batch = loader_->next();
    sk::check(batch.has_value(), "swav: the loader gave no first batch (", data_->train.count,
              " training images, a batch of ", c_.batch_size, ")");
    auto& memory = ctx_->memory_stats();
    memory.reset_peak();
    step(*batch, c_.lr.rate(0, per_epoch * c_.num_epochs, per_epoch), false);
    return memory.peak_total() - memory.current_total();
  }

 private:
  // What the host allocator keeps besides the memory in use: freed blocks and its segments'
  // free space (a GPU's pool is the driver's).
  std::string kept_for_reuse() const {
    if (ctx_->device().is_cuda()) return "";
    char text[80];
    std::snprintf(text, sizeof text, "; kept for reuse by its allocator %.2f MB",
                  double(ctx_->allocator().cached_bytes()) / 1e6);
    return text;
  }

  // MACHINE.CUDA_GRAPH. auto: on a GPU when every part of the step can be captured and has run
  // captured on a GPU; true: also on the CPU, where a replay runs the step's code again under
  // the capture's rules (a check that it would replay, at the cost of those checks).
  bool wants_step_graph() const {
    if (c_.cuda_graph == "false") return false;
    // What a captured step cannot hold (it would be refused by name inside the capture):
    const bool draws_masks =
        c_.trunk == "efficientnet" &&
        (c_.efficientnet.drop_connect_rate > 0 || c_.efficientnet.params.dropout_rate > 0);
    const std::string blocker =
        c_.parallel.offload.enabled()
            ? "an offloaded step (MODEL.FSDP_CONFIG.move_params_to_cpu / move_grads_to_cpu) "
              "waits for its host-side update"
        : draws_masks ? "an EfficientNet's drop connect and dropout draw new masks each step "
                        "(MODEL.TRUNK.EFFICIENT_NETS.drop_connect_rate and its model_version's "
                        "dropout rate)"
                      : "";
    if (c_.cuda_graph == "true") {
      sk::check<ConfigError>(blocker.empty(), "config.MACHINE.CUDA_GRAPH = true, but ", blocker,
                             "; set MACHINE.CUDA_GRAPH to auto (captures where it can) or false");
      return true;
    }
    if (!blocker.empty()) return false;
    // Ranks sharing this GPU in one process meet on the device inside a captured step, their
    // host threads around each replay (comm/local_communicator.hpp): verified on an H200 at
    // 466cc58. SyncBatchNorm's captured exchanges have not run on a GPU yet (test_gpu's
    // "captured ResNet-18 step with SyncBatchNorm" case checks them): auto leaves those steps
    // eager until it has passed there; true captures.
    return ctx_->device().is_cuda() && c_.sync_bn_group == 0;
  }

  // One training step; returns this rank's loss when `read_loss` (else 0). Under
  // MACHINE.CUDA_GRAPH the step reads fixed inputs (the crops staged into them first) and the
  // rate from the device (set before it), and runs through a StepGraph: after two eager steps
  // per key it is captured once and replayed (on a GPU one graph launch per step).
  double step(const MultiCropBatch& batch, double lr, bool read_loss) {
    auto& ctx = *ctx_;
    // Dropout's and drop connect's masks (an EfficientNet's) from a stream keyed by the seed and
    // the rank, this step's range of it by the iteration: a run resumed at this step draws what
    // one that never stopped drew, under any stage. (2^32 Philox blocks a step: B7's dropout at
    // a batch of 4 096 draws 655 360; a step past its range is refused, not overlapped.)
    const auto first_block = static_cast<std::uint64_t>(iteration_) << 32;
    ag::tape(ctx).set_random_stream(
        {ag::random_stream_key(c_.seed, static_cast<std::uint64_t>(comm_->rank())), first_block,
         first_block + (std::uint64_t{1} << 32)});
    if (!graph_) {
      forward_backward(
          [&](std::size_t g) { return sk::from_vector(ctx, batch.groups[g], group_shape(g)); });
      if (c_.loss_scaling)
        sharded_->step(static_cast<float>(lr), scaler_);
      else
        sharded_->step(static_cast<float>(lr));
    } else {
      stage(batch);
      sharded_->set_lr(static_cast<float>(lr));
      // The loss's iteration is host state a replay does not advance: set it around the step.
      const std::int64_t loss_iteration = loss_.iteration();
      graph_->run(graph_key(), [&] {
        forward_backward([&](std::size_t g) { return inputs_[g]; });
        if (c_.loss_scaling)
          sharded_->step(scaler_);  // an overflowing step is skipped on every rank
        else
          sharded_->step();
      });
      loss_.set_iteration(loss_iteration + 1);
    }
    return read_loss ? sk::to_vector<float>(ctx, loss_value_)[0] : 0.0;
  }

  // Forward over every crop group (`input(g)`: group g's crops), the loss (kept in
  // loss_value_), backward, the frozen layers' gradients zeroed.
  template <class Input>
  void forward_backward(Input&& input) {
    auto& ctx = *ctx_;
    sharded_->zero_grad();
    std::vector<ag::Variable> features;
    for (std::size_t g = 0; g < c_.crops.size_crops.size(); ++g)
      features.push_back((*sharded_)(ctx, ag::Variable(input(g))));
    const ag::Variable f = features.size() == 1 ? features[0] : ag::cat(ctx, features);
    SwavHead& head = model_->head();
    const ag::Variable z = head(ctx, f);
    const ag::Variable scores = (*head.prototypes0)(ctx, z);
    const sk::DType compute = c_.parallel.precision.param_dtype;
    const ag::Variable loss = loss_(ctx, *comm_, z, scores, [&](const sk::Tensor& e) {
      ag::NoGradGuard no_grad(ctx);
      return (*head.prototypes0)(ctx, ag::cast(ctx, ag::Variable(e), compute)).data();
    });
    loss_value_ = loss.data();
    if (c_.loss_scaling)
      ag::backward(ctx, loss, scaler_.seed(ctx, loss.data()));
    else
      ag::backward(ctx, loss);
    for (const auto& [name, iterations] : c_.frozen)
      if (iteration_ < iterations) sk::parallel::zero_grad_of(sharded_->engine(), name);
  }

  sk::Shape group_shape(std::size_t g) const {
    const std::int64_t side = c_.crops.size_crops[g];
    return {c_.crops.num_crops[g] * c_.batch_size, c_.in_channels, side, side};
  }

  // The crops into the step's fixed input tensors (made at the first step).
  void stage(const MultiCropBatch& batch) {
    auto& ctx = *ctx_;
    if (inputs_.empty())
      for (std::size_t g = 0; g < batch.groups.size(); ++g)
        inputs_.push_back(sk::empty(ctx, group_shape(g), sk::DType::f32));
    for (std::size_t g = 0; g < batch.groups.size(); ++g) {
      auto& values = batch.groups[g];
      const sk::Tensor host(sk::Storage::borrow(const_cast<float*>(values.data()),
                                                values.size() * sizeof(float), sk::Device::cpu()),
                            group_shape(g), sk::DType::f32);
      sk::copy(ctx, inputs_[g], host);
    }
  }

  // What makes one captured step differ from another: the queue in use or not, hard codes or
  // soft, which layers are still frozen.
  std::string graph_key() const {
    std::string key = loss_.uses_queue() ? "queue" : "no queue";
    key += loss_.iteration() < c_.loss.temp_hard_assignment_iters ? ", hard codes" : "";
    for (const auto& [name, iterations] : c_.frozen)
      if (iteration_ < iterations) key += ", " + name + " frozen";
    return key;
  }

  // --- evaluation ------------------------------------------------------------------------
  // The kNN's features of the first `count` images of `d`, one set per entry of
  // c_.knn_features (feature_eval.hpp: a trunk layer's output, pooled): each rank runs an equal
  // share (padded) and keeps its own rows (Rows::own: the memory bank, sharded over the ranks),
  // or each batch's rows are all-gathered so that every rank has them all (Rows::all: the
  // queries). Forward hooks on the trunk's children copy the layers' outputs out, so the forward
  // is the sharded module's own. Collective (under fsdp every forward is).
  struct FeatureSet {
    std::vector<float> values;  // rows of `dim`
    std::int64_t dim = 0;
    std::int64_t first = 0;  // the image of the first row
  };
  enum class Rows { own, all };
  std::vector<FeatureSet> features(const sk::data::ImageDataset& d, std::int64_t count, Rows rows) {
    auto& ctx = *ctx_;
    const int world = comm_->size();
    const std::int64_t share = query_share(count, world);
    const std::int64_t first = comm_->rank() * share;  // (past the end on a padded share)
    // The rows this rank keeps: [kept_first, kept_first + kept).
    const auto [own_first, own_last] = share_range(count, world, comm_->rank());
    const std::int64_t kept_first = rows == Rows::all ? 0 : own_first;
    const std::int64_t kept = rows == Rows::all ? count : own_last - own_first;
    const auto& pools = c_.knn_features;
    std::vector<sk::Tensor> outputs(pools.size());
    HookGuard hooks;
    for (std::size_t k = 0; k < pools.size(); ++k)
      hooks.add(trunk_child(pools[k].module(model_->trunk->stage_names())),
                [&outputs, &ctx, k](sk::nn::Module&, const ag::Variable&, const ag::Variable& y) {
                  // (a trunk kept in channel blocks: the layer's [N, C, H, W] values)
                  outputs[k] = sk::has_channel_block_form(y.data())
                                   ? sk::from_channel_blocks(ctx, y.data())
                                   : y.data();
                });
    // DATA.TEST.TRANSFORMS' images (EvalTransform); by default whole images at the large crops'
    // side, normalised like the crops. One side for every image: a batch is one tensor.
    const int crop_side = c_.crops.size_crops[0];
    const std::int64_t side = c_.eval_images.side(d.image(0).rows, d.image(0).cols, crop_side);
    std::vector<FeatureSet> sets(pools.size());
    std::vector<float> pooled;
    sk::autograd::NoGradGuard no_grad(ctx);
    for (std::int64_t b0 = 0; b0 < share; b0 += c_.test_batch_size) {
      const std::int64_t n = std::min(c_.test_batch_size, share - b0);
      const std::int64_t image_size = d.channels * side * side;
      std::vector<float> pixels(static_cast<std::size_t>(n * image_size));
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t image = std::min(first + b0 + i, count - 1);  // pad with the last
        const sk::data::ImageView view = d.image(image);
        const std::int64_t view_side = c_.eval_images.side(view.rows, view.cols, crop_side);
        sk::check(view_side == side, "DATA.TEST.TRANSFORMS turn a ", view.rows, " x ", view.cols,
                  " test image into ", view_side, " pixels a side and a ", d.image(0).rows, " x ",
                  d.image(0).cols, " one into ", side,
                  "; add {name: CenterCrop, size: N} so that every image has one size");
        eval_image(c_.crops, c_.eval_images, view, static_cast<int>(side),
                   pixels.data() + i * image_size);
      }
      const sk::Tensor x = sk::from_vector(ctx, pixels, {n, d.channels, side, side});
      (void)(*sharded_)(ctx, ag::Variable(x));
      for (std::size_t k = 0; k < pools.size(); ++k) {
        const sk::Tensor& y = outputs[k];
        sk::check(y.defined() && y.dim() == 4 && y.size(0) == n, "kNN features: ", pools[k].layer,
                  " gave ", sk::tensor_text(y, "no output"), "; expected [", n, ", C, H, W]");
        const auto host = sk::to_vector<float>(ctx, sk::cast(ctx, y, sk::DType::f32));
        const std::int64_t dim = pools[k].features(y.size(1), y.size(2), y.size(3));
        if (sets[k].dim == 0) {
          sets[k].dim = dim;
          sets[k].first = kept_first;
          sets[k].values.resize(static_cast<std::size_t>(
              (rows == Rows::all ? world * share : std::max(kept, share)) * dim));
        }
        pooled.resize(static_cast<std::size_t>(n * dim));
        pools[k].apply(host.data(), n, y.size(1), y.size(2), y.size(3), pooled.data());
        if (rows == Rows::own) {
          std::copy(pooled.begin(), pooled.end(), sets[k].values.begin() + b0 * dim);
          continue;
        }
        // Every rank's rows of this batch, gathered now: the buffers stay a batch in size
        // (all of a set at once would be the run's peak with spatial features).
        const sk::Tensor local = sk::from_vector(ctx, pooled, {n * dim});
        const sk::Tensor all = sk::empty(ctx, {world * n * dim}, sk::DType::f32);
        comm_->all_gather(local, all).wait();
        const auto rows = sk::to_vector<float>(ctx, all);
        for (int r = 0; r < world; ++r)
          std::copy(rows.begin() + r * n * dim, rows.begin() + (r + 1) * n * dim,
                    sets[k].values.begin() + (r * share + b0) * dim);
      }
    }
    for (auto& set : sets) {
      set.values.resize(static_cast<std::size_t>(kept * set.dim));
      set.values.shrink_to_fit();  // (a padded share's rows: the bank's memory is what is kept)
    }
    return sets;
  }

  // Every rank's rows of a Rows::own set of `count` images on rank 0, in image order (empty on
  // the other ranks): each rank's rows are broadcast from it a batch at a time, so that no rank
  // holds more than a batch of another's, nor the whole set on a device.
  std::vector<float> on_rank0(const FeatureSet& own, std::int64_t count) {
    const int world = comm_->size(), rank = comm_->rank();
    const std::int64_t dim = own.dim;
    std::vector<float> all;
    if (rank == 0) all.reserve(static_cast<std::size_t>(count * dim));
    for (int r = 0; r < world; ++r) {
      const auto [first, last] = share_range(count, world, r);
      const std::int64_t rows = last - first;
      for (std::int64_t b0 = 0; b0 < rows; b0 += c_.test_batch_size) {
        const std::int64_t n = std::min(c_.test_batch_size, rows - b0);
        const auto begin = own.values.begin() + b0 * dim;
        if (r == 0) {  // rank 0's own rows: nothing to move
          if (rank == 0) all.insert(all.end(), begin, begin + n * dim);
          continue;
        }
        std::vector<float> piece(static_cast<std::size_t>(n * dim));
        if (rank == r) std::copy(begin, begin + n * dim, piece.begin());
        const sk::Tensor t = sk::from_vector(*ctx_, piece, {n * dim});
        comm_->broadcast(t, r).wait();
        if (rank != 0) continue;
        piece = sk::to_vector<float>(*ctx_, t);
        all.insert(all.end(), piece.begin(), piece.end());
      }
    }
    return all;
  }

  // Removes the hooks it registered when it goes (an exception included).
  class HookGuard {
   public:
    HookGuard() = default;
    HookGuard(const HookGuard&) = delete;
    HookGuard& operator=(const HookGuard&) = delete;
    ~HookGuard() {
      for (auto& [module, id] : hooks_) module->remove_hook(id);
    }
    void add(sk::nn::Module& module, sk::nn::ForwardHook hook) {
      hooks_.emplace_back(&module, module.register_forward_hook(std::move(hook)));
    }

   private:
    std::vector<std::pair<sk::nn::Module*, sk::nn::HookId>> hooks_;
  };

  sk::nn::Module& trunk_child(const std::string& name) {
    for (auto& [child, module] : model_->trunk->children())
      if (child == name) return *module;
    throw sk::InvalidArgument("the trunk has no child " + name);
  }

  // Weighted kNN top-1 on the test set with the memory bank, for each feature set (the first
  // is the returned headline, every set's figure goes to by_layer); the queries are split over
  // the ranks and the counts summed. Also fills the raw-pixel figure once.
  enum class Evaluation { initial, periodic, final };
  // kNN accuracy of each feature set (the first returned), recorded in the report's table as
  // `label`'s row.
  double evaluate(RunReport& report, Evaluation when, nlohmann::json& by_layer,
                  const std::string& label) {
    const auto started = std::chrono::steady_clock::now();
    struct Timed {  // the evaluation's wall time, for the live status's ETA
      std::chrono::steady_clock::time_point started;
      double* seconds;
      ~Timed() {
        *seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      }
    } timed{started, &evaluation_seconds_};
    clear_status();
    const bool final_eval = when == Evaluation::final;
    const auto& d = *data_;
    const std::vector<std::int32_t> bank_labels(d.train.labels.begin(),
                                                d.train.labels.begin() + d.bank_size);
    // The raw pixels' figure first: it is ready in a fraction of a second, the network's
    // features of the bank and test images take a forward pass over them all.
    if (report.raw_knn < 0) {
      // The pixels as they are, normalised; images of varying sizes (and a test set of another
      // size) are all resized to the large crop size first.
      const bool as_stored = raw_pixels_as_stored(d);
      const std::int64_t dim = raw_pixel_dim(d, c_.crops.size_crops[0]);
      // Images [first, last) of a split as normalised rows of floats.
      auto raw = [&](const sk::data::ImageDataset& set, std::int64_t first, std::int64_t last) {
        std::vector<float> f(static_cast<std::size_t>((last - first) * dim));
        for (std::int64_t i = first; i < last; ++i) {
          float* out = f.data() + (i - first) * dim;
          if (!as_stored) {
            whole_image(c_.crops, set.image(i), c_.crops.size_crops[0], out);
            continue;
          }
          const std::uint8_t* in = set.image(i).pixels;
          for (std::int64_t k = 0; k < dim; ++k) {
            const auto ch = static_cast<std::size_t>(k % set.channels);
            out[k] =
                c_.crops.mean.empty()  // (no Normalize: the values in [0, 1])
                    ? static_cast<float>(in[k] / 255.0)
                    : static_cast<float>((in[k] / 255.0 - c_.crops.mean[ch]) / c_.crops.std[ch]);
          }
        }
        l2_normalize_rows(f, dim);
        return f;
      };
      // The bank once per process (its ranks share it), this rank's queries alone.
      const auto bank_pixels = d.raw_bank->get([&] { return raw(d.train, 0, d.bank_size); });
      const auto [first, last] = query_range();
      report.raw_knn =
          knn_accuracy(*bank_pixels, bank_labels, raw(d.test, first, last), dim, first);
      say("raw-pixel kNN (k %d, sigma %g, memory bank %lld images): %.2f%%\n", c_.knn_topk,
          c_.knn_sigma, static_cast<long long>(d.bank_size), 100 * report.raw_knn);
    }
    model_->eval();
    sk::parallel::broadcast_module_buffers(*ctx_, *model_, *comm_);  // rank 0's statistics
    // The bank's features sharded over the ranks, the test images' whole on each.
    auto bank = features(d.train, d.bank_size, Rows::own);
    auto test = features(d.test, d.test.count, Rows::all);
    model_->train();
    std::vector<double> knn(bank.size());
    for (std::size_t k = 0; k < bank.size(); ++k) {
      l2_normalize_rows(bank[k].values, bank[k].dim);
      l2_normalize_rows(test[k].values, test[k].dim);
      knn[k] = sharded_knn_accuracy(bank[k], bank_labels, test[k]);
      say("%s kNN top-1 on %lld test images, %s (%lld features): %.2f%% (raw pixels %.2f%%)\n",
          when == Evaluation::initial ? "initial network:" : "trunk features:",
          static_cast<long long>(d.test.count), c_.knn_features[k].text().c_str(),
          static_cast<long long>(bank[k].dim), 100 * knn[k], 100 * report.raw_knn);
      by_layer[c_.knn_features[k].layer] = knn[k];
    }
    report.knn_table.push_back({label, knn});
    // The table's columns are named by layer (the lines above give each pooling) unless two
    // feature sets read one layer.
    if (report.knn_features.empty()) {
      std::set<std::string> layers;
      for (const auto& f : c_.knn_features) layers.insert(f.layer);
      const bool by_name = layers.size() == c_.knn_features.size();
      for (const auto& f : c_.knn_features)
        report.knn_features.push_back(by_name ? f.layer : f.text());
    }
    if (final_eval && !c_.export_dir.empty()) {
      // Rank 0 writes; every rank sends it its share of the bank.
      const bool writes = comm_->rank() == 0;
      sk::Context host;
      auto labels = [&](const std::vector<std::int32_t>& l) {
        return sk::from_vector(host, std::vector<std::int64_t>(l.begin(), l.end()),
                               {static_cast<std::int64_t>(l.size())});
      };
      // The headline set as train_features / test_features; any further set with its layer's
      // name appended (train_features_res5, ...).
      std::vector<sk::checkpoint::NamedBytes> tensors;
      if (writes)
        tensors = {sk::checkpoint::host_bytes(host, "train_labels", labels(bank_labels)),
                   sk::checkpoint::host_bytes(host, "test_labels", labels(d.test.labels))};
      for (std::size_t k = 0; k < bank.size(); ++k) {
        const std::vector<float> whole = on_rank0(bank[k], d.bank_size);
        if (!writes) continue;
        const std::string suffix = k == 0 ? "" : "_" + c_.knn_features[k].layer;
        tensors.push_back(
            sk::checkpoint::host_bytes(host, "train_features" + suffix,
                                       sk::from_vector(host, whole, {d.bank_size, bank[k].dim})));
        tensors.push_back(sk::checkpoint::host_bytes(
            host, "test_features" + suffix,
            sk::from_vector(host, test[k].values, {d.test.count, test[k].dim})));
      }
      if (writes) {
        std::filesystem::create_directories(c_.export_dir);
        sk::checkpoint::save_safetensors(c_.export_dir + "/embeddings.safetensors", tensors);
        say("embeddings written to %s/embeddings.safetensors\n", c_.export_dir.c_str());
      }
    }
    return knn[0];
  }

  // The test images this rank queries: [first, last).
  std::pair<std::int64_t, std::int64_t> query_range() const {
    return share_range(data_->test.count, comm_->size(), comm_->rank());
  }

  // The share of the test set's queries this rank answers, summed over the ranks: the accuracy.
  // `queries` holds the queries from `queries_first` on.
  double knn_accuracy(const std::vector<float>& bank, const std::vector<std::int32_t>& labels,
                      const std::vector<float>& queries, std::int64_t dim,
                      std::int64_t queries_first = 0) {
    const std::int64_t n = data_->test.count;
    const auto [first, last] = query_range();
    std::vector<double> correct{double(knn_correct(
        bank, labels, queries, data_->test.labels, dim, first, last, c_.knn_topk, c_.knn_sigma,
        ctx_->cpu_pool(),
        static_cast<int>(std::max(data_->train.num_classes(), data_->test.num_classes())),
        queries_first))};
    all_reduce_host(*ctx_, *comm_, std::span<double>(correct), sk::comm::ReduceOp::sum);
    return correct[0] / double(n);
  }

  // kNN accuracy over a memory bank sharded over the ranks (each holds `bank`'s rows, from
  // image bank.first on) for the test images' features (each rank holds them all): every rank
  // lists each query's k nearest among its own rows, an all-to-all hands each rank the lists of
  // the queries it answers from every shard, and the merged lists vote. The merged lists are the
  // whole bank's (knn.hpp), so the figure does not depend on how the bank is split; a rank holds
  // a share of the bank and every query instead of the whole bank.
  double sharded_knn_accuracy(const FeatureSet& bank, const std::vector<std::int32_t>& labels,
                              const FeatureSet& queries) {
    const std::int64_t n = data_->test.count;
    const int world = comm_->size();
    const int k = c_.knn_topk;
    Neighbours mine = knn_nearest(bank.values, bank.first, queries.values.data(), n, queries.dim, k,
                                  ctx_->cpu_pool());
    const auto [first, last] = query_range();
    const std::int64_t rows = last - first;
    Neighbours merged;
    if (world == 1) {
      merged = std::move(mine);
    } else {
      // Every shard's lists of this rank's queries: world blocks of rows x k entries, moved as
      // bytes (the collectives move floating point and bytes, no integers).
      auto exchange = [&]<class T>(const std::vector<T>& lists) {
        std::vector<std::size_t> counts;
        for (int r = 0; r < world; ++r) {
          const auto [q0, q1] = share_range(n, world, r);
          counts.push_back(static_cast<std::size_t>((q1 - q0) * k) * sizeof(T));
        }
        std::vector<std::uint8_t> bytes(lists.size() * sizeof(T));
        std::memcpy(bytes.data(), lists.data(), bytes.size());
        const sk::Tensor send =
            sk::from_vector(*ctx_, bytes, {static_cast<std::int64_t>(bytes.size())});
        const std::int64_t received = world * rows * k * static_cast<std::int64_t>(sizeof(T));
        const sk::Tensor recv =
            sk::empty(*ctx_, {std::max<std::int64_t>(1, received)}, sk::DType::u8);
        comm_->all_to_all_v(send, recv, counts).wait();
        bytes = sk::to_vector<std::uint8_t>(*ctx_, recv);
        std::vector<T> back(static_cast<std::size_t>(world * rows * k));
        std::memcpy(back.data(), bytes.data(), back.size() * sizeof(T));
        return back;
      };
      // (one after the other, in the same order on every rank: they are collectives)
      const auto similarity = exchange(mine.similarity);
      const auto index = exchange(mine.index);
      merged = knn_merge(similarity, index, world, rows, k, k);
    }
    const int classes =
        static_cast<int>(std::max(data_->train.num_classes(), data_->test.num_classes()));
    std::vector<double> correct{double(
        knn_votes_correct(merged, labels, data_->test.labels, first, c_.knn_sigma, classes))};
    all_reduce_host(*ctx_, *comm_, std::span<double>(correct), sk::comm::ReduceOp::sum);
    return correct[0] / double(n);
  }

  // --- checkpoints -----------------------------------------------------------------------
  using Position = sk::data::TrainingPosition;

  std::optional<std::string> resume_point() {
    const auto latest = sk::checkpoint::latest_checkpoint(c_.checkpoint_dir);
    if (latest && !c_.auto_resume && !c_.overwrite_existing)
      sk::fail<ConfigError>("config.CHECKPOINT.DIR = ", c_.checkpoint_dir,
                            " holds a checkpoint, and AUTO_RESUME is False; set "
                            "CHECKPOINT.AUTO_RESUME=True to continue it, "
                            "CHECKPOINT.OVERWRITE_EXISTING=True to start afresh over it, or "
                            "choose another CHECKPOINT.DIR");
    if (!c_.auto_resume) return std::nullopt;
    return latest;
  }

  sk::parallel::TrainingState state() {
    auto s = sharded_->training_state();
    if (c_.loss_scaling) s.scaler = &scaler_;
    return s;
  }

  std::string queue_file(const std::string& folder) const {
    char name[64];
    std::snprintf(name, sizeof name, "/queue-%05d-of-%05d.safetensors", comm_->rank(),
                  comm_->size());
    return folder + name;
  }

  void save(std::int64_t epoch, std::int64_t batch) {
    sk::checkpoint::CheckpointOptions o;
    o.layout = c_.consolidated ? sk::checkpoint::CheckpointLayout::full
                               : sk::checkpoint::CheckpointLayout::sharded;
    o.metadata = {{"swav.iteration", std::to_string(iteration_)},
                  {"swav.epoch", std::to_string(epoch)},
                  {"swav.batch_in_epoch", std::to_string(batch)},
                  {"swav.images_per_step", std::to_string(images_per_step())},
                  {"swav.loss_iteration", std::to_string(loss_.iteration())}};
    auto s = state();
    const auto folder = sk::checkpoint::save_step_checkpoint(
        c_.checkpoint_dir, iteration_, s, o, [&](const std::string& dir) {
          if (c_.loss.local_queue_length == 0) return;
          sk::checkpoint::save_safetensors(
              queue_file(dir), {sk::checkpoint::host_bytes(*ctx_, "queue", loss_.queue())});
        });
    say("checkpoint: %s (iteration %lld)\n", folder.c_str(), static_cast<long long>(iteration_));
  }

  std::int64_t images_per_step() const { return c_.batch_size * comm_->size(); }

  Position load(const std::string& folder, std::int64_t per_epoch) {
    auto s = state();
    const auto loaded = sk::checkpoint::load_checkpoint(folder, s);
    auto number = [&](const char* key) {
      const auto it = loaded.metadata.find(key);
      sk::check<sk::IoError>(it != loaded.metadata.end(), "checkpoint '", folder,
                             "' lacks the SwAV trainer's '", key,
                             "' entry; it was not written by this trainer");
      return std::stoll(it->second);
    };
    const Position written{number("swav.iteration"), number("swav.epoch"),
                           number("swav.batch_in_epoch")};
    // (Checkpoints from before the entry: the batch per rank taken as this run's.)
    const std::int64_t written_images =
        loaded.metadata.count("swav.images_per_step") != 0
            ? number("swav.images_per_step")
            : c_.batch_size * static_cast<std::int64_t>(loaded.world_size);
    const Position p =
        sk::data::converted_position(written, written_images, images_per_step(), per_epoch);
    loss_.set_iteration(number("swav.loss_iteration") - written.iteration + p.iteration);
    if (written_images != images_per_step())
      say("the checkpoint's iteration %lld at %lld images a step is iteration %lld at this run's "
          "%lld (the same epoch, and the images it took so far)\n",
          static_cast<long long>(written.iteration), static_cast<long long>(written_images),
          static_cast<long long>(p.iteration), static_cast<long long>(images_per_step()));
    if (c_.loss.local_queue_length > 0) {
      const std::string file = queue_file(folder);
      if (std::filesystem::exists(file)) {
        const auto contents = sk::checkpoint::load_safetensors(file);
        const auto& q = contents.tensors.at(0);
        sk::check<sk::IoError>(q.bytes.size() == static_cast<std::size_t>(loss_.queue().nbytes()),
                               "'", file,
                               "' holds a queue of another length; resume with the queue settings "
                               "the checkpoint was written with");
        auto bytes = q.bytes;  // borrowed by the host tensor the upload reads
        const sk::Tensor host(sk::Storage::borrow(bytes.data(), bytes.size(), sk::Device::cpu()),
                              loss_.queue().shape(), sk::DType::f32);
        sk::copy(*ctx_, loss_.queue(), host);
      } else {
        sk::check<sk::IoError>(!loss_.uses_queue(), "checkpoint '", folder,
                               "' has no queue for rank ", comm_->rank(), " of ", comm_->size(),
                               " (written by another world size?); the SwAV queue is per rank, as "
                               "in VISSL: resume on the world size it was written with");
      }
    }
    say("resumed from %s: iteration %lld, epoch %lld, batch %lld (written by %d ranks, %s)\n",
        folder.c_str(), static_cast<long long>(p.iteration), static_cast<long long>(p.epoch + 1),
        static_cast<long long>(p.batch), loaded.world_size, loaded.stage.c_str());
    return p;
  }

  // --- reporting -------------------------------------------------------------------------
  double mean_over_ranks(double v) {
    std::vector<double> x{v};
    all_reduce_host(*ctx_, *comm_, std::span<double>(x), sk::comm::ReduceOp::sum);
    return x[0] / comm_->size();
  }
  std::int64_t max_over_ranks(std::int64_t v) {
    std::vector<double> x{double(v)};
    all_reduce_host(*ctx_, *comm_, std::span<double>(x), sk::comm::ReduceOp::max);
    return static_cast<std::int64_t>(x[0]);
  }
  static std::string duration(double seconds) {
    char text[32];
    const auto s = static_cast<long long>(seconds + 0.5);
    std::snprintf(text, sizeof text, "%lldm%02llds", s / 60, s % 60);
    return text;
  }
  template <class... Args>
  void say(const char* format, Args... args) {
    if (log_ == nullptr) return;
    clear_status();
    std::fprintf(log_, format, args...);
    std::fflush(log_);
  }
  // The live status: on a terminal, one line rewritten in place a few times a second -- a bar
  // over the run's steps, the step, images/s and the time left for the whole run (the steps
  // at the rate so far, plus the evaluations still to come at the last one's duration). The
  // progress lines and everything else print above it; a log file or pipe gets no status line.
  void show_status(std::int64_t epoch, std::int64_t last, std::int64_t per_epoch,
                   std::chrono::steady_clock::time_point begin, std::int64_t first_iteration) {
    if (!live_) return;
    const auto now = std::chrono::steady_clock::now();
    if (status_shown_ && now - last_status_ < std::chrono::milliseconds(250)) return;
    last_status_ = now;
    const double elapsed = std::chrono::duration<double>(now - begin).count();
    const double done = double(iteration_ - first_iteration);
    const double left_steps = elapsed / std::max(done, 1.0) * double(last - iteration_);
    // Evaluations to come: every FREQUENCY epochs before the last, and the final one.
    std::int64_t evaluations = c_.test_model ? 1 : 0;
    if (c_.test_model && c_.knn_every_epochs > 0)
      for (std::int64_t e = epoch + 1; e < c_.num_epochs && e * per_epoch < last; ++e)
        evaluations += e % c_.knn_every_epochs == 0;
    const double eta = left_steps + double(evaluations) * evaluation_seconds_;
    const double fraction = double(iteration_) / double(std::max<std::int64_t>(last, 1));
    constexpr int kWidth = 24;
    char bar[kWidth + 1];
    for (int i = 0; i < kWidth; ++i) bar[i] = i < int(fraction * kWidth + 0.5) ? '#' : '.';
    bar[kWidth] = '\0';
    const double rate = done * double(c_.batch_size * comm_->size()) / std::max(elapsed, 1e-9);
    std::fprintf(log_, "\r[%s] %3.0f%%  epoch %lld/%d  step %lld/%lld  %.0f img/s  %s left \033[K",
                 bar, 100 * fraction, static_cast<long long>(epoch + 1), c_.num_epochs,
                 static_cast<long long>(iteration_), static_cast<long long>(last), rate,
                 duration(eta).c_str());
    std::fflush(log_);
    status_shown_ = true;
  }
  void clear_status() {
    if (!status_shown_) return;
    std::fprintf(log_, "\r\033[K");
    status_shown_ = false;
  }
  // A metrics line with each feature set's kNN figure (knn_by_layer) when there are several.
  nlohmann::json knn_metrics(nlohmann::json line, const nlohmann::json& by_layer) const {
    if (c_.knn_features.size() > 1) line["knn_by_layer"] = by_layer;
    return line;
  }
  void log_metrics(nlohmann::json line) {
    if (comm_->rank() != 0 || c_.metrics_path.empty()) return;
    const auto parent = std::filesystem::path(c_.metrics_path).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent);
    std::ofstream(c_.metrics_path, std::ios::app) << line.dump() << "\n";
  }
  // FNV-1a over every parameter's f32 value (masters' compute copies), in state-dict order.
  std::uint64_t fingerprint() {
    std::uint64_t h = 1469598103934665603ull;
    for (const auto& [name, t] : sharded_->state_dict(false)) {
      if (!sk::is_floating(t.dtype())) continue;
      const auto v = sk::to_vector<float>(*ctx_, sk::cast(*ctx_, t, sk::DType::f32));
      const auto* bytes = reinterpret_cast<const unsigned char*>(v.data());
      for (std::size_t i = 0; i < v.size() * sizeof(float); ++i)
        h = (h ^ bytes[i]) * 1099511628211ull;
    }
    return h;
  }

  SwavConfig c_;
  sk::Context* ctx_;
  sk::comm::Communicator* comm_;
  const Datasets* data_;
  std::FILE* log_;
  bool live_ = false;  // the log is a terminal: show the live status line
  bool status_shown_ = false;
  std::chrono::steady_clock::time_point last_status_{};
  double evaluation_seconds_ = 0;  // the last kNN evaluation's wall time
  // Under fsdp the model is built without parameter memory (sk::DeferredParameters) and the
  // wrap makes each rank's shards only, from rank 0's recipes: a rank never holds the whole
  // model, nor a whole unit (VISSL's FSDP wraps the layers while it builds them). The same
  // values bit for bit.
  static std::shared_ptr<SwavModel> build_model(sk::Context& ctx, const SwavConfig& c) {
    std::optional<sk::DeferredParameters> deferred;
    if (builds_deferred(c)) deferred.emplace(ctx);
    return std::make_shared<SwavModel>(ctx, c);
  }

  std::shared_ptr<SwavModel> model_;
  sk::parallel::MemoryPlan plan_;               // planned before the states existed
  std::int64_t blocks_ = 0, nested_units_ = 0;  // fsdp: the units below the root
  std::unique_ptr<sk::parallel::ShardedModule> sharded_;
  SwavLoss loss_;
  sk::optim::DynamicLossScaler scaler_;
  std::unique_ptr<sk::data::StatefulDistributedSampler> sampler_;
  std::unique_ptr<MultiCropLoader> loader_;
  std::int64_t iteration_ = 0;
  std::optional<sk::StepGraph> graph_;  // MACHINE.CUDA_GRAPH
  std::vector<sk::Tensor> inputs_;      // the captured step's inputs, one per crop group
  sk::Tensor loss_value_;               // this rank's loss of the last step
};

}  // namespace swav
