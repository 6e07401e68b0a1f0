// Writes the fixtures of torch_interop.py into OUT_DIR:
//  - model.safetensors, io.safetensors: a small-stem ResNet-18 (10 classes) whose batch-norm
//    statistics were moved by one training forward, saved with checkpoint::save_module, plus an
//    input batch and our eval-mode logits for it. PyTorch then loads the model and must agree.
//  - mixed.safetensors: the initial weights of a narrower ResNet-18 ("init.<name>"), a few
//    training batches, and the losses of our training steps on them in f32 and in bf16 mixed
//    precision (ShardedModule, DDP at world size 1, SGD with momentum and weight decay).
//    PyTorch repeats the steps in f32 and under bf16 autocast from the same weights. The
//    trained parameters (f32 masters) are the full checkpoints ours_f32/ and ours_bf16/.
//  - regnet.safetensors, regnet_io.safetensors: a RegNetY AnyNet in ClassyVision's names, an
//    input, our eval-mode logits and the input's gradient for an upstream one; PyTorch builds
//    ClassyVision's network, loads ours strictly and must agree on both.
//  - efficientnet.safetensors, efficientnet_io.safetensors: a narrow EfficientNet in
//    ClassyVision's names (VISSL's feature blocks), an input, our eval-mode features and the
//    gradients for an upstream one; PyTorch builds the network, loads ours strictly, must agree.
//  - ours_sharded/, sharded_io.safetensors: the narrow ResNet-18 after a few SGD steps under
//    FSDP on two ranks, as a sharded checkpoint, and its eval-mode logits for the first batch
//    (for the checkpoint tool's round trip through PyTorch, tests/io/check_ckpt_tool.py).
#include <cstdio>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "shardkit/checkpoint/module_state.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

// Inside a namespace of its own: this file is compiled in one unit with the tests of its
// executable (a unity build), whose anonymous namespaces would otherwise meet this one's.
namespace torch_fixture {

namespace {

constexpr int kSteps = 8;
constexpr std::int64_t kBatch = 16;
constexpr float kLr = 0.01f;

std::shared_ptr<sk::nn::ResNet> narrow_resnet(sk::Context& ctx) {
  sk::nn::ResNetOptions o;
  o.num_classes = 10;
  o.small_image_stem = true;
  o.base_channels = 16;
  auto net = sk::nn::resnet18(ctx, o);
  sk::Context host({.seed = 2024});
  for (auto& p : net->parameters()) {
    auto values = sk::empty(host, p.shape(), sk::DType::f32);
    sk::uniform_(host, values, -0.1, 0.1);
    sk::copy(ctx, p.data(), values);
  }
  return net;
}

// SGD with momentum 0.9 and weight decay 1e-4 (PyTorch's side repeats it).
sk::optim::OptimizerConfig sgd_config() {
  sk::optim::OptimizerConfig config;
  config.sgd.momentum = 0.9f;
  config.sgd.weight_decay = 1e-4f;
  return config;
}

// Per-step losses of kSteps SGD steps on `images` / `labels` with the compute copy in `dtype`.
// Saves a full checkpoint of the result (f32 masters under model.safetensors) into `out_dir`.
std::vector<float> train_losses(const sk::Tensor& images, const sk::Tensor& labels, sk::DType dtype,
                                const std::string& out_dir) {
  std::vector<float> losses;
  sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = narrow_resnet(ctx);
    sk::parallel::ParallelOptions options;
    options.stage = sk::parallel::Stage::ddp;
    options.precision = sk::parallel::MixedPrecision::of(dtype);
    sk::parallel::ShardedModule model(ctx, comm, net, sgd_config(), options);
    for (std::int64_t s = 0; s < kSteps; ++s) {
      model.zero_grad();
      auto x = sk::empty(ctx, {kBatch, 3, 16, 16}, sk::DType::f32);
      sk::copy(ctx, x, images.select(0, s));
      auto y = sk::empty(ctx, {kBatch}, sk::DType::i64);
      sk::copy(ctx, y, labels.select(0, s));
      auto loss = ag::cross_entropy(ctx, model(ctx, ag::Variable(x)), y);
      losses.push_back(sk::to_vector<float>(ctx, loss.data())[0]);
      ag::backward(ctx, loss);
      model.step(kLr);
    }
    sk::checkpoint::save_checkpoint(out_dir, model.training_state());
  });
  return losses;
}

