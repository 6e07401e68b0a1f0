// CPU offload (parallel/offload.hpp) over the local communicator: an offloaded run -- the
// optimizer's master, state and step on a host context, and under fsdp the parameter shards too
// -- computes bit for bit what the same run computes without offload, for every stage, every
// optimizer, f32 and mixed precision, loss scaling, clipping and per-parameter decay; the
// device's ledger keeps no optimizer state (and under offloaded parameters no parameters), the
// host's holds exactly what the ZeRO formulas say; checkpoints move between offloaded and plain
// runs; a bad request is named.
#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
using sk::MemoryCategory;
using sk::optim::OptimizerKind;
using sk::parallel::MixedPrecision;
using sk::parallel::OffloadOptions;
using sk::parallel::Stage;

namespace offload_test {

struct Run {
  Stage stage = Stage::sdp;
  OptimizerKind kind = OptimizerKind::larc_sgd;
  int world = 3;
  MixedPrecision precision;
  OffloadOptions offload;
  bool resnet = false;
  bool scaled = false;    // f16 loss scaling through DynamicLossScaler
  double clip = 0;        // clip_grad_norm before each step (0: none)
  bool no_decay = false;  // batch-norm parameters and biases without weight decay
  int steps = 8;
  std::string save_to;    // a checkpoint after the steps ("": none)
  std::string load_from;  // a checkpoint before the steps ("": fresh)
  int first_step = 0;
  bool sample_residency = false;  // offload to NVMe: watch how much of the state is mapped
  // Gradient accumulation: synchronised backwards per step (over 1: the later ones add their
  // averages to those held), after one more under no_sync when `no_sync_first`.
  int backwards = 1;
  bool no_sync_first = false;
  int group = 0;                 // hybrid sharding's group size (0: none)
  bool quantized_grads = false;  // qgZ (sdp, fsdp)
  // fsdp's shards on disk: after the steps, a forward and backward (no step), then everything
  // dropped from RAM and another: what of the shards each one's gathers left in RAM.
  bool probe_gathers = false;
};

struct Outcome {
  std::vector<float> values;  // rank 0: parameters (f32) then f32 buffers
  std::vector<double> losses, norms;
  sk::optim::OptimizerState state;   // consolidated on rank 0
  sk::MemorySnapshot device, host;   // rank 0 after the last step: the two ledgers
  sk::MemorySnapshot disk;           // and the disk's, under offload to NVMe
  std::size_t resident = 0;          // offload to NVMe, rank 0: its state's bytes in RAM then,
  std::size_t resident_spilled = 0;  // after spill_state() (the next step's chunk kept),
  std::size_t resident_dropped = 0;  // after spill_state(true),
  std::size_t resident_peak = 0;     // and the most of them it had mapped during the steps
  std::size_t bytes_read = 0;        // and what its steps read of it from disk
  bool loads_whole = false;          // offload to NVMe: MADV_POPULATE_* works here
  sk::parallel::MemoryPlan plan;     // rank 0's plan
  std::int64_t state_numel = 0;      // rank 0: elements its optimizer updates
  std::int64_t max_state_numel = 0;  // the most any rank updates
  std::int64_t shard_bytes = 0;      // fsdp, rank 0: its parameter shards
  // probe_gathers, rank 0: the shards' bytes in RAM after the steps and after the first probe;
  // after the drop and after the second.
  std::size_t shards_kept = 0, shards_kept_gathered = 0;
  std::size_t shards_dropped = 0, shards_dropped_gathered = 0;
  // The second probe's reads of each unit's shard (FlatParam::ShardReads), its whole pages and
  // name, rank 0.
  std::vector<sk::parallel::FlatParam::ShardReads> probe_reads;
  std::vector<std::size_t> shard_pages;
  std::vector<std::string> unit_names;
};

// A fresh directory for offload to NVMe's files, removed with this; whether it is on tmpfs
// (whose pages are the files: never dropped from RAM, never read from a disk).
struct NvmeDir {
  explicit NvmeDir(const std::string& prefix)
      : path(std::filesystem::temp_directory_path() / (prefix + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
    struct statfs fs {};
    REQUIRE(::statfs(path.c_str(), &fs) == 0);
    tmpfs = fs.f_type == 0x01021994;
  }
  ~NvmeDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  NvmeDir(const NvmeDir&) = delete;
  NvmeDir& operator=(const NvmeDir&) = delete;
  std::filesystem::path path;
  bool tmpfs = false;
};

// Bytes of the ranges that this process has mapped in RAM now (/proc/self/pagemap's present
// bit, whole pages): what a step holds of a mapped file. Unlike mincore it leaves out what the
// kernel read ahead into its page cache and has not mapped -- clean pages it may drop at will.
std::size_t mapped_bytes(const std::vector<std::pair<const void*, std::size_t>>& ranges) {
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  std::size_t pages = 0;
  std::vector<std::uint64_t> entries;
  for (const auto& [data, bytes] : ranges) {
    if (bytes == 0) continue;
    const auto first = reinterpret_cast<std::uintptr_t>(data) / page;
    const auto last = (reinterpret_cast<std::uintptr_t>(data) + bytes - 1) / page;
    entries.resize(last - first + 1);
    const auto want = static_cast<ssize_t>(entries.size() * sizeof(std::uint64_t));
    if (::pread(fd, entries.data(), static_cast<std::size_t>(want),
                static_cast<off_t>(first * sizeof(std::uint64_t))) != want)
      continue;
    for (const auto e : entries) pages += (e >> 63) & 1u;
  }
  ::close(fd);
  return pages * page;
}

std::string describe(const Run& r) {
  return std::string(sk::parallel::stage_name(r.stage)) + " " +
         std::string(sk::optim::optimizer_kind_name(r.kind)) + " N=" + std::to_string(r.world) +
         " " + std::string(sk::dtype_name(r.precision.param_dtype)) +
         " offload optimizer=" + std::to_string(r.offload.optimizer) +
         " params=" + std::to_string(r.offload.params) + (r.resnet ? " resnet" : " mlp") +
         (r.scaled ? " scaled" : "") + (r.clip > 0 ? " clip" : "") +
         (r.no_decay ? " no-decay" : "") +
         (r.precision.reduce_dtype != r.precision.param_dtype
              ? " reduce " + std::string(sk::dtype_name(r.precision.reduce_dtype))
              : "") +
         (r.backwards > 1 ? " backwards=" + std::to_string(r.backwards) : "") +
         (r.no_sync_first ? " no_sync" : "") +
         (r.group > 0 ? " group=" + std::to_string(r.group) : "") +
         (r.quantized_grads ? " qgZ" : "");
}

float lr_at(OptimizerKind kind, int step) {
  return (kind == OptimizerKind::larc_sgd ? 0.5f : 0.05f) *
         (1.0f - 0.02f * static_cast<float>(step));
}

// Parameters (in f32, whatever the compute dtype) then f32 buffers, in state-dict order.
std::vector<float> values_of(sk::Context& ctx, const module_test::nn::Module& module) {
  std::vector<float> out;
  for (const auto& [name, p] : module.named_parameters()) {
    const auto v = sk::to_vector<float>(ctx, sk::cast(ctx, p.data(), sk::DType::f32));
    out.insert(out.end(), v.begin(), v.end());
  }
  for (const auto& [name, b] : module.named_buffers())
    if (b.dtype() == sk::DType::f32) {
      const auto v = sk::to_vector<float>(ctx, b);
      out.insert(out.end(), v.begin(), v.end());
    }
  return out;
}

// The state's parameters in name order (stages order them differently).
sk::optim::OptimizerState by_name(sk::optim::OptimizerState state) {
  std::sort(state.params.begin(), state.params.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  return state;
}

Outcome train(const Run& run) {
  Outcome out;
  std::vector<std::int64_t> state_numel(static_cast<std::size_t>(run.world));
  sk::comm::run_ranks(run.world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto seed = 300 + static_cast<std::uint64_t>(comm.rank());
    std::shared_ptr<module_test::nn::Sequential> net;
    if (run.resnet)
      net = module_test::small_resnet(ctx, seed);
    else
      net = module_test::mlp(ctx, seed);
    sk::parallel::ParallelOptions options;
    options.stage = run.stage;
    options.buckets.bucket_bytes = 4096;
    options.precision = run.precision;
    options.offload = run.offload;
    options.fsdp.quantized_grads = run.quantized_grads;
    if (run.resnet) {
      for (int layer = 1; layer <= 4; ++layer)
        options.fsdp.wrap.unit_paths.push_back("layer" + std::to_string(layer) + ".0");
    } else {
      options.fsdp.wrap.unit_paths = {"0", "3"};
    }
    auto config = dp_test::config_for(run.kind);
    if (run.no_decay)
      for (const auto& [name, p] : net->named_parameters())
        if (p.requires_grad() && (name.find("bias") != std::string::npos ||
                                  name.find("bn") != std::string::npos || name == "1.weight"))
          config.no_weight_decay.push_back(name);
    if (comm.rank() == 0) {  // (before the wrap: then the parameters are views of its buffers)
      sk::parallel::PlannedRun planned;
      planned.parallel = options;
      planned.world_size = run.world;
      planned.rank = 0;  // (the rank whose ledgers the checks read)
      planned.optimizer = config;
      out.plan = sk::parallel::plan_module_memory(*net, planned);
    }
    std::unique_ptr<sk::comm::HybridMesh> mesh;
    if (run.group > 0) mesh = std::make_unique<sk::comm::HybridMesh>(comm, run.group);
    auto wrapped =
        mesh ? std::make_unique<sk::parallel::ShardedModule>(ctx, *mesh, net, config, options)
             : std::make_unique<sk::parallel::ShardedModule>(ctx, comm, net, config, options);
    sk::parallel::ShardedModule& model = *wrapped;
    sk::optim::DynamicLossScaler scaler({.init_scale = 1024});
    if (!run.load_from.empty()) {
      auto state = model.training_state();
      state.scaler = &scaler;
      (void)sk::checkpoint::load_checkpoint(run.load_from, state);
    }
    const sk::Shape shape = run.resnet ? sk::Shape{3, 3, 8, 8} : sk::Shape{6, 12};
    const std::int64_t classes = run.resnet ? 5 : 7;
    // Offload to NVMe, rank 0: a thread samples how much of the state the process has mapped
    // in RAM while the steps run (it can only miss the peak, never exceed it).
    std::atomic<bool> stepping{true};
    std::thread sampler;
    const auto& trained = *model.training_state().optimizer;
    if (comm.rank() == 0 && trained.state_spill() != nullptr && run.sample_residency) {
      std::vector<std::pair<const void*, std::size_t>> ranges;
      for (const auto& buffer : trained.state_buffers())
        ranges.emplace_back(buffer.values.data_ptr(), buffer.values.nbytes());
      if (trained.separate_master())
        for (const auto& range : sk::optim::StateSpill::ranges_of(trained.master_params(), 0,
                                                                  trained.master_params().size()))
          ranges.push_back(range);
      if (run.offload.params)  // (on disk too: each unit's shard, a file of its own)
        for (std::size_t u = 0; u < model.engine().unit_count(); ++u) {
          const auto& shard = model.engine().group(u).shard();
          ranges.emplace_back(shard.data_ptr(), shard.nbytes());
        }
      sampler = std::thread([&, ranges] {
        while (stepping.load()) {
          out.resident_peak = std::max(out.resident_peak, mapped_bytes(ranges));
          std::this_thread::sleep_for(std::chrono::microseconds(20));
        }
      });
    }
    struct StopSampling {
      std::atomic<bool>& stepping;
      std::thread& sampler;
      ~StopSampling() {
        stepping.store(false);
        if (sampler.joinable()) sampler.join();
      }
    } stop_sampling{stepping, sampler};
    for (int s = run.first_step; s < run.first_step + run.steps; ++s) {
      model.zero_grad();
      // (Clipping reads the scale: its norm is formed on the host.)
      const float scale = run.scaled ? static_cast<float>(scaler.scale()) : 1.0f;
      const int micro = run.backwards + (run.no_sync_first ? 1 : 0);
      const auto forward_backward = [&](int m) {
        auto b = module_test::batch(ctx, shape, classes, comm.rank(), s * micro + m);
        auto loss = module_test::ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
        if (comm.rank() == 0) out.losses.push_back(sk::to_vector<float>(ctx, loss.data())[0]);
        if (run.scaled)
          module_test::ag::backward(ctx, loss, scaler.seed(ctx, loss.data()));
        else
          module_test::ag::backward(ctx, loss);
      };
      if (run.no_sync_first) {
        auto local = model.no_sync();
        forward_backward(0);
      }
      for (int m = run.no_sync_first ? 1 : 0; m < micro; ++m) forward_backward(m);
      if (run.clip > 0) {
        const sk::Tensor norm = model.clip_grad_norm(run.clip, 1.0f / scale);
        if (comm.rank() == 0) out.norms.push_back(sk::to_vector<double>(ctx, norm)[0]);
      }
      if (run.scaled)
        model.step(lr_at(run.kind, s), scaler);
      else
        model.step(lr_at(run.kind, s));
    }
    stepping.store(false);
    if (sampler.joinable()) sampler.join();
    // fsdp's shards on disk: a forward and backward (no step) and what of the shards is in RAM
    // before and after it, rank 0.
    const auto probe_gathers = [&](std::size_t& before, std::size_t& after) {
      const auto& engine = model.engine();
      const auto& files = dynamic_cast<const sk::MappedFileAllocator&>(
          model.training_state().optimizer->disk_context()->allocator());
      const auto shards_in_ram = [&] {
        std::size_t bytes = 0;
        for (std::size_t u = 0; u < engine.unit_count(); ++u) {
          const auto& shard = engine.group(u).shard();
          bytes += files.resident_bytes(shard.data_ptr(), shard.nbytes());
        }
        return bytes;
      };
      if (comm.rank() == 0) before = shards_in_ram();
      auto b = module_test::batch(ctx, shape, classes, comm.rank(), 99);
      auto loss = module_test::ag::cross_entropy(ctx, model(ctx, b.x), b.labels);
      module_test::ag::backward(ctx, loss);
      if (comm.rank() == 0) after = shards_in_ram();
    };
    if (run.probe_gathers) probe_gathers(out.shards_kept, out.shards_kept_gathered);
    auto training = model.training_state();
    const auto& optimizer = *training.optimizer;
    state_numel[static_cast<std::size_t>(comm.rank())] =
        optimizer.table().state_numel(optimizer.rank());
    if (comm.rank() == 0 && run.stage == Stage::fsdp) {
      const auto& engine = model.engine();
      for (std::size_t u = 0; u < engine.unit_count(); ++u)
        out.shard_bytes += static_cast<std::int64_t>(engine.group(u).shard().nbytes());
    }
    if (comm.rank() == 0) {
      out.device = ctx.memory_stats().snapshot();
      out.host = optimizer.host_context().memory_stats().snapshot();
      if (optimizer.disk_context() != nullptr) {
        out.disk = optimizer.disk_context()->memory_stats().snapshot();
        out.resident = optimizer.state_spill()->resident_bytes();
        out.bytes_read = optimizer.state_spill()->bytes_read();
        training.optimizer->spill_state();
        out.resident_spilled = optimizer.state_spill()->resident_bytes();
        training.optimizer->spill_state(true);
        out.resident_dropped = optimizer.state_spill()->resident_bytes();
        out.loads_whole =
            dynamic_cast<const sk::MappedFileAllocator&>(optimizer.disk_context()->allocator())
                .loads_whole();
      }
    }
    if (run.probe_gathers) {  // (the steps left the kept chunk in RAM; the checks above dropped it)
      training.optimizer->spill_state(true);
      const auto& engine = model.engine();
      std::vector<sk::parallel::FlatParam::ShardReads> before;
      for (std::size_t u = 0; u < engine.unit_count(); ++u)
        before.push_back(engine.group(u).flat().shard_reads());
      probe_gathers(out.shards_dropped, out.shards_dropped_gathered);
      const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
      for (std::size_t u = 0; comm.rank() == 0 && u < engine.unit_count(); ++u) {
        const auto& reads = engine.group(u).flat().shard_reads();
        out.probe_reads.push_back({reads.ahead - before[u].ahead,
                                   reads.at_gather - before[u].at_gather,
                                   reads.wait_seconds - before[u].wait_seconds});
        out.shard_pages.push_back((engine.group(u).shard().nbytes() + page - 1) / page * page);
        out.unit_names.push_back(engine.unit_name(u));
      }
    }
    auto state = sk::optim::consolidate_optimizer_state(optimizer, *training.comm, 0);
    if (!run.save_to.empty()) {
      training.scaler = &scaler;
      sk::checkpoint::save_checkpoint(run.save_to, training);
    }
    std::vector<float> values;
    if (run.stage == Stage::fsdp) {
      auto full = model.full_params();
      values = values_of(ctx, *net);
    } else {
      values = values_of(ctx, *net);
    }
    if (comm.rank() != 0) return;
    out.values = std::move(values);
    out.state = by_name(std::move(state));
  });
  out.state_numel = state_numel[0];
  for (auto n : state_numel) out.max_state_numel = std::max(out.max_state_numel, n);
  return out;
}

// The run, and the same run offloaded `how`, agree bit for bit: parameters, buffers, losses,
// clipping norms and the whole optimizer state.
void check_offload_exact(Run run, OffloadOptions how) {
  const auto plain = train(run);
  run.offload = how;
  const auto offloaded = train(run);
  const auto what = describe(run);
  CHECK_MESSAGE(dp_test::bitwise_equal(offloaded.values, plain.values), what);
  CHECK_MESSAGE(offloaded.losses == plain.losses, what);
  CHECK_MESSAGE(offloaded.norms == plain.norms, what);
  CHECK_MESSAGE(dp_test::states_equal(offloaded.state, plain.state, 0), what);
  // Not an accident of a run that never moved: the parameters changed.
  CHECK_MESSAGE(plain.losses.front() != plain.losses.back(), what);
}

}  // namespace offload_test

TEST_CASE("an offloaded optimizer steps to the same bits under every stage and optimizer") {
  const OffloadOptions optimizer_only{.optimizer = true};
  for (auto stage : sk::parallel::kAllStages)
    for (auto kind :
         {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
      offload_test::Run run;
      run.stage = stage;
      run.kind = kind;
      offload_test::check_offload_exact(run, optimizer_only);
    }
  // FSDP with the parameter shards on the host too (PyTorch's offload_params).
  for (auto kind :
       {OptimizerKind::sgd, OptimizerKind::larc_sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
    offload_test::Run run;
    run.stage = Stage::fsdp;
    run.kind = kind;
    offload_test::check_offload_exact(run, OffloadOptions{.params = true});
  }
}

// Under sdp and fsdp the reduced gradients are kept on the host, each bucket's part brought down
// as it completes: accumulation (averages added to those held, after a no_sync backward),
// gradients travelling in another dtype than they are kept in, hybrid sharding's exchange
// across groups and fsdp's qgZ f32 sums all reach the host's copy as the device's.
TEST_CASE("gradients kept on the host: accumulation, wire dtypes, hybrid groups, qgZ: same bits") {
  for (auto stage : {Stage::sdp, Stage::fsdp}) {
    offload_test::Run run;
    run.stage = stage;
    run.world = 4;
    run.steps = 4;
    run.backwards = 2;
    run.no_sync_first = true;
    offload_test::check_offload_exact(run, OffloadOptions{.optimizer = true});
    run.backwards = 1;
    run.no_sync_first = false;
    run.kind = OptimizerKind::adamw;
    for (const auto& precision :
         {MixedPrecision{sk::DType::f32, sk::DType::bf16, sk::DType::f32},
          MixedPrecision{sk::DType::bf16, sk::DType::f32, sk::DType::f32}}) {
      run.precision = precision;
      offload_test::check_offload_exact(run, OffloadOptions{.optimizer = true});
    }
    run.precision = {};
    run.group = 2;
    run.backwards = 2;
    offload_test::check_offload_exact(run, OffloadOptions{.optimizer = true});
    if (stage != Stage::fsdp) continue;
    run.backwards = 1;
    run.quantized_grads = true;
    offload_test::check_offload_exact(run, OffloadOptions{.optimizer = true});
    run.group = 0;
    offload_test::check_offload_exact(run, OffloadOptions{.params = true});
  }
}

TEST_CASE("offload under mixed precision, loss scaling, clipping and no-decay groups: same bits") {
  for (auto stage : sk::parallel::kAllStages)
    for (auto dtype : {sk::DType::bf16, sk::DType::f16}) {
      offload_test::Run run;
      run.stage = stage;
      run.precision = MixedPrecision::of(dtype);
      run.scaled = dtype == sk::DType::f16;
      run.clip = 0.5;
      run.no_decay = true;
      offload_test::check_offload_exact(run, OffloadOptions{.optimizer = true});
      if (stage == Stage::fsdp)
        offload_test::check_offload_exact(run, OffloadOptions{.params = true});
    }
  // A small ResNet-18 with batch-norm, one FSDP unit per stage of blocks, AdamW in bf16.
  offload_test::Run resnet;
  resnet.resnet = true;
  resnet.world = 2;
  resnet.steps = 4;
  resnet.stage = Stage::fsdp;
  resnet.kind = OptimizerKind::adamw;
  resnet.precision = MixedPrecision::of(sk::DType::bf16);
  offload_test::check_offload_exact(resnet, OffloadOptions{.params = true});
  resnet.stage = Stage::sdp;
  resnet.precision = {};
  resnet.kind = OptimizerKind::larc_sgd;
  offload_test::check_offload_exact(resnet, OffloadOptions{.optimizer = true});
}

TEST_CASE("offload moves the optimizer state (and fsdp's parameter shards) off the device") {
  // ResNet-18's trainable elements; K = 4 bytes of momentum per element, f32 or bf16 compute.
  for (auto dtype : {sk::DType::f32, sk::DType::bf16})
    for (auto stage : sk::parallel::kAllStages) {
      offload_test::Run run;
      run.resnet = true;
      run.world = 2;
      run.steps = 2;
      run.stage = stage;
      run.kind = OptimizerKind::larc_sgd;
      run.precision = MixedPrecision::of(dtype);
      const auto plain = offload_test::train(run);
      run.offload.optimizer = true;
      const auto offloaded = offload_test::train(run);
      const std::int64_t low = static_cast<std::int64_t>(sk::dtype_size(dtype));
      const std::int64_t n = plain.state_numel;
      const bool mixed = dtype != sk::DType::f32;
      const auto what = offload_test::describe(run);
      // The device keeps its parameters as they were and no optimizer state; its gradients as
      // they were under ddp and oss (all-reduced whole), none under sdp and fsdp (the rank's
      // reduced parts are kept on the host, brought down bucket by bucket in the backward).
      const bool scattered = stage == Stage::sdp || stage == Stage::fsdp;
      CHECK_MESSAGE(offloaded.device.current_of(MemoryCategory::optimizer_state) == 0, what);
      CHECK_MESSAGE(offloaded.device.current_of(MemoryCategory::parameters) ==
                        plain.device.current_of(MemoryCategory::parameters),
                    what);
      CHECK_MESSAGE(offloaded.device.current_of(MemoryCategory::gradients) ==
                        (scattered ? 0 : plain.device.current_of(MemoryCategory::gradients)),
                    what);
      if (scattered) CHECK_MESSAGE(plain.device.current_of(MemoryCategory::gradients) > 0, what);
      // The host holds the f32 master and momentum of the rank's pieces (the state the device
      // held before, and the master even in f32 training), the gradients (sdp, fsdp) or their
      // staging (ddp, oss), and under mixed precision the rounded copy on its way up.
      CHECK_MESSAGE(offloaded.host.current_of(MemoryCategory::optimizer_state) == 8 * n, what);
      CHECK_MESSAGE(plain.device.current_of(MemoryCategory::optimizer_state) == (mixed ? 8 : 4) * n,
                    what);
      CHECK_MESSAGE(offloaded.host.current_of(MemoryCategory::gradients) == low * n, what);
      CHECK_MESSAGE(offloaded.host.current_of(MemoryCategory::parameters) == (mixed ? low * n : 0),
                    what);
      if (stage != Stage::fsdp) continue;
      // Parameter offload: the shards leave the device for the host; what stays are the
      // batch-norm buffers (module state, not parameters of any unit).
      run.offload.params = true;
      const auto shards = offload_test::train(run);
      CHECK_MESSAGE(plain.shard_bytes > 0, what);
      CHECK_MESSAGE(shards.device.current_of(MemoryCategory::parameters) ==
                        plain.device.current_of(MemoryCategory::parameters) - plain.shard_bytes,
                    what);
      CHECK_MESSAGE(shards.device.current_of(MemoryCategory::optimizer_state) == 0, what);
      CHECK_MESSAGE(shards.host.current_of(MemoryCategory::parameters) == plain.shard_bytes, what);
      CHECK_MESSAGE(shards.host.current_of(MemoryCategory::optimizer_state) == (mixed ? 8 : 4) * n,
                    what);
    }
}

TEST_CASE("checkpoints move between offloaded and plain runs, bit for bit") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_offload_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  for (auto dtype : {sk::DType::f32, sk::DType::bf16}) {
    offload_test::Run whole;
    whole.stage = Stage::fsdp;
    whole.kind = OptimizerKind::adamw;
    whole.precision = MixedPrecision::of(dtype);
    whole.steps = 8;
    const auto reference = offload_test::train(whole);
    // 4 steps offloaded (fsdp, shards on the host), saved; then 4 more plain under sdp, or 4
    // more with the optimizer offloaded under oss (the same 3 ranks: the same batches).
    offload_test::Run first = whole;
    first.steps = 4;
    first.offload.params = true;
    first.save_to = (dir / "offloaded").string();
    (void)offload_test::train(first);
    offload_test::Run second = whole;
    second.steps = 4;
    second.first_step = 4;
    second.load_from = first.save_to;
    second.stage = Stage::sdp;
    const auto resumed_plain = offload_test::train(second);
    offload_test::Run third = second;
    third.stage = Stage::oss;
    third.offload.optimizer = true;
    const auto resumed_offloaded = offload_test::train(third);
    const auto what = std::string(sk::dtype_name(dtype));
    CHECK_MESSAGE(dp_test::bitwise_equal(resumed_plain.values, reference.values), what);
    CHECK_MESSAGE(dp_test::bitwise_equal(resumed_offloaded.values, reference.values), what);
    CHECK_MESSAGE(dp_test::states_equal(resumed_plain.state, reference.state, 0), what);
    CHECK_MESSAGE(dp_test::states_equal(resumed_offloaded.state, reference.state, 0), what);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("custom loops: DataParallel and FsdpEngine offload, set_full_params and full_params") {
  const auto specs = dp_test::model_specs();
  std::vector<sk::shard::ParamSpec> trainable;
  for (const auto& p : specs)
    if (p.trainable) trainable.push_back(p);
  auto fill = [](std::size_t i, const sk::Tensor& view) {
    sk::Context host({.seed = 77 + i});
    sk::uniform_(host, view, -0.5, 0.5);
  };
  // DataParallel (sdp) and FsdpEngine (two units) with and without offload: the same values.
  auto run_engines = [&](bool offload) {
    std::vector<float> dp_values, fsdp_values;
    sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      sk::parallel::ParallelOptions dp_options;
      dp_options.stage = Stage::sdp;
      dp_options.offload.optimizer = offload;
      sk::parallel::DataParallel dp(ctx, comm, trainable, dp_test::config_for(OptimizerKind::adamw),
                                    dp_options);
      dp.set_full_params(fill);
      sk::parallel::ParallelOptions fsdp_options;
      fsdp_options.stage = Stage::fsdp;
      fsdp_options.offload.optimizer = offload;  // f32: the master apart, on the host
      std::vector<sk::parallel::FsdpUnitParams> units(2);
      for (std::size_t i = 0; i < trainable.size(); ++i)
        units[i < 3 ? 0 : 1].params.push_back(trainable[i]);
      units[0].name = "first";
      units[1].name = "second";
      sk::parallel::FsdpEngine fsdp(ctx, comm, units, dp_test::config_for(OptimizerKind::larc_sgd),
                                    fsdp_options);
      fsdp.set_full_params(fill);
      // A gradient of 0.5 w plus a pattern that differs per step, rank and parameter.
      auto add_grad = [&](auto& engine, std::size_t i, int s, std::size_t mul, std::size_t mod) {
        const auto w = sk::to_vector<float>(ctx, engine.param(i));
        std::vector<float> g(w.size());
        for (std::size_t e = 0; e < g.size(); ++e)
          g[e] = 0.5f * w[e] + 0.01f * static_cast<float>((e * mul + i + s + comm.rank()) % mod);
        sk::add_(ctx, engine.grad(i), sk::from_vector(ctx, g, engine.grad(i).shape()));
        engine.ready(i);
      };
      for (int s = 0; s < 5; ++s) {
        dp.zero_grad();
        fsdp.zero_grad();
        for (std::size_t i = trainable.size(); i-- > 0;) add_grad(dp, i, s, 7, 13);
        dp.finish();
        dp.step(0.05f);
        for (std::size_t u = 2; u-- > 0;) {
          fsdp.gather(u);
          for (std::size_t i = 0; i < fsdp.param_count(); ++i)
            if (fsdp.unit_of(i) == u) add_grad(fsdp, i, s, 5, 11);
          fsdp.release(u);
        }
        fsdp.finish();
        fsdp.step(0.5f);
      }
      {  // writes inside full_params() reach the (host) masters: the next step starts there
        auto full = fsdp.full_params();
        sk::fill(ctx, fsdp.param(0), 0.25);
      }
      std::vector<float> d, f;
      for (std::size_t i = 0; i < trainable.size(); ++i) {
        const auto v = sk::to_vector<float>(ctx, dp.param(i));
        d.insert(d.end(), v.begin(), v.end());
      }
      {
        auto full = fsdp.full_params();
        for (std::size_t i = 0; i < fsdp.param_count(); ++i) {
          const auto v = sk::to_vector<float>(ctx, fsdp.param(i));
          f.insert(f.end(), v.begin(), v.end());
        }
      }
      // The master of parameter 0 took the written value.
      std::vector<float> master;
      auto training = fsdp.training_state();
      sk::optim::stream_pieces(ctx, comm, training.optimizer->table(),
                               training.optimizer->master_params(), 0,
                               [&](const sk::shard::StatePiece& piece, std::int64_t,
                                   const float* values, std::int64_t count) {
                                 if (piece.param == 0)
                                   master.insert(master.end(), values, values + count);
                               });
      if (comm.rank() == 0) {
        // (all of it: a stream that delivered no piece of it passed the loop below)
        REQUIRE(static_cast<std::int64_t>(master.size()) == fsdp.param(0).numel());
        for (float v : master) CHECK(v == 0.25f);
        dp_values = d;
        fsdp_values = f;
      }
    });
    return std::make_pair(dp_values, fsdp_values);
  };
  const auto plain = run_engines(false);
  const auto offloaded = run_engines(true);
  CHECK(dp_test::bitwise_equal(offloaded.first, plain.first));
  CHECK(dp_test::bitwise_equal(offloaded.second, plain.second));
}

TEST_CASE("offload to NVMe: a shard read ahead of its gather, and one nobody gathers, leave RAM") {
  const offload_test::NvmeDir dir("shardkit_ahead_");
  // Two units of a few pages a shard each, on two ranks, f32: the shards are the master.
  std::vector<sk::parallel::FsdpUnitParams> units(2);
  units[0] = {"first", {{"a", {300, 40}, true}, {"b", {40}, true}}};
  units[1] = {"second", {{"c", {500, 30}, true}}};
  auto fill = [](std::size_t i, const sk::Tensor& view) {
    sk::Context host({.seed = 91 + i});
    sk::uniform_(host, view, -0.5, 0.5);
  };
  bool residency_checked = false;
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ParallelOptions options;
    options.stage = Stage::fsdp;
    options.offload.params = true;
    options.offload.nvme_path = dir.path.string();
    sk::parallel::FsdpEngine engine(ctx, comm, units, dp_test::config_for(OptimizerKind::adamw),
                                    options);
    engine.set_full_params(fill);
    const auto values_of_unit = [&](std::size_t u) {
      std::vector<float> values;
      for (std::size_t i = 0; i < engine.param_count(); ++i)
        if (engine.unit_of(i) == u) {
          const auto v = sk::to_vector<float>(ctx, engine.param(i));
          values.insert(values.end(), v.begin(), v.end());
        }
      return values;
    };
    std::vector<std::vector<float>> full(2);
    for (std::size_t u = 0; u < 2; ++u) {
      engine.gather(u);
      full[u] = values_of_unit(u);
      engine.release(u);
    }
    auto training = engine.training_state();
    const auto& files = dynamic_cast<const sk::MappedFileAllocator&>(
        training.optimizer->disk_context()->allocator());
    const auto page = files.page_bytes();
    const auto in_ram = [&](std::size_t u) {
      const auto& shard = engine.group(u).shard();
      return files.resident_bytes(shard.data_ptr(), shard.nbytes());
    };
    const auto pages_of = [&](std::size_t u) {
      return (engine.group(u).shard().nbytes() + page - 1) / page * page;
    };
    // What RAM holds and what was read are checked where the shards' pages come from a disk
    // (not tmpfs, whose pages are the files) and a read brings them in whole
    // (MADV_POPULATE_*; without it a read only starts the kernel's read-ahead): the values
    // everywhere.
    const bool residency = !dir.tmpfs && files.loads_whole();
    if (comm.rank() == 0) residency_checked = residency;
    training.optimizer->spill_state(true);  // (every shard out of RAM)
    if (residency) {
      REQUIRE(in_ram(0) == 0);
      REQUIRE(in_ram(1) == 0);
    }
    const auto reads = [&](std::size_t u) { return engine.group(u).flat().shard_reads(); };
    auto before = reads(1);
    // Read ahead, then gathered: the gather reads nothing itself, holds the same values as one
    // that read the shard, and leaves RAM as it was before the read ahead.
    engine.read_shard_ahead(1);
    engine.gather(1);
    CHECK(dp_test::bitwise_equal(values_of_unit(1), full[1]));
    if (residency) {
      CHECK(reads(1).ahead - before.ahead == pages_of(1));
      CHECK(reads(1).at_gather == before.at_gather);
      CHECK(in_ram(1) == 0);
    }
    // A gathered unit reads nothing ahead (its next gather is after a release).
    before = reads(1);
    engine.read_shard_ahead(1);
    CHECK(reads(1).ahead == before.ahead);
    engine.release(1);
    // Read ahead and released without a gather: read once, dropped again.
    before = reads(0);
    engine.read_shard_ahead(0);
    engine.release(0);
    if (residency) {
      CHECK(reads(0).ahead - before.ahead == pages_of(0));
      CHECK(in_ram(0) == 0);
    }
    // Without a read ahead the gather reads the shard itself, and drops it as well.
    before = reads(0);
    engine.gather(0);
    CHECK(dp_test::bitwise_equal(values_of_unit(0), full[0]));
    if (residency) {
      CHECK(reads(0).at_gather - before.at_gather == pages_of(0));
      CHECK(in_ram(0) == 0);
    }
    engine.release(0);
    // One read ahead at a time: another unit's, not gathered yet, is dropped for the new one,
    // and its gather reads the shard itself.
    before = reads(0);
    engine.read_shard_ahead(0);
    engine.read_shard_ahead(1);
    if (residency) CHECK(in_ram(0) == 0);
    engine.gather(0);
    engine.gather(1);
    CHECK(dp_test::bitwise_equal(values_of_unit(0), full[0]));
    CHECK(dp_test::bitwise_equal(values_of_unit(1), full[1]));
    if (residency) {
      CHECK(reads(0).ahead - before.ahead == pages_of(0));
      CHECK(reads(0).at_gather - before.at_gather == pages_of(0));
    }
    engine.release(0);
    engine.release(1);
    // A gather refused part-way (inside a capture: the disk's reads are the host's) leaves the
    // unit not gathered, so the next gather starts over instead of finding an undefined buffer.
    {
      sk::StepGraph graph(ctx, "a gather from disk", {.warmup_steps = 0});
      CHECK_THROWS_AS(graph.run("k", [&] { engine.gather(0); }), sk::CaptureRefused);
    }
    CHECK_FALSE(engine.holds_full(0));
    engine.gather(0);
    CHECK(dp_test::bitwise_equal(values_of_unit(0), full[0]));
    engine.release(0);
    // A read ahead nobody gathers before a step: dropped first (a read ahead of the unit after
    // the step then reads it again), and the step goes on as without it.
    for (std::size_t u = 2; u-- > 0;) {
      engine.gather(u);
      for (std::size_t i = 0; i < engine.param_count(); ++i)
        if (engine.unit_of(i) == u) sk::fill(ctx, engine.grad(i), 0.125);
      for (std::size_t i = 0; i < engine.param_count(); ++i)
        if (engine.unit_of(i) == u) engine.ready(i);
      engine.release(u);
    }
    engine.finish();
    engine.read_shard_ahead(0);
    engine.step(0.01f);
    training.optimizer->spill_state(true);
    before = reads(0);
    engine.read_shard_ahead(0);
    if (residency) CHECK(reads(0).ahead - before.ahead == pages_of(0));
    auto after = engine.full_params();
    const auto stepped = values_of_unit(0);
    // (AdamW's first step: w (1 - lr wd) - lr g / (|g| + eps), in float64 here.)
    REQUIRE(stepped.size() == full[0].size());
    const double lr = 0.01, decay = 1.0 - lr * 0.01, move = lr * 0.125 / (0.125 + 1e-8);
    std::size_t off = 0;
    for (std::size_t e = 0; e < stepped.size(); ++e)
      off += std::abs(stepped[e] - (full[0][e] * decay - move)) > 1e-6 ? 1 : 0;
    CHECK(off == 0);
  });
  if (!residency_checked)
    MESSAGE(
        "the shards' pages are not read from a disk whole here (tmpfs, or no "
        "MADV_POPULATE_*): what RAM holds and what was read not checked");
}

