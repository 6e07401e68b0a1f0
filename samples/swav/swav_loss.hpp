// SwAV's swapped-prediction loss with VISSL's semantics (docs/swav.md, "Loss" and "Queue"):
// codes of the assignment crops by distributed Sinkhorn-Knopp (no gradient), every other crop
// predicts them through a softmax of its scores at temperature tau; an optional queue of past
// embeddings, scored with the current prototypes, widens the Sinkhorn batch.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/philox.hpp"
#include "sinkhorn.hpp"

namespace swav {

namespace ag = shardkit::autograd;

struct SwavLossConfig {
  int num_crops = 2;                        // crops per image, all of them predicted
  std::vector<int> crops_for_assign{0, 1};  // the crops whose codes are targets
  double temperature = 0.1;
  double epsilon = 0.05;
  int num_iters = 3;
  bool use_double_precision = false;
  int temp_hard_assignment_iters = 0;  // one-hot codes while iteration < this
  // Queue: local length per rank (VISSL's queue_length rounded down to a multiple of the global
  // batch, divided by the world size); 0 for none. Used from iteration start_iter on.
  std::int64_t local_queue_length = 0;
  std::int64_t queue_start_iter = 0;
};

// VISSL's rounding of the global queue length: down to a multiple of the global batch.
inline std::int64_t local_queue_length(std::int64_t queue_length, std::int64_t batch_per_rank,
                                       int world_size) {
  const std::int64_t global_batch = batch_per_rank * world_size;
  return (queue_length - queue_length % global_batch) / world_size;
}

// Sums or maxima over the ranks of a host vector, staged through a tensor on the context's
// device (NCCL reduces device memory only).
template <class T>
void all_reduce_host(sk::Context& ctx, sk::comm::Communicator& comm, std::span<T> values,
                     sk::comm::ReduceOp op) {
  if (comm.size() == 1) return;
  sk::Tensor t = sk::from_vector(ctx, std::vector<T>(values.begin(), values.end()),
                                 {static_cast<std::int64_t>(values.size())});
  comm.all_reduce(t, op).wait();
  const auto back = sk::to_vector<T>(ctx, t);
  std::copy(back.begin(), back.end(), values.begin());
}

class SwavLoss {
 public:
  // `embedding_dim` and `num_prototypes` size the queue; `seed` and the rank draw its random
  // start (VISSL starts it uniform, not zero).
  SwavLoss(SwavLossConfig config, std::int64_t embedding_dim, std::int64_t num_prototypes, int rank,
           std::uint64_t seed)
      : config_(std::move(config)), dim_(embedding_dim), prototypes_(num_prototypes) {
    sk::check(config_.num_crops >= 2, "swav_loss: num_crops ", config_.num_crops,
              " must be at least 2 (one crop assigns, the others predict)");
    sk::check(!config_.crops_for_assign.empty(),
              "swav_loss: crops_for_assign is empty; use e.g. [0, 1] (the large crops)");
    for (int c : config_.crops_for_assign)
      sk::check(c >= 0 && c < config_.num_crops, "swav_loss: crops_for_assign holds crop ", c,
                ", outside [0, ", config_.num_crops, ")");
    sk::check(config_.temperature > 0, "swav_loss: temperature ", config_.temperature,
              " must be positive (VISSL's default is 0.1)");
    sk::check(config_.local_queue_length >= 0 && config_.queue_start_iter >= 0,
              "swav_loss: queue length ", config_.local_queue_length, " and start_iter ",
              config_.queue_start_iter, " must not be negative");
    if (config_.local_queue_length > 0) {
      // uniform(-s, s) with s = 1 / sqrt(dim / 3), VISSL's start of the embedding queue.
      const double s = 1.0 / std::sqrt(static_cast<double>(dim_) / 3.0);
      queue_.resize(config_.crops_for_assign.size() *
                    static_cast<std::size_t>(config_.local_queue_length * dim_));
      const sk::RandomSpec spec{sk::RandomKind::uniform, -s, s,
                                seed * 1000003ull + static_cast<std::uint64_t>(rank), 0};
      for (std::size_t i = 0; i < queue_.size(); ++i)
        queue_[i] = static_cast<float>(spec.value_at(i));
    }
  }

  const SwavLossConfig& config() const { return config_; }
  std::int64_t iteration() const { return iteration_; }
  void set_iteration(std::int64_t iteration) { iteration_ = iteration; }
  bool uses_queue() const {
    return config_.local_queue_length > 0 && iteration_ >= config_.queue_start_iter;
  }
  // The embedding queue, [crops_for_assign][local_queue_length][dim], newest first: part of the
  // training state (checkpoints save it per rank).
  std::vector<float>& queue() { return queue_; }

  // Scores of queued embeddings ([rows, D] f32 on the context) with the current prototypes
  // ([rows, K]); the trainer runs the prototypes layer without gradient, as VISSL's
  // compute_queue_scores does.
  using QueueScorer = std::function<sk::Tensor(const sk::Tensor&)>;