// A sharded FSDP checkpoint of the narrow ResNet-18 after kSteps / 2 steps on two ranks (both
// see the same batches), and the trained model's eval-mode logits for the first batch.
void write_sharded_fixture(const sk::Tensor& images, const sk::Tensor& labels,
                           const std::string& dir) {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = narrow_resnet(ctx);
    sk::parallel::ParallelOptions options;
    options.stage = sk::parallel::Stage::fsdp;
    sk::parallel::ShardedModule model(ctx, comm, net, sgd_config(), options);
    auto batch = [&](std::int64_t s) {
      auto x = sk::empty(ctx, {kBatch, 3, 16, 16}, sk::DType::f32);
      sk::copy(ctx, x, images.select(0, s));
      return x;
    };
    for (std::int64_t s = 0; s < kSteps / 2; ++s) {
      model.zero_grad();
      auto y = sk::empty(ctx, {kBatch}, sk::DType::i64);
      sk::copy(ctx, y, labels.select(0, s));
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, ag::Variable(batch(s))), y));
      model.step(kLr);
    }
    sk::checkpoint::CheckpointOptions save;
    save.layout = sk::checkpoint::CheckpointLayout::sharded;
    sk::checkpoint::save_checkpoint(dir + "/ours_sharded", model.training_state(), save);
    net->eval();
    sk::Tensor logits;
    {
      ag::NoGradGuard no_grad(ctx);
      logits = model(ctx, ag::Variable(batch(0))).data();
    }
    if (comm.rank() == 0)
      sk::checkpoint::save_safetensors(dir + "/sharded_io.safetensors",
                                       {sk::checkpoint::host_bytes(ctx, "images", batch(0)),
                                        sk::checkpoint::host_bytes(ctx, "logits", logits)});
  });
}

void write_mixed_fixture(const std::string& dir) {
  sk::Context ctx({.seed = 12});
  auto images = sk::empty(ctx, {kSteps, kBatch, 3, 16, 16}, sk::DType::f32);
  sk::normal_(ctx, images, 0, 1);
  std::vector<std::int64_t> label_values;
  for (std::int64_t i = 0; i < kSteps * kBatch; ++i) label_values.push_back((i * 7 + 3) % 10);
  auto labels = sk::from_vector(ctx, label_values, {kSteps, kBatch});
  // A learnable task: each image is noise plus its class's pattern, so the gradients carry a
  // signal that bf16 rounding perturbs rather than noise it swamps.
  {
    auto patterns = sk::empty(ctx, {10, 3 * 16 * 16}, sk::DType::f32);
    sk::normal_(ctx, patterns, 0, 1);
    const auto p = sk::to_vector<float>(ctx, patterns);
    auto x = sk::to_vector<float>(ctx, images);
    const std::size_t per_image = 3 * 16 * 16;
    for (std::size_t i = 0; i < label_values.size(); ++i)
      for (std::size_t j = 0; j < per_image; ++j)
        x[i * per_image + j] += p[static_cast<std::size_t>(label_values[i]) * per_image + j];
    images = sk::from_vector(ctx, x, {kSteps, kBatch, 3, 16, 16});
  }
  const auto f32 = train_losses(images, labels, sk::DType::f32, dir + "/ours_f32");
  const auto bf16 = train_losses(images, labels, sk::DType::bf16, dir + "/ours_bf16");
  write_sharded_fixture(images, labels, dir);
  std::vector<sk::checkpoint::NamedBytes> out;
  auto net = narrow_resnet(ctx);
  for (const auto& [name, t] : net->state_dict())
    out.push_back(sk::checkpoint::host_bytes(ctx, "init." + name, t));
  out.push_back(sk::checkpoint::host_bytes(ctx, "images", images));
  out.push_back(sk::checkpoint::host_bytes(ctx, "labels", labels));
  out.push_back(sk::checkpoint::host_bytes(ctx, "loss_f32", sk::from_vector(ctx, f32, {kSteps})));
  out.push_back(sk::checkpoint::host_bytes(ctx, "loss_bf16", sk::from_vector(ctx, bf16, {kSteps})));
  out.push_back(
      sk::checkpoint::host_bytes(ctx, "lr_momentum_weight_decay",
                                 sk::from_vector(ctx, std::vector<float>{kLr, 0.9f, 1e-4f}, {3})));
  sk::checkpoint::save_safetensors(dir + "/mixed.safetensors", out);
}

