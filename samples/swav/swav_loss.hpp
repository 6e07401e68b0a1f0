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

// A sum or maximum over the ranks of a tensor on the context's device, in place and ordered on
// the context's stream (the host does not wait for it on a GPU).
inline void all_reduce_on_stream(sk::comm::Communicator& comm, const sk::Tensor& values,
                                 sk::comm::ReduceOp op) {
  if (comm.size() == 1) return;
  comm.all_reduce(values, op).wait_on_stream();
}

class SwavLoss {
 public:
  // `embedding_dim` and `num_prototypes` size the queue, kept on the context's device; `seed`
  // and the rank draw its random start (VISSL starts it uniform, not zero).
  SwavLoss(sk::Context& ctx, SwavLossConfig config, std::int64_t embedding_dim,
           std::int64_t num_prototypes, int rank, std::uint64_t seed)
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
      std::vector<float> start(config_.crops_for_assign.size() *
                               static_cast<std::size_t>(config_.local_queue_length * dim_));
      const sk::RandomSpec spec{sk::RandomKind::uniform, -s, s,
                                seed * 1000003ull + static_cast<std::uint64_t>(rank), 0};
      for (std::size_t i = 0; i < start.size(); ++i)
        start[i] = static_cast<float>(spec.value_at(i));
      queue_ = sk::from_vector(ctx, start, {queue_rows(), dim_});
    }
  }

  const SwavLossConfig& config() const { return config_; }
  std::int64_t iteration() const { return iteration_; }
  void set_iteration(std::int64_t iteration) { iteration_ = iteration; }
  bool uses_queue() const {
    return config_.local_queue_length > 0 && iteration_ >= config_.queue_start_iter;
  }
  // The embedding queue, [crops_for_assign x local_queue_length, dim] f32 on the context's
  // device, newest first within each assignment crop's block (undefined without a queue): part
  // of the training state (checkpoints save it per rank; copy into it to restore one).
  const sk::Tensor& queue() const { return queue_; }
  std::int64_t queue_rows() const {
    return static_cast<std::int64_t>(config_.crops_for_assign.size()) * config_.local_queue_length;
  }

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
              "swav_loss: scores ", sk::shape_text(scores.shape()), " are not [", v,
              " crops x batch, ", prototypes_, " prototypes]");
    const std::int64_t b = scores.size(0) / v, k = prototypes_;
    const bool queue = uses_queue();
    const std::int64_t lq = queue ? config_.local_queue_length : 0;
    const sk::Tensor all_scores = sk::cast(ctx, scores.data(), sk::DType::f32);
    const sk::Tensor queue_scores = queue ? scores_of_queue(ctx, score_queue) : sk::Tensor();

    // Targets of every crop row: the sum of the codes that predict it (crop p's rows get the
    // codes of every assignment crop other than p), summed in f64. Cross-entropy is linear in
    // its target, so one pass over all rows computes sum_i sum_{p != c_i} CE(scores_p, q_i).
    const sk::Tensor targets = sk::zeros(ctx, {v * b, k}, sk::DType::f64);
    SinkhornOptions options{config_.epsilon, config_.num_iters, config_.use_double_precision,
                            iteration_ < config_.temp_hard_assignment_iters};
    for (std::size_t i = 0; i < config_.crops_for_assign.size(); ++i) {
      const int c = config_.crops_for_assign[i];
      sk::Tensor block = all_scores.slice(0, c * b, (c + 1) * b);
      if (queue) {  // the queue's rows come after the batch's, as in VISSL
        sk::Tensor widened = sk::empty(ctx, {b + lq, k}, sk::DType::f32);
        sk::copy(ctx, widened.slice(0, 0, b), block);
        sk::copy(ctx, widened.slice(0, b, b + lq),
                 queue_scores.slice(0, static_cast<std::int64_t>(i) * lq,
                                    static_cast<std::int64_t>(i + 1) * lq));
        block = widened;
      }
      const sk::Tensor codes =
          sk::cast(ctx,
                   distributed_sinkhorn(ctx, block, b, comm.size(), options,
                                        [&](const sk::Tensor& t, sk::comm::ReduceOp op) {
                                          all_reduce_on_stream(comm, t, op);
                                        }),
                   sk::DType::f64);
      for (int p = 0; p < v; ++p)
        if (p != c) sk::add_(ctx, targets.slice(0, p * b, (p + 1) * b), codes);
    }

    // Log-softmax in f32 for 16-bit scores (apex O1 keeps it f32), f64 when asked.
    const sk::DType dtype = config_.use_double_precision ? sk::DType::f64 : sk::DType::f32;
    const sk::Tensor target =
        config_.use_double_precision ? targets : sk::cast(ctx, targets, dtype);
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
  // The queue's scores, [crops_for_assign x lq, K] f32.
  sk::Tensor scores_of_queue(sk::Context& ctx, const QueueScorer& score_queue) const {
    const sk::Tensor scores = score_queue(queue_);
    sk::check(scores.shape() == sk::Shape{queue_rows(), prototypes_}, "swav_loss: queue scores ",
              sk::shape_text(scores.shape()), " are not [", queue_rows(), ", ", prototypes_, "]");
    return sk::contiguous(ctx, sk::cast(ctx, scores, sk::DType::f32));
  }

  // Newest first: shift each assignment crop's block down by the batch and put the batch's
  // embeddings on top (through a temporary: the two ranges overlap).
  void push_queue(sk::Context& ctx, const ag::Variable& embedding, std::int64_t b) {
    sk::check(embedding.dim() == 2 && embedding.size(1) == dim_ &&
                  embedding.size(0) == config_.num_crops * b,
              "swav_loss: embedding ", sk::shape_text(embedding.shape()), " is not [",
              config_.num_crops * b, ", ", dim_, "]");
    const std::int64_t lq = config_.local_queue_length, keep = std::max<std::int64_t>(lq - b, 0);
    const std::int64_t fresh = std::min(b, lq);
    for (std::size_t i = 0; i < config_.crops_for_assign.size(); ++i) {
      const std::int64_t at = static_cast<std::int64_t>(i) * lq;
      if (keep > 0) {
        const sk::Tensor kept = sk::clone(ctx, queue_.slice(0, at, at + keep));
        sk::copy(ctx, queue_.slice(0, at + fresh, at + lq), kept);
      }
      const std::int64_t from = config_.crops_for_assign[i] * b;
      sk::copy(ctx, queue_.slice(0, at, at + fresh), embedding.data().slice(0, from, from + fresh));
    }
  }

  SwavLossConfig config_;
  std::int64_t dim_, prototypes_;
  std::int64_t iteration_ = 0;
  sk::Tensor queue_;
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