TEST_CASE("offload requests that cannot hold are refused by name") {
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    sk::parallel::ParallelOptions options;
    options.stage = Stage::sdp;
    options.offload.params = true;
    CHECK_THROWS_WITH(sk::parallel::DataParallel(ctx, comm, dp_test::model_specs(),
                                                 dp_test::config_for(OptimizerKind::sgd), options),
                      doctest::Contains("offload.params keeps parameter shards on the host"));
  });
  sk::Context device;
  auto host = sk::make_host_context(device);
  CHECK(&host->allocator() != &device.allocator());  // two ledgers
  CHECK(host->cpu_threads() == device.cpu_threads());
}

// Offload to NVMe (OffloadOptions::nvme_path): the master and state in files there, streamed
// through RAM chunk by chunk at each step -- the same bits as the plain run, the disk's ledger
// and the planner's figure equal, and after a step none of the state left in RAM.
TEST_CASE(
    "offload to NVMe: the master and state on disk, one chunk in RAM between steps, same bits") {
  const offload_test::NvmeDir scratch("shardkit_nvme_");
  const std::filesystem::path& dir = scratch.path;
  const bool tmpfs = scratch.tmpfs;  // (its pages are the files: never dropped)
  OffloadOptions nvme;
  nvme.nvme_path = dir.string();
  for (auto stage : sk::parallel::kAllStages)
    for (auto kind : {OptimizerKind::larc_sgd, OptimizerKind::adam, OptimizerKind::adamw}) {
      offload_test::Run run;
      run.stage = stage;
      run.kind = kind;
      run.steps = 4;
      offload_test::check_offload_exact(run, nvme);
    }
  // fsdp with the shards on disk too and f16 compute, loss-scaled and clipped, on a ResNet.
  offload_test::Run run;
  run.resnet = true;
  run.world = 2;
  run.steps = 3;
  run.stage = Stage::fsdp;
  run.kind = OptimizerKind::adamw;
  run.precision = MixedPrecision::of(sk::DType::f16);
  run.scaled = true;
  run.clip = 0.5;
  nvme.params = true;
  offload_test::check_offload_exact(run, nvme);
  run.offload = nvme;
  run.probe_gathers = true;
  const auto on_disk = offload_test::train(run);
  // The f32 master and Adam's two moments of the rank's pieces are on disk, and the f16 shards;
  // none of them on the host or the device.
  const std::int64_t n = on_disk.state_numel;
  const std::int64_t shards = on_disk.shard_bytes;
  CHECK(shards > 0);
  CHECK(on_disk.disk.current_of(MemoryCategory::optimizer_state) == 12 * n);
  CHECK(on_disk.disk.current_of(MemoryCategory::parameters) == shards);
  CHECK(on_disk.host.current_of(MemoryCategory::optimizer_state) == 0);
  CHECK(on_disk.host.current_of(MemoryCategory::parameters) == 0);
  CHECK(on_disk.plan.disk_optimizer_state == 12 * n);
  CHECK(on_disk.plan.disk_parameters == shards);
  CHECK(on_disk.plan.host_optimizer_state == 0);
  CHECK(on_disk.plan.host_parameters == 0);
  // (One chunk: kept in RAM from step to step, written back at each, not read; so the gathers
  // find the shards in RAM too.)
  CHECK(on_disk.plan.disk_transfer == static_cast<double>(12 * n + shards));
  // The host's RAM at a step's peak: the offload ledgers and the chunks streamed from disk.
  CHECK(on_disk.plan.disk_streaming > 0);
  CHECK(on_disk.plan.host_total() == on_disk.plan.host_gradients + on_disk.plan.disk_streaming);
  // A state of one chunk stays in RAM from step to step (written back at each): read from disk
  // once in three steps; a drop between steps keeps it (spill_state(): what a post-step hook or
  // a save calls), a whole drop takes it out of RAM too (spill_state(true)). The shards are
  // streamed with it (one file a unit: two more pages each at most). Gathers leave RAM as they
  // found it: a forward and backward after the steps keeps the chunk's shards in RAM, one after
  // the whole drop reads them and leaves none of them there.
  const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const auto state_pages = [&](std::int64_t files, std::int64_t numel) {
    return static_cast<std::size_t>(files) * (4 * static_cast<std::size_t>(numel) + 2 * page);
  };
  const std::size_t with_shards = state_pages(3, n) + static_cast<std::size_t>(shards) + 10 * page;
  if (!tmpfs) {
    CHECK(on_disk.resident > 0);
    CHECK(on_disk.resident <= with_shards);
    CHECK(on_disk.bytes_read > 0);
    CHECK(on_disk.bytes_read <= with_shards);
    CHECK(on_disk.resident_spilled > 0);
    CHECK(on_disk.resident_spilled <= on_disk.resident);
    CHECK(on_disk.resident_dropped == 0);
    CHECK(on_disk.shards_kept >= static_cast<std::size_t>(shards));
    CHECK(on_disk.shards_kept_gathered == on_disk.shards_kept);
    CHECK(on_disk.shards_dropped == 0);
    CHECK(on_disk.shards_dropped_gathered == 0);
    // That forward and backward read every shard from disk, the root's once, the others' twice
    // (resharded after the forward), most of it ahead of the gathers, beside compute. Forward:
    // the root's gather and layer1.0's (prefetched with it) read themselves, each later unit
    // was read ahead while the one before it computed, and at the last unit the backward's
    // second was (the first, this one, is gathered again at once). Backward: each unit read
    // ahead but the first. (Where a read brings its pages in whole: MADV_POPULATE_*.)
    for (std::size_t u = 0; on_disk.loads_whole && u < on_disk.unit_names.size(); ++u) {
      const auto& name = on_disk.unit_names[u];
      const auto& reads = on_disk.probe_reads[u];
      const std::size_t pages = on_disk.shard_pages[u];
      const bool root = name == "<root>", edge = name == "layer1.0" || name == "layer4.0";
      CAPTURE(name);
      CHECK(reads.ahead == (root ? 0 : edge ? 1 : 2) * pages);
      CHECK(reads.at_gather == (root || edge ? 1 : 0) * pages);
    }
    CHECK(on_disk.unit_names.size() == 5);
  } else {
    MESSAGE("the temporary directory is tmpfs: RAM residency not checked");
  }
  CHECK(std::filesystem::is_empty(dir));  // (unnamed files)
  // LARC's one-pass update (fsdp on one rank, the shards on disk: no norm exchange) is
  // streamed and dropped too; the f32 shards are the master.
  offload_test::Run larc;
  larc.stage = Stage::fsdp;
  larc.kind = OptimizerKind::larc_sgd;
  larc.world = 1;
  larc.steps = 3;
  offload_test::check_offload_exact(larc, nvme);
  larc.offload = nvme;
  const auto larc_on_disk = offload_test::train(larc);
  CHECK(larc_on_disk.disk.current_of(MemoryCategory::optimizer_state) ==
        4 * larc_on_disk.state_numel);  // (the momentum; the f32 shards are the master)
  CHECK(larc_on_disk.disk.current_of(MemoryCategory::parameters) == larc_on_disk.shard_bytes);
  CHECK(larc_on_disk.plan.disk_parameters == larc_on_disk.shard_bytes);
  if (!tmpfs) {
    CHECK(larc_on_disk.bytes_read <=
          state_pages(2, larc_on_disk.state_numel) + 4 * page);  // (the MLP's three units)
    CHECK(larc_on_disk.resident_dropped == 0);
  }
  // Many chunks (a few pieces each): LARC forming each chunk's norms in its pass (whole pieces:
  // one rank, or ddp), with per-parameter decays, and AdamW; to disk and to host memory.
  for (auto kind : {OptimizerKind::larc_sgd, OptimizerKind::adamw})
    for (auto stage : {Stage::fsdp, Stage::ddp}) {
      offload_test::Run chunked;
      chunked.stage = stage;
      chunked.kind = kind;
      chunked.world = stage == Stage::fsdp ? 1 : 2;
      chunked.steps = 3;
      chunked.no_decay = kind == OptimizerKind::larc_sgd;
      OffloadOptions small = nvme;
      small.params = false;
      small.chunk_numel = 100;
      offload_test::check_offload_exact(chunked, small);
      offload_test::check_offload_exact(chunked,
                                        OffloadOptions{.optimizer = true, .chunk_numel = 100});
    }
  // Pieces split over two ranks (sdp): LARC's norms exchanged first, the master read whole
  // before many chunks.
  offload_test::Run split;
  split.stage = Stage::sdp;
  split.kind = OptimizerKind::larc_sgd;
  split.steps = 3;
  OffloadOptions small = nvme;
  small.params = false;
  small.chunk_numel = 100;
  offload_test::check_offload_exact(split, small);
  const auto split_on_disk = [&] {
    split.offload = small;
    split.sample_residency = true;
    return offload_test::train(split);
  }();
  // (Where the kernel refuses MADV_POPULATE_*, the update's faults map neighbouring pages
  // too: the bound is the loaded chunks'.)
  if (split_on_disk.loads_whole)
    CHECK(split_on_disk.resident_peak <=
          static_cast<std::size_t>(split_on_disk.plan.disk_streaming));
  // fsdp's f32 shards on disk too, split over three ranks: they are the master, read whole for
  // LARC's norms before the chunks, and each gather reads a unit's shard and drops it again: the
  // process never maps more of them and the state than the planner's bound.
  offload_test::Run split_shards;
  split_shards.stage = Stage::fsdp;
  split_shards.kind = OptimizerKind::larc_sgd;
  split_shards.steps = 3;
  OffloadOptions shards_small = nvme;
  shards_small.chunk_numel = 100;
  offload_test::check_offload_exact(split_shards, shards_small);
  split_shards.offload = shards_small;
  split_shards.sample_residency = true;
  const auto split_shards_on_disk = offload_test::train(split_shards);
  CHECK(split_shards_on_disk.plan.disk_parameters == split_shards_on_disk.shard_bytes);
  if (split_shards_on_disk.loads_whole)
    CHECK(split_shards_on_disk.resident_peak <=
          static_cast<std::size_t>(split_shards_on_disk.plan.disk_streaming));
  // While a ResNet steps in chunks of 1 Ki elements, the process maps some of its state, never
  // more than the planner's bound, which is under the whole (about half of this small ResNet's:
  // three chunks around its largest pieces).
  offload_test::Run streamed;
  streamed.resnet = true;
  streamed.world = 1;
  streamed.steps = 3;
  streamed.stage = Stage::fsdp;
  streamed.kind = OptimizerKind::adamw;
  OffloadOptions chunks = nvme;
  chunks.params = false;
  chunks.chunk_numel = 1024;
  streamed.offload = chunks;
  streamed.sample_residency = true;
  const auto on_disk_streamed = offload_test::train(streamed);
  const auto bound = static_cast<std::size_t>(on_disk_streamed.plan.disk_streaming);
  CHECK(bound < static_cast<std::size_t>(on_disk_streamed.plan.disk_optimizer_state));
  if (!tmpfs && on_disk_streamed.loads_whole && ::access("/proc/self/pagemap", R_OK) == 0) {
    CHECK(on_disk_streamed.resident_peak > 0);
    CHECK(on_disk_streamed.resident_peak <= bound);
  }
  // zero_grad() reads the step's first chunk ahead, beside the forward and backward, and the
  // chunk a step ends with stays in RAM: the next step walks the chunks the other way, starting
  // with it. Checked through the pages this process maps (the kernel's own read-ahead into its
  // page cache aside: /proc/self/pagemap, not mincore): after zero_grad() the first chunk
  // (embed.weight), and only it; after the step its last chunk (head.bias and tiny), which the
  // next zero_grad() does not read again (the spill's bytes_read); after the next step, which
  // starts with it, embed.weight's chunk again, which a drop of the rest keeps (spill_state()); a
  // whole drop (spill_state(true)) unmaps it and the next zero_grad() reads it back.
  if (!tmpfs && ::access("/proc/self/pagemap", R_OK) == 0) {
    std::vector<sk::shard::ParamSpec> trainable;
    for (const auto& p : dp_test::model_specs())
      if (p.trainable) trainable.push_back(p);
    sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      sk::parallel::ParallelOptions options;
      options.stage = Stage::ddp;
      options.offload.nvme_path = dir.string();
      options.offload.chunk_numel = 64;  // (the first chunk: embed.weight, 407 elements)
      DataParallel dp(ctx, comm, trainable, dp_test::config_for(OptimizerKind::adamw), options);
      const auto& optimizer = dp.optimizer();
      const auto& spill = *optimizer.state_spill();
      std::vector<std::pair<const void*, std::size_t>> state;  // master, exp_avg, exp_avg_sq
      for (const auto& buffer : optimizer.state_buffers())
        state.emplace_back(buffer.values.data_ptr(), buffer.values.nbytes());
      for (const auto& range : sk::optim::StateSpill::ranges_of(optimizer.master_params(), 0,
                                                                optimizer.master_params().size()))
        state.push_back(range);
      REQUIRE(state.size() == 3);
      std::size_t whole = 0;  // the pages the three files' state spans
      for (const auto& [data, bytes] : state) {
        const auto at = reinterpret_cast<std::uintptr_t>(data);
        whole += (at + bytes + page - 1) / page * page - at / page * page;
      }
      const auto mapped_after = [&](std::size_t at_least) {
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        std::size_t bytes = offload_test::mapped_bytes(state);
        while (bytes < at_least && std::chrono::steady_clock::now() < deadline) {
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
          bytes = offload_test::mapped_bytes(state);
        }
        return bytes;
      };
      const auto step = [&] {
        for (std::size_t i = trainable.size(); i-- > 0;) {
          sk::fill(ctx, dp.grad(i), 0.01 * static_cast<double>(i + 1));
          dp.ready(i);
        }
        dp.finish();
        dp.step(0.05f);
      };
      const auto& files =
          dynamic_cast<const sk::MappedFileAllocator&>(optimizer.disk_context()->allocator());
      CHECK(offload_test::mapped_bytes(state) == 0);
      dp.zero_grad();
      // The first chunk's span in each file: its 1.6 kB on one page, or two.
      const std::size_t ahead = mapped_after(3 * page);
      // (Where the kernel refuses MADV_POPULATE_*, known once the read was tried, the read
      // ahead only starts the kernel's own read-ahead and maps nothing.)
      if (ahead == 0 && !files.loads_whole()) {
        MESSAGE("MADV_POPULATE_* is refused here: the read ahead is not checked");
        return;
      }
      CHECK(ahead >= 3 * page);
      CHECK(ahead <= 6 * page);
      step();
      // The last chunk's 16 bytes in each file: a page each, or two.
      const std::size_t kept = offload_test::mapped_bytes(state);
      CHECK(kept >= 3 * page);
      CHECK(kept <= 6 * page);
      const std::size_t read = spill.bytes_read();
      dp.zero_grad();
      CHECK(spill.bytes_read() == read);
      CHECK(offload_test::mapped_bytes(state) == kept);
      step();
      const std::size_t first = offload_test::mapped_bytes(state);
      CHECK(first >= 3 * page);
      CHECK(first <= 6 * page);
      dp.optimizer().spill_state();
      CHECK(offload_test::mapped_bytes(state) == first);
      dp.optimizer().spill_state(true);
      CHECK(offload_test::mapped_bytes(state) == 0);
      const std::size_t before = spill.bytes_read();
      dp.zero_grad();
      CHECK(mapped_after(3 * page) >= 3 * page);
      CHECK(spill.bytes_read() > before);
    });
  }
  // A chunk size that is not one is refused by name.
  small.chunk_numel = 0;
  split.offload = small;
  CHECK_THROWS_WITH_AS(offload_test::train(split), doctest::Contains("offload.chunk_numel is 0"),
                       sk::InvalidArgument);
  // A directory that is not there is named, with the fix.
  run.offload.nvme_path = (dir / "missing").string();
  CHECK_THROWS_WITH_AS(offload_test::train(run), doctest::Contains("is not a directory"),
                       sk::InvalidArgument);
}