  // The loss of this rank's batch. `embedding` [V*B, D] (normalised, crops stacked in crop
  // order), `scores` [V*B, K] = embedding x prototypes^T. Advances the iteration and, when the
  // queue is in use, pushes this batch's assignment-crop embeddings into it.
  ag::Variable operator()(sk::Context& ctx, sk::comm::Communicator& comm,
                          const ag::Variable& embedding, const ag::Variable& scores,
                          const QueueScorer& score_queue) {
    const int v = config_.num_crops;
    sk::check(scores.dim() == 2 && scores.size(0) % v == 0 && scores.size(1) == prototypes_,
              "swav_loss: scores ", sk::shape_str(scores.shape()), " are not [", v,
              " crops x batch, ", prototypes_, " prototypes]");
    const std::int64_t b = scores.size(0) / v, k = prototypes_;
    const bool queue = uses_queue();
    const std::int64_t lq = queue ? config_.local_queue_length : 0;
    const auto host_scores =
        sk::to_vector<float>(ctx, sk::cast(ctx, scores.data(), sk::DType::f32));
    std::vector<float> queue_scores;
    if (queue) queue_scores = scores_of_queue(ctx, score_queue);

    // Targets of every crop row: the sum of the codes that predict it (crop p's rows get the
    // codes of every assignment crop other than p). Cross-entropy is linear in its target, so
    // one pass over all rows computes sum_i sum_{p != c_i} CE(scores_p, q_i).
    std::vector<double> targets(static_cast<std::size_t>(v * b * k), 0.0);
    SinkhornOptions options{config_.epsilon, config_.num_iters, config_.use_double_precision,
                            iteration_ < config_.temp_hard_assignment_iters};
    for (std::size_t i = 0; i < config_.crops_for_assign.size(); ++i) {
      const int c = config_.crops_for_assign[i];
      std::vector<float> block(host_scores.begin() + c * b * k,
                               host_scores.begin() + (c + 1) * b * k);
      if (queue)  // the queue's rows come after the batch's, as in VISSL
        block.insert(block.end(), queue_scores.begin() + static_cast<std::ptrdiff_t>(i * lq * k),
                     queue_scores.begin() + static_cast<std::ptrdiff_t>((i + 1) * lq * k));
      const auto codes = distributed_sinkhorn(
          std::span<const float>(block), b + lq, k, comm.size(), options,
          [&](auto values, sk::comm::ReduceOp op) { all_reduce_host(ctx, comm, values, op); });
      for (int p = 0; p < v; ++p) {
        if (p == c) continue;
        for (std::int64_t e = 0; e < b * k; ++e)
          targets[static_cast<std::size_t>(p * b * k + e)] += codes[static_cast<std::size_t>(e)];
      }
    }

    // Log-softmax in f32 for 16-bit scores (apex O1 keeps it f32), f64 when asked.
    const sk::DType dtype = config_.use_double_precision ? sk::DType::f64 : sk::DType::f32;
    sk::Tensor target =
        config_.use_double_precision
            ? sk::from_vector(ctx, targets, {v * b, k})
            : sk::from_vector(ctx, std::vector<float>(targets.begin(), targets.end()), {v * b, k});
    const auto logits = ag::scale(ctx, ag::cast(ctx, scores, dtype), 1.0 / config_.temperature);
    const auto ce = ag::cross_entropy(ctx, logits, target);  // mean over the V*B rows
    // Mean over rows -> per crop pair: x V; average over the V-1 predicting crops and the
    // assignment crops.
    const double weight =
        static_cast<double>(v) /
        (static_cast<double>(v - 1) * static_cast<double>(config_.crops_for_assign.size()));
    auto loss = ag::scale(ctx, ag::cast(ctx, ce, sk::DType::f32), weight);
    ++iteration_;
    if (queue) push_queue(ctx, embedding, b);
    return loss;
  }

 private:
  // The queue's scores, [crops_for_assign][lq][K].
  std::vector<float> scores_of_queue(sk::Context& ctx, const QueueScorer& score_queue) const {
    const std::int64_t rows =
        static_cast<std::int64_t>(config_.crops_for_assign.size()) * config_.local_queue_length;
    const sk::Tensor scores = score_queue(sk::from_vector(ctx, queue_, {rows, dim_}));
    sk::check(scores.shape() == sk::Shape{rows, prototypes_}, "swav_loss: queue scores ",
              sk::shape_str(scores.shape()), " are not [", rows, ", ", prototypes_, "]");
    return sk::to_vector<float>(ctx, sk::cast(ctx, scores, sk::DType::f32));
  }

  // Newest first: shift the queue down by the batch and put the batch's embeddings on top.
  void push_queue(sk::Context& ctx, const ag::Variable& embedding, std::int64_t b) {
    sk::check(embedding.dim() == 2 && embedding.size(1) == dim_ &&
                  embedding.size(0) == config_.num_crops * b,
              "swav_loss: embedding ", sk::shape_str(embedding.shape()), " is not [",
              config_.num_crops * b, ", ", dim_, "]");
    const auto e = sk::to_vector<float>(ctx, sk::cast(ctx, embedding.data(), sk::DType::f32));
    const std::int64_t lq = config_.local_queue_length, keep = std::max<std::int64_t>(lq - b, 0);
    for (std::size_t i = 0; i < config_.crops_for_assign.size(); ++i) {
      float* q = queue_.data() + static_cast<std::ptrdiff_t>(i) * lq * dim_;
      std::copy_backward(q, q + keep * dim_, q + lq * dim_);
      const std::int64_t fresh = std::min(b, lq);
      const float* src = e.data() + config_.crops_for_assign[i] * b * dim_;
      std::copy(src, src + fresh * dim_, q);
    }
  }

  SwavLossConfig config_;
  std::int64_t dim_, prototypes_;
  std::int64_t iteration_ = 0;
  std::vector<float> queue_;
};

// A queue scorer for prototypes held as a weight variable [K, D]: the bias-free linear layer,
// run without gradient.
inline SwavLoss::QueueScorer prototype_scorer(sk::Context& ctx, const ag::Variable& prototypes) {
  return [&ctx, prototypes](const sk::Tensor& embeddings) {
    ag::NoGradGuard no_grad(ctx);
    return ag::linear(ctx, ag::Variable(embeddings), prototypes).data();
  };
}

}  // namespace swav
