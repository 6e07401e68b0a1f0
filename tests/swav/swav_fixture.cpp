// Writes the fixture of swav_torch.py: for 1 and 4 ranks, with and without a queue, every
// rank's inputs (unit embeddings of 4 crops, prototypes, queue) and our SwAV loss and its
// gradients with respect to the embeddings and the prototypes; and the kNN's feature pooling
// (feature_eval.hpp) of one random [N, C, H, W] output under each op of kPoolOps.
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "fixtures.hpp"
#include "shardkit/checkpoint/safetensors.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "swav_config.hpp"
#include "swav_loss.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

// Inside a namespace of its own: this file is compiled in one unit with the tests of its
// executable (a unity build), whose anonymous namespaces would otherwise meet this one's.
namespace swav_fixture {

namespace {

constexpr std::int64_t kCrops = 4, kBatch = 6, kDim = 16, kPrototypes = 20, kQueue = 9;

sk::Tensor unit_rows(sk::Context& ctx, std::int64_t rows, std::int64_t dim) {
  auto t = sk::empty(ctx, {rows, dim}, sk::DType::f32);
  sk::normal_(ctx, t, 0, 1);
  auto v = sk::to_vector<float>(ctx, t);
  for (std::int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::int64_t d = 0; d < dim; ++d) s += double(v[r * dim + d]) * v[r * dim + d];
    for (std::int64_t d = 0; d < dim; ++d) v[r * dim + d] = float(v[r * dim + d] / std::sqrt(s));
  }
  return sk::from_vector(ctx, v, {rows, dim});
}

// "<case>.<what>[.<rank>]", built by appending (GCC 12 warns falsely about operator+ here).
std::string key(const std::string& name, const char* what, int rank = -1) {
  std::string k = name;
  k.append(".").append(what);
  if (rank >= 0) k.append(".").append(std::to_string(rank));
  return k;
}

// LINEAR_EVAL_FEAT_POOL_OPS_MAP entries; swav_torch.py applies the same ops in the same order.
constexpr const char* kPoolOps = R"([
  ["res5", ["Identity", []]],
  ["res4", ["AvgPool2d", [[2, 2], 1, 0]]],
  ["res3", ["AvgPool2d", [[3, 3], 2, 1]]],
  ["res2", ["AvgPool2d", [[2, 3], 2]]],
  ["res5avg", ["AdaptiveAvgPool2d", [[2, 3]]]]])";
constexpr const char* kMorePoolOps = R"([["res5", ["AdaptiveAvgPool2d", [[3, 2]]]],
  ["res4", ["AvgPool2d", [[4, 4]]]]])";

void write_pooling(std::vector<sk::checkpoint::NamedBytes>& out) {
  sk::Context host({.seed = 23});
  const std::int64_t n = 2, c = 3, h = 5, w = 7;
  auto x = sk::empty(host, {n, c, h, w}, sk::DType::f32);
  sk::normal_(host, x, 0, 1);
  out.push_back(sk::checkpoint::host_bytes(host, "pool.x", x));
  const auto values = sk::to_vector<float>(host, x);
  int index = 0;
  for (const char* ops : {kPoolOps, kMorePoolOps})
    for (const auto& pool : swav::detail::read_feature_pools(YAML::Load(ops), "fixture")) {
      std::vector<float> pooled(static_cast<std::size_t>(n * pool.features(c, h, w)));
      pool.apply(values.data(), n, c, h, w, pooled.data());
      out.push_back(
          sk::checkpoint::host_bytes(host, key("pool", std::to_string(index++).c_str()),
                                     sk::from_vector(host, pooled, {n, pool.features(c, h, w)})));
    }
}

}  // namespace

int fixture_main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: test_swav --fixture swav OUT.safetensors\n");
    return 2;
  }
  try {
    std::vector<sk::checkpoint::NamedBytes> out;
    std::mutex lock;
    for (int world : {1, 4}) {
      for (std::int64_t queue : {std::int64_t{0}, kQueue}) {
        std::string name = "w";
        name.append(std::to_string(world)).append(queue ? "q" : "");
        sk::Context host({.seed = 17});
        const auto protos = unit_rows(host, kPrototypes, kDim);
        out.push_back(sk::checkpoint::host_bytes(host, key(name, "prototypes"), protos));
        sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          sk::Context data({.seed = 100 + static_cast<std::uint64_t>(comm.rank())});
          ag::Variable z(sk::to_device(ctx, unit_rows(data, kCrops * kBatch, kDim), ctx.device()),
                         true);
          ag::Variable c(sk::clone(ctx, protos), true);
          swav::SwavLossConfig config;
          config.num_crops = static_cast<int>(kCrops);
          config.crops_for_assign = {0, 1};
          config.local_queue_length = queue;
          swav::SwavLoss loss_fn(ctx, config, kDim, kPrototypes, comm.rank(), 3);
          const auto scores = ag::linear(ctx, z, c);
          const auto loss = loss_fn(ctx, comm, z, scores, swav::prototype_scorer(ctx, c));
          ag::backward(ctx, loss);
          std::lock_guard guard(lock);
          if (queue) {
            // The queue as it was during the call: the batch's embeddings pushed it along, so
            // hand the fixture the start VISSL's formula gives (regenerated).
            swav::SwavLoss fresh(ctx, config, kDim, kPrototypes, comm.rank(), 3);
            out.push_back(sk::checkpoint::host_bytes(ctx, key(name, "queue", comm.rank()),
                                                     fresh.queue().view({2, queue, kDim})));
          }
          out.push_back(sk::checkpoint::host_bytes(ctx, key(name, "z", comm.rank()), z.data()));
          out.push_back(
              sk::checkpoint::host_bytes(ctx, key(name, "loss", comm.rank()), loss.data()));
          out.push_back(
              sk::checkpoint::host_bytes(ctx, key(name, "grad_z", comm.rank()), z.grad()));
          out.push_back(
              sk::checkpoint::host_bytes(ctx, key(name, "grad_c", comm.rank()), c.grad()));
        });
      }
    }
    write_pooling(out);
    sk::checkpoint::save_safetensors(argv[1], out);
    std::printf("wrote %s (%zu tensors)\n", argv[1], out.size());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "swav fixture: %s\n", e.what());
    return 1;
  }
}

const shardkit::testing::FixtureRegistration registration("swav", fixture_main);

}  // namespace swav_fixture
