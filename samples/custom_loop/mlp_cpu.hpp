// A multi-layer perceptron with hand-written forward and backward on the CPU (Eigen), the way a
// user of shardkit writes their own model: parameters and gradients are views into flat
// buffers, and backward reports each gradient the moment it is final. mlp_gpu.cuh is the same
// model on a GPU behind the same interface; CpuDevice (below) and GpuDevice bundle each MLP with
// what the training loop (train.hpp) needs on that device.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include <shardkit/comm/comm.hpp>
#include <shardkit/ops/cpu_backend.hpp>

#include "mlp.hpp"

namespace custom_loop {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using ConstMatrixMap = Eigen::Map<const Matrix>;
using VectorMap = Eigen::Map<Eigen::RowVectorXf>;

class MlpCpu {
 public:
  MlpCpu(sk::Context& /*ctx*/, std::vector<std::int64_t> widths) : widths_(std::move(widths)) {}

  // The batch [B, widths[0]] the next forward(params) reads: the loader's, held by reference
  // (the loop refills the same Batch before each step, as a captured step needs).
  void stage(const Batch& batch) {
    check_batch(widths_, batch);
    staged_ = &batch;
  }

  // Forward on the staged batch; keeps the activations for backward, the mean cross-entropy
  // loss (loss()) and the number of correct predictions (correct()).
  template <MlpParams Params>
  void forward(Params& params) {
    sk::check<sk::StateError>(staged_ != nullptr, "MlpCpu::forward: no batch staged");
    const Batch& batch = *staged_;
    const auto layers = widths_.size() - 1;
    activations_.assign(layers + 1, Matrix());
    activations_[0] = ConstMatrixMap(batch.pixels.data(), batch.rows, batch.features);
    for (std::size_t l = 0; l < layers; ++l) {
      params.enter(l, Pass::forward);
      // (Held while the maps use them: under mixed precision they are f32 copies.)
      const sk::Tensor weight = params.param(2 * l), bias = params.param(2 * l + 1);
      ConstMatrixMap w(weight.template data<float>(), widths_[l + 1], widths_[l]);
      Eigen::Map<const Eigen::RowVectorXf> b(bias.template data<float>(), widths_[l + 1]);
      Matrix z = activations_[l] * w.transpose();
      z.rowwise() += b;
      params.leave(l, Pass::forward);
      if (l + 1 < layers) z = z.cwiseMax(0.0f);  // ReLU on hidden layers
      activations_[l + 1] = std::move(z);
    }
    // Softmax cross-entropy, stable form; keep softmax - onehot as the logits' gradient.
    const auto& labels = batch.labels;
    const Matrix& logits = activations_[layers];
    const auto rows = logits.rows();
    logit_grad_.resize(rows, logits.cols());
    double loss = 0;
    int hits = 0;
    for (Eigen::Index r = 0; r < rows; ++r) {
      Eigen::Index best;
      const float max = logits.row(r).maxCoeff(&best);
      const Eigen::RowVectorXf shifted = logits.row(r).array() - max;
      const float log_sum = std::log(shifted.array().exp().sum());
      loss += log_sum - shifted(labels[static_cast<std::size_t>(r)]);
      logit_grad_.row(r) = (shifted.array() - log_sum).exp().matrix();
      logit_grad_(r, labels[static_cast<std::size_t>(r)]) -= 1.0f;
      hits += best == labels[static_cast<std::size_t>(r)];
    }
    logit_grad_ /= static_cast<float>(rows);
    loss_ = static_cast<float>(loss / static_cast<double>(rows));
    correct_ = hits;
  }

  template <MlpParams Params>
  void forward(Params& params, const Batch& batch) {
    stage(batch);
    forward(params);
  }

  float loss() const { return loss_; }
  int correct() const { return correct_; }

  // Backward from the last forward: adds each parameter's gradient into grad_of(i) and calls
  // ready(i) as soon as gradient i is final -- last layer first, as autograd would.
  template <MlpParams Params>
  void backward(Params& params, const std::function<sk::Tensor(std::size_t)>& grad_of,
                const std::function<void(std::size_t)>& ready) {
    const auto layers = widths_.size() - 1;
    Matrix delta = logit_grad_;
    for (std::size_t l = layers; l-- > 0;) {
      params.enter(l, Pass::backward);
      const sk::Tensor weight_grad = grad_of(2 * l);
      MatrixMap dw(weight_grad.data<float>(), widths_[l + 1], widths_[l]);
      dw.noalias() += delta.transpose() * activations_[l];
      ready(2 * l);
      const sk::Tensor bias_grad = grad_of(2 * l + 1);
      VectorMap db(bias_grad.data<float>(), widths_[l + 1]);
      db += delta.colwise().sum();
      ready(2 * l + 1);
      if (l == 0) {
        params.leave(l, Pass::backward);
        break;
      }
      const sk::Tensor weight = params.param(2 * l);
      ConstMatrixMap w(weight.template data<float>(), widths_[l + 1], widths_[l]);
      Matrix previous = delta * w;
      params.leave(l, Pass::backward);
      previous.array() *= (activations_[l].array() > 0.0f).cast<float>();  // ReLU'
      delta = std::move(previous);
    }
  }

 private:
  std::vector<std::int64_t> widths_;
  const Batch* staged_ = nullptr;
  std::vector<Matrix> activations_;
  Matrix logit_grad_;
  float loss_ = 0;
  int correct_ = 0;
};

// The CPU for the training loop: the optimizer backend, the model, and how ranks get their
// contexts (threads of this process, or one process per rank under mpirun, over MPI).
struct CpuDevice {
  static constexpr const char* name = "cpu";
  using Mlp = MlpCpu;
  static sk::comm::RunRanksOptions run_options() { return {}; }
  static sk::ContextOptions mpi_context(const sk::comm::LaunchInfo& launch, std::uint64_t seed) {
    return {.rank = launch.rank, .seed = seed};
  }
};

}  // namespace custom_loop