// A state of one chunk stays in RAM from step to step, and no step's drop ever waits for its
// write-back: the kernel's flusher writes it, and a failure there went unchecked -- its pages
// could be left clean and evicted, the state read back as the disk's old bytes. Each step now
// checks the kept chunk's write-back (here a failure injected as the file's), as the steps of
// a state of many chunks do through their drops.
TEST_CASE("offload to NVMe: a state of one chunk has its write-back checked every step") {
  const offload_test::NvmeDir dir("shardkit_one_chunk_");
  std::vector<sk::shard::ParamSpec> trainable;
  for (const auto& p : dp_test::model_specs())
    if (p.trainable) trainable.push_back(p);
  for (const bool one_chunk : {false, true}) {
    sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      sk::parallel::ParallelOptions options;
      options.stage = Stage::ddp;
      options.offload.nvme_path = dir.path.string();
      options.offload.chunk_numel = one_chunk ? std::int64_t{1} << 22 : 64;
      sk::parallel::DataParallel dp(ctx, comm, trainable, dp_test::config_for(OptimizerKind::adamw),
                                    options);
      int steps = 0;
      auto step = [&] {
        dp.zero_grad();
        dp_test::fake_backward(dp, ctx, comm.rank(), steps++);
        dp.finish();
        dp.step(0.05f);
      };
      step();
      step();
      dynamic_cast<const sk::MappedFileAllocator&>(dp.optimizer().disk_context()->allocator())
          .inject_write_back_error(EIO);
      CAPTURE(one_chunk);
      CHECK_THROWS_WITH_AS(([&] {
                             step();
                             step();
                           }()),
                           doctest::Contains("failed (Input/output error)"), sk::IoError);
    });
  }
}