// <name>.safetensors, <name>_io.safetensors: `net` after one training forward of a batch of
// 4 x 3 x 20 x 20 images moved its batch-norm statistics, the batch, our eval-mode output for it
// (`output`), an upstream gradient and the gradients it gives the input and every parameter
// ("grad.<name>").
void write_network_fixture(const std::string& dir, const std::string& name, sk::Context& ctx,
                           sk::nn::Module& net, const char* output) {
  auto images = sk::empty(ctx, {4, 3, 20, 20}, sk::DType::f32);
  sk::normal_(ctx, images, 0, 1);
  net.train();
  (void)net(ctx, ag::Variable(images));
  net.eval();
  ag::Variable x(images, true);
  const ag::Variable y = net(ctx, x);
  auto upstream = sk::empty(ctx, y.shape(), sk::DType::f32);
  sk::normal_(ctx, upstream, 0, 1);
  ag::backward(ctx, y, upstream);
  sk::checkpoint::save_module(dir + "/" + name + ".safetensors", ctx, net);
  std::vector<sk::checkpoint::NamedBytes> io{
      sk::checkpoint::host_bytes(ctx, "images", images),
      sk::checkpoint::host_bytes(ctx, output, y.data()),
      sk::checkpoint::host_bytes(ctx, "upstream", upstream),
      sk::checkpoint::host_bytes(ctx, "grad_images", x.grad())};
  for (const auto& [parameter, p] : net.named_parameters())
    io.push_back(sk::checkpoint::host_bytes(ctx, "grad." + parameter, p.grad()));
  sk::checkpoint::save_safetensors(dir + "/" + name + "_io.safetensors", io);
}

// An AnyNet of RegNetY blocks (every stem-to-head part: projections, grouped 3 x 3
// convolutions, squeeze-and-excitation, a 10-class fc): its logits.
void write_regnet_fixture(const std::string& dir) {
  sk::Context ctx({.seed = 12});
  sk::nn::RegNetOptions o;
  o.stem_width = 8;
  o.num_classes = 10;
  auto net = sk::nn::anynet(ctx, {{8, 2, 1, 4, 1.0}, {16, 2, 2, 8, 1.0}, {24, 1, 1, 8, 1.0}}, o);
  write_network_fixture(dir, "regnet", ctx, *net, "logits");
}

// A narrow EfficientNet (B0's blocks at width 0.25 and depth 0.5: expansions, 3 x 3 and 5 x 5
// depthwise convolutions, strides, squeeze-and-excitation, skips; its training forward draws
// drop connect's and dropout's masks): its features.
void write_efficientnet_fixture(const std::string& dir) {
  sk::Context ctx({.seed = 13});
  sk::nn::EfficientNetOptions o;
  o.params = {0.25, 0.5, 224, 0.2};
  o.bn_momentum = 1.0;  // (the running statistics are the training batch's: eval-mode values of
                        // the batch's scale, not shrunk by statistics that barely moved)
  auto net = sk::nn::efficientnet(ctx, o);
  write_network_fixture(dir, "efficientnet", ctx, *net, "features");
}

}  // namespace

int fixture_main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: test_autograd --fixture torch OUT_DIR\n");
    return 2;
  }
  try {
    const std::string dir = argv[1];
    sk::Context ctx({.seed = 11});
    sk::nn::ResNetOptions o;
    o.num_classes = 10;
    o.small_image_stem = true;
    auto net = sk::nn::resnet18(ctx, o);
    auto images = sk::empty(ctx, {4, 3, 16, 16}, sk::DType::f32);
    sk::normal_(ctx, images, 0, 1);
    net->train();
    (void)(*net)(ctx, ag::Variable(images));  // running statistics and batch counters move
    net->eval();
    sk::Tensor logits;
    {
      ag::NoGradGuard no_grad(ctx);
      logits = (*net)(ctx, ag::Variable(images)).data();
    }
    sk::checkpoint::save_module(dir + "/model.safetensors", ctx, *net);
    sk::checkpoint::save_safetensors(dir + "/io.safetensors",
                                     {sk::checkpoint::host_bytes(ctx, "images", images),
                                      sk::checkpoint::host_bytes(ctx, "logits", logits)});
    write_mixed_fixture(dir);
    write_regnet_fixture(dir);
    write_efficientnet_fixture(dir);
    std::printf(
        "wrote %s/model.safetensors (%zu tensors), io.safetensors, mixed.safetensors, "
        "regnet.safetensors, regnet_io.safetensors, efficientnet.safetensors, "
        "efficientnet_io.safetensors\n",
        dir.c_str(), net->state_dict().size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch fixture: %s\n", e.what());
    return 1;
  }
}

const shardkit::testing::FixtureRegistration registration("torch", fixture_main);

}  // namespace torch_fixture
