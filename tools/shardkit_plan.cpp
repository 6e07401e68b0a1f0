// shardkit-plan: per-rank memory of a training run before it runs (parallel/memory_plan.hpp).
//
//   shardkit-plan --model resnet50 --world-size 64 [--group-size 8] [--stage all|ddp|oss|sdp|fsdp]
//                 [--optimizer larc_sgd|sgd|adamw] [--precision f32|bf16|f16]
//                 [--batch 32] [--image-size 224] [--device-memory-gib 80]
//                 [--offload none|optimizer|params|nvme|nvme-params] [--offload-chunk 4194304]
//                 [--wrap-threshold 1000000]
//   shardkit-plan --model weights.safetensors ...   (every tensor a trainable parameter)
//
// Prints, per stage, the bytes of the most loaded rank by category (MiB; "layer grads": the
// largest layer's parameter gradients, whole in the backward before they reach the buckets),
// the bytes each rank
// sends per step inside its shard group and across groups (MiB; without --group-size the group
// is the world, and on more than one node all of it crosses nodes), with --offload what moves to
// the host (MiB per rank) and the bytes between host and device per step (params: fsdp's shards
// too; other stages offload the optimizer only; nvme: the master and optimizer state in files,
// nvme-params: fsdp's shards there too, the host column then the RAM a step streams them
// through, the disk columns their size and the bytes read and written per step, the gathers'
// reads included), and with --device-memory-gib
// the largest batch per rank that fits. For a named network the activations are profiled on this
// CPU (a forward and backward at batch 2, 4, 8, ... until the growth per sample settles, f32, with
// and without activation checkpointing: an upper bound under mixed precision); FSDP wraps each
// residual block as a unit, and with --wrap-threshold N each convolution of at least N parameters
// inside a block as a unit nested in the block's (VISSL's AUTO_WRAP_THRESHOLD). Errors are one
// line on
// stderr and exit status 1 (2 for bad arguments).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "shardkit/autograd/autograd.hpp"
#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/nn/nn.hpp"
#include "shardkit/parallel/memory_plan.hpp"

namespace sk = shardkit;
namespace par = shardkit::parallel;

