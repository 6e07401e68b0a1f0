// Writes the fixture of torch_interop.py: a small-stem ResNet-18 (10 classes) whose batch-norm
// statistics were moved by one training forward, saved with io::save_module, plus an input
// batch and our eval-mode logits for it. PyTorch then loads the model and must agree.
#include <cstdio>
#include <string>

#include "shardkit/io/module_checkpoint.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torch_fixture OUT_DIR\n");
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
    sk::io::save_module(dir + "/model.safetensors", ctx, *net);
    sk::io::save_safetensors(dir + "/io.safetensors", {sk::io::host_bytes(ctx, "images", images),
                                                       sk::io::host_bytes(ctx, "logits", logits)});
    std::printf("wrote %s/model.safetensors (%zu tensors) and io.safetensors\n", dir.c_str(),
                net->state_dict().size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_fixture: %s\n", e.what());
    return 1;
  }
}
