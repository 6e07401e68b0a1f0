// A multi-layer perceptron with hand-written forward and backward on the CPU (Eigen), the way a
// user of shardkit writes their own model: parameters and gradients are views into flat
// buffers, and backward reports each gradient the moment it is final.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <functional>
#include <vector>

#include <shardkit/shardkit.hpp>
#include <shardkit/shard/shard.hpp>

namespace custom_loop {

namespace sk = shardkit;

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using MatrixMap = Eigen::Map<Matrix>;
using ConstMatrixMap = Eigen::Map<const Matrix>;
using VectorMap = Eigen::Map<Eigen::RowVectorXf>;

// Parameters of an MLP with the given widths (e.g. {784, 1024, 1024, 10}), in PyTorch's
// naming and registration order: fc1.weight, fc1.bias, fc2.weight, ...
inline std::vector<sk::shard::ParamSpec> mlp_param_specs(const std::vector<std::int64_t>& widths) {
  std::vector<sk::shard::ParamSpec> specs;
  for (std::size_t l = 0; l + 1 < widths.size(); ++l) {
    const std::string prefix = "fc" + std::to_string(l + 1);
    specs.push_back({prefix + ".weight", {widths[l + 1], widths[l]}});
    specs.push_back({prefix + ".bias", {widths[l + 1]}});
  }
  return specs;
}

// torch.nn.Linear's default initialisation: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
inline void init_mlp(sk::Context& ctx, const sk::shard::FlatBuffer& params) {
  for (std::size_t i = 0; i < params.size(); i += 2) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(params[i].size(1)));
    sk::uniform_(ctx, params[i], -bound, bound);
    sk::uniform_(ctx, params[i + 1], -bound, bound);
  }
}

class MlpCpu {
 public:
  explicit MlpCpu(std::vector<std::int64_t> widths) : widths_(std::move(widths)) {}

  // Forward on a batch x [B, widths[0]]; keeps the activations for backward. Returns the mean
  // cross-entropy loss and counts correct predictions into `correct`.
  float forward(const sk::shard::FlatBuffer& params, const Matrix& x,
                const std::vector<std::uint8_t>& labels, int* correct = nullptr) {
    const auto layers = widths_.size() - 1;
    activations_.assign(layers + 1, Matrix());
    activations_[0] = x;
    for (std::size_t l = 0; l < layers; ++l) {
      ConstMatrixMap w(params[2 * l].data<float>(), widths_[l + 1], widths_[l]);
      Eigen::Map<const Eigen::RowVectorXf> b(params[2 * l + 1].data<float>(), widths_[l + 1]);
      Matrix z = activations_[l] * w.transpose();
      z.rowwise() += b;
      if (l + 1 < layers) z = z.cwiseMax(0.0f);  // ReLU on hidden layers
      activations_[l + 1] = std::move(z);
    }
    // Softmax cross-entropy, stable form; keep softmax - onehot as the logits' gradient.
    const Matrix& logits = activations_[layers];
    const auto batch = logits.rows();
    logit_grad_.resize(batch, logits.cols());
    double loss = 0;
    int hits = 0;
    for (Eigen::Index r = 0; r < batch; ++r) {
      Eigen::Index best;
      const float max = logits.row(r).maxCoeff(&best);
      const Eigen::RowVectorXf shifted = logits.row(r).array() - max;
      const float log_sum = std::log(shifted.array().exp().sum());
      loss += log_sum - shifted(labels[static_cast<std::size_t>(r)]);
      logit_grad_.row(r) = (shifted.array() - log_sum).exp().matrix();
      logit_grad_(r, labels[static_cast<std::size_t>(r)]) -= 1.0f;
      hits += best == labels[static_cast<std::size_t>(r)];
    }
    logit_grad_ /= static_cast<float>(batch);
    if (correct) *correct += hits;
    return static_cast<float>(loss / static_cast<double>(batch));
  }

  // Backward from the last forward: adds each parameter's gradient into grad_of(i) and calls
  // ready(i) as soon as gradient i is final -- last layer first, as autograd would.
  void backward(const sk::shard::FlatBuffer& params,
                const std::function<sk::Tensor(std::size_t)>& grad_of,
                const std::function<void(std::size_t)>& ready) {
    const auto layers = widths_.size() - 1;
    Matrix delta = logit_grad_;
    for (std::size_t l = layers; l-- > 0;) {
      const sk::Tensor weight_grad = grad_of(2 * l);
      MatrixMap dw(weight_grad.data<float>(), widths_[l + 1], widths_[l]);
      dw.noalias() += delta.transpose() * activations_[l];
      ready(2 * l);
      const sk::Tensor bias_grad = grad_of(2 * l + 1);
      VectorMap db(bias_grad.data<float>(), widths_[l + 1]);
      db += delta.colwise().sum();
      ready(2 * l + 1);
      if (l == 0) break;
      ConstMatrixMap w(params[2 * l].data<float>(), widths_[l + 1], widths_[l]);
      Matrix previous = delta * w;
      previous.array() *= (activations_[l].array() > 0.0f).cast<float>();  // ReLU'
      delta = std::move(previous);
    }
  }

 private:
  std::vector<std::int64_t> widths_;
  std::vector<Matrix> activations_;
  Matrix logit_grad_;
};

}  // namespace custom_loop