namespace {

std::string mib(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", bytes / (1024.0 * 1024.0));
  return text;
}

// The 1000-class network `model` names: torchvision's ResNet and ResNeXt names (resnet18 ...
// resnet152, resnext50_32x4d, ...), ClassyVision's RegNets (regnet_y_400mf ... regnet_y_256gf,
// regnet_x_400mf ...) or its EfficientNets (efficientnet_b0 ... efficientnet_b7); nullptr when
// `model` is no such name (then it is a file). Images of at most 64 pixels get a ResNet's and a
// RegNet's CIFAR-style stem (stride 1, no max-pool).
std::shared_ptr<sk::nn::Trunk> build_network(sk::Context& ctx, const std::string& model,
                                             std::int64_t image_size) {
  sk::nn::ResNetOptions o;
  o.small_image_stem = image_size <= 64;
  if (auto resnet = sk::nn::resnet_named(ctx, model, o)) return resnet;
  if (model.rfind("efficientnet_b", 0) == 0) {  // (with its classifier, as torchvision's)
    sk::nn::EfficientNetOptions e;
    const std::string version = "B" + model.substr(14);
    sk::check(sk::nn::efficientnet_named_params(version, e.params), "--model ", model,
              ": not an EfficientNet this tool knows; use efficientnet_b0 ... efficientnet_b7");
    auto net = sk::nn::efficientnet(ctx, e);
    net->add("fc", std::make_shared<sk::nn::Linear>(ctx, net->feature_dim, 1000));
    return net;
  }
  sk::nn::RegNetParams params;
  sk::nn::RegNetOptions r;
  if (!sk::nn::regnet_named_params(model, params, r.use_se)) return nullptr;
  r.num_classes = 1000;
  r.stem =
      image_size <= 64 ? sk::nn::RegNetStem::res_stem_cifar : sk::nn::RegNetStem::simple_stem_in;
  return sk::nn::regnet(ctx, params, r);
}

// Peak activation bytes of one f32 forward + backward of the network at `batch`.
std::int64_t activation_peak(const std::string& model, std::int64_t image_size, int segments,
                             std::int64_t batch) {
  sk::Context ctx({.seed = 1, .cpu_threads = 0});
  auto net = build_network(ctx, model, image_size);
  net->set_checkpoint_segments(segments);
  auto x = sk::empty(ctx, {batch, 3, image_size, image_size}, sk::DType::f32,
                     sk::MemoryCategory::activations);
  sk::normal_(ctx, x, 0.0, 1.0);
  std::vector<std::int64_t> labels(static_cast<std::size_t>(batch));
  for (std::int64_t i = 0; i < batch; ++i) labels[static_cast<std::size_t>(i)] = i % 1000;
  const auto y = sk::from_vector(ctx, labels, {batch});
  ctx.memory_stats().reset_peak();
  sk::autograd::backward(
      ctx, sk::autograd::cross_entropy(ctx, (*net)(ctx, sk::autograd::Variable(x)), y));
  return ctx.memory_stats().snapshot().peak_of(sk::MemoryCategory::activations);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"shardkit-plan: per-rank memory of a sharded training run, before it runs"};
  std::string model, stage_name = "all", optimizer = "larc_sgd", precision = "f32";
  std::string offload = "none";
  int world = 1, group = 0, reshard_group = 0;
  std::int64_t offload_chunk = par::OffloadOptions{}.chunk_numel;
  std::int64_t wrap_threshold = 0;
  bool quantized_weights = false, quantized_grads = false, error_feedback = false;
  std::int64_t batch = 32, image_size = 224;
  double device_gib = 0;
  app.add_option("--model", model,
                 "a torchvision name (resnet18 ... resnet152, resnext50_32x4d, "
                 "resnext101_32x8d, ...), a ClassyVision RegNet (regnet_y_400mf ... "
                 "regnet_y_256gf, regnet_x_400mf ...) or EfficientNet (efficientnet_b0 ... "
                 "efficientnet_b7), or a .safetensors file of parameters")
      ->required();
  app.add_option("--world-size", world, "ranks")->check(CLI::PositiveNumber);
  app.add_option("--group-size", group, "hybrid sharding: ranks per shard group (a node)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--stage", stage_name, "all, ddp, oss, sdp or fsdp");
  app.add_option("--optimizer", optimizer, "sgd, larc_sgd or adamw (SGD with momentum 0.9)");
  app.add_option("--precision", precision, "f32, bf16 or f16 (f32 masters, f32 reduction)");
  app.add_option("--batch", batch, "samples per rank")->check(CLI::PositiveNumber);
  app.add_option("--image-size", image_size, "the network's input side (<= 64: small-image stem)")
      ->check(CLI::PositiveNumber);
  // (a NaN or a negative figure printed no column and exited 0; an infinite one overflowed the
  // byte count)
  app.add_option("--device-memory-gib", device_gib, "print the largest batch that fits")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            char* end = nullptr;
            const double gib = std::strtod(text.c_str(), &end);
            if (end == text.c_str() || *end != '\0' || !(gib > 0 && gib <= 1 << 20))
              return "'" + text + "' is not a memory size in GiB (a number in (0, 1048576])";
            return {};
          },
          "GIB"));
  app.add_option("--offload", offload,
                 "CPU offload: none, optimizer (master, state and step on the host), params "
                 "(fsdp: the parameter shards too), nvme (the master and state in files, "
                 "streamed through RAM in chunks at the step), nvme-params (fsdp: the shards "
                 "in files too, read at each gather)")
      ->check(CLI::IsMember({"none", "optimizer", "params", "nvme", "nvme-params"}));
  app.add_option("--offload-chunk", offload_chunk,
                 "elements per chunk of the offloaded step (offload.chunk_numel)")
      ->check(CLI::PositiveNumber);
  // DeepSpeed ZeRO++'s compression (fsdp rows only: the other stages do not gather or
  // reduce-scatter that way).
  app.add_flag("--quantized-weights", quantized_weights,
               "fsdp: parameters gathered as int8 blocks (qwZ)");
  auto* quantized_grads_flag =
      app.add_flag("--quantized-grads", quantized_grads,
                   "fsdp: gradients reduced by an all-to-all of int8 blocks (qgZ)");
  app.add_flag("--grad-error-feedback", error_feedback,
               "--quantized-grads: an f32 residual of every local gradient")
      ->needs(quantized_grads_flag);  // (alone, it was dropped without a word)
  app.add_option("--reshard-group", reshard_group,
                 "fsdp: after the forward, units stay sharded over nodes of this many ranks (hpZ)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--wrap-threshold", wrap_threshold,
                 "fsdp, a named network: each convolution inside a block with at least this many "
                 "parameters a unit nested in the block's (VISSL's AUTO_WRAP_THRESHOLD)")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "shardkit-plan: %s (see shardkit-plan --help)\n", e.what());
    return 2;
  }

  try {
    par::PlannedRun o;
    o.world_size = world;
    o.group_size = group;
    o.optimizer.kind = sk::optim::parse_optimizer_kind(optimizer);
    o.optimizer.sgd.momentum = 0.9f;
    auto& parallel = o.parallel;
    if (precision != "f32") {
      parallel.precision.param_dtype = precision == "bf16"  ? sk::DType::bf16
                                       : precision == "f16" ? sk::DType::f16
                                                            : sk::DType::f32;
      sk::check(parallel.precision.param_dtype != sk::DType::f32, "--precision '", precision,
                "' is not one of f32, bf16, f16");
      parallel.precision.reduce_dtype = sk::DType::f32;
    }
    std::vector<par::Stage> stages;
    if (stage_name == "all")
      stages.assign(std::begin(par::kAllStages), std::end(par::kAllStages));
    else
      stages.push_back(par::parse_stage(stage_name));

    sk::Context ctx({.cpu_threads = 1});
    std::shared_ptr<sk::nn::Trunk> net;
    std::vector<sk::shard::ParamSpec> specs;
    par::ActivationProfile plain, checkpointed;
    net = build_network(ctx, model, image_size);
    if (net) {
      specs = par::module_param_specs(*net);
      parallel.fsdp.wrap.unit_paths = net->block_paths();
      for (const std::string& conv : net->large_block_convolutions(wrap_threshold))
        parallel.fsdp.wrap.unit_paths.push_back(conv);
      std::fprintf(stderr, "profiling activations of %s at %lldx%lld on this CPU...\n",
                   model.c_str(), static_cast<long long>(image_size),
                   static_cast<long long>(image_size));
      const std::int64_t most = std::max<std::int64_t>(8, std::min<std::int64_t>(batch, 64));
      plain = par::profile_activations(
          [&](std::int64_t b) { return activation_peak(model, image_size, 0, b); }, 2, most);
      checkpointed = par::profile_activations(
          [&](std::int64_t b) { return activation_peak(model, image_size, 4, b); }, 2, most);
    } else {
      // (a name no network answers to and no file has: said so, not "cannot open" it)
      std::error_code missing;
      sk::check(std::filesystem::is_regular_file(model, missing), "--model ", model,
                ": not a network this tool knows, nor a file; name a torchvision ResNet "
                "(resnet18 ... resnet152, resnext50_32x4d, ...), a ClassyVision RegNet "
                "(regnet_y_400mf ...) or an EfficientNet (efficientnet_b0 ... efficientnet_b7), "
                "or give a .safetensors file's path");
      sk::check(wrap_threshold == 0, "--wrap-threshold ", wrap_threshold,
                " needs a named network (its blocks' convolutions); '", model,
                "' is a file: leave the option out");
      const sk::checkpoint::SafetensorsReader file(model);
      for (const auto& t : file.tensors()) specs.push_back({t.name, t.shape, true});
    }
    std::int64_t psi = 0;
    for (const auto& s : specs) psi += sk::shape_numel(s.shape);
    char grouping[64] = "one group";
    if (group > 0 && group < world)
      std::snprintf(grouping, sizeof grouping, "hybrid, groups of %d", group);
    std::printf("%s: %zu tensors, %lld parameters; N = %d, %s; %s, %s; batch %lld per rank\n",
                model.c_str(), specs.size(), static_cast<long long>(psi), world, grouping,
                optimizer.c_str(), precision.c_str(), static_cast<long long>(batch));
    if (net && wrap_threshold > 0)
      std::printf("fsdp units: %zu blocks, %zu convolutions of >= %lld parameters nested in them\n",
                  net->block_paths().size(), net->large_block_convolutions(wrap_threshold).size(),
                  static_cast<long long>(wrap_threshold));
    std::printf("%-5s %10s %10s %10s %10s %10s %11s %12s %12s %12s %12s %12s %10s %10s %10s %10s",
                "stage", "params", "grads", "optim", "comm", "gathered", "layer grads",
                "activations", "act (ckpt)", "total MiB", "sent in grp", "across grps", "host MiB",
                "host<->dev", "disk MiB", "disk r+w");
    if (device_gib > 0) std::printf(" %10s %10s", "max batch", "(ckpt)");
    // The wrap's own peak (ShardedModule's construction), the model built eagerly or under
    // sk::DeferredParameters (every parameter initialised by a whole-tensor fill, so that each
    // rank makes what it keeps from rank 0's recipes).
    std::printf(" %12s %12s", "wrap eager", "wrap defer");
    std::printf("\n");
    for (auto stage : stages) {
      parallel.stage = stage;
      parallel.offload.optimizer = offload != "none";
      parallel.offload.params =
          (offload == "params" || offload == "nvme-params") && stage == par::Stage::fsdp;
      // (The planner reads the files' place only as "on disk"; nothing is written there.)
      parallel.offload.nvme_path = offload.starts_with("nvme") ? "planned" : "";
      parallel.offload.chunk_numel = offload_chunk;
      const bool fsdp = stage == par::Stage::fsdp;
      parallel.fsdp.quantized_weights = fsdp && quantized_weights;
      parallel.fsdp.quantized_grads = fsdp && quantized_grads;
      parallel.fsdp.grad_error_feedback = fsdp && quantized_grads && error_feedback;
      parallel.fsdp.reshard_group_size = fsdp ? reshard_group : 0;
      const auto options = net ? par::module_planned_run(*net, o) : o;
      const auto plan = par::plan_memory(specs, options, plain, batch);
      const auto with_ckpt = par::plan_memory(specs, options, checkpointed, batch);
      std::printf("%-5s %10s %10s %10s %10s %10s %11s %12s %12s %12s %12s %12s %10s %10s %10s %10s",
                  std::string(par::stage_name(stage)).c_str(), mib(plan.parameters).c_str(),
                  mib(plan.gradients).c_str(), mib(plan.optimizer_state).c_str(),
                  mib(plan.communication).c_str(), mib(plan.gathered).c_str(),
                  mib(plan.layer_gradients).c_str(), net ? mib(plan.activations).c_str() : "-",
                  net ? mib(with_ckpt.activations).c_str() : "-", mib(plan.total()).c_str(),
                  mib(plan.sent_in_group).c_str(), mib(plan.sent_across_groups).c_str(),
                  mib(plan.host_total()).c_str(), mib(plan.host_transfer).c_str(),
                  mib(plan.disk_optimizer_state + plan.disk_parameters).c_str(),
                  mib(plan.disk_transfer).c_str());
      if (device_gib > 0) {
        const auto bytes = static_cast<std::int64_t>(device_gib * 1024 * 1024 * 1024);
        if (net)
          std::printf(
              " %10lld %10lld",
              static_cast<long long>(par::largest_batch(specs, options, plain, bytes)),
              static_cast<long long>(par::largest_batch(specs, options, checkpointed, bytes)));
        else
          std::printf(" %10s %10s", plan.total() <= bytes ? "fits" : "no", "-");
      }
      std::printf(" %12s %12s", mib(plan.wrap_peak(false)).c_str(),
                  mib(plan.wrap_peak(true)).c_str());
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "shardkit-plan: %s\n", e.what());
    return 1;
  }
  return 0;
}
