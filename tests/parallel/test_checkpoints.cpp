// Training checkpoints (io/checkpoint.hpp) across stages and world sizes: a checkpoint written
// under any stage, N ranks, full or sharded, loads exactly into any stage on M ranks; a run
// stopped and resumed under another stage continues bit for bit; a full save streams through
// bounded chunks; the full model file is a plain state dict; bad checkpoints are named, and a
// flipped bit in any tensor is caught on load.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "captured_stderr.hpp"
#include "dp_test_model.hpp"
#include "module_test_model.hpp"
#include "shardkit/checkpoint/async_checkpoint.hpp"
#include "shardkit/checkpoint/checkpoint_rewrite.hpp"
#include "shardkit/checkpoint/module_state.hpp"
#include "shardkit/checkpoint/training_checkpoint.hpp"
#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/optim/consolidation.hpp"
#include "shardkit/parallel/sharded_module.hpp"

namespace sk = shardkit;
namespace fs = std::filesystem;
using namespace module_test;
using sk::checkpoint::CheckpointLayout;
using sk::optim::OptimizerKind;
using sk::parallel::Stage;

namespace {

// A fresh directory `name` in this process's folder, which goes when the process ends.
fs::path scratch(const std::string& name) {
  static const struct Root {
    fs::path path =
        fs::temp_directory_path() / ("shardkit_checkpoints_" + std::to_string(::getpid()));
    ~Root() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  } root;
  auto dir = root.path / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

struct Where {
  Stage stage;
  int world;
};

std::string describe(Where w) {
  return std::string(sk::parallel::stage_name(w.stage)) + "/" + std::to_string(w.world);
}

// What rank 0 sees of a run: the module's parameters and buffers, the consolidated optimizer
// state, the step count.
struct Snapshot {
  std::vector<float> values;
  sk::optim::OptimizerState state;
};

struct CheckpointJob {
  Where where;
  OptimizerKind kind = OptimizerKind::adamw;
  int first_step = 0;  // batches and learning rates continue from here
  int steps = 3;
  std::uint64_t seed = 300;  // of the initial parameters
  std::string load_from;
  std::string save_to;
  sk::checkpoint::CheckpointOptions save;
  std::map<std::string, std::string>* loaded_metadata = nullptr;
};

sk::parallel::ParallelOptions options_for(Stage stage) {
  sk::parallel::ParallelOptions options;
  options.stage = stage;
  options.buckets.bucket_bytes = 4096;
  options.fsdp.wrap.unit_paths = {"0", "3"};
  return options;
}

Snapshot run(const CheckpointJob& job) {
  Snapshot out;
  sk::comm::run_ranks(job.where.world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, job.seed + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(job.kind),
                                      options_for(job.where.stage));
    if (!job.load_from.empty()) {
      const auto loaded = sk::checkpoint::load_checkpoint(job.load_from, model.training_state());
      if (comm.rank() == 0 && job.loaded_metadata != nullptr)
        *job.loaded_metadata = loaded.metadata;
    }
    for (int s = job.first_step; s < job.first_step + job.steps; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(dp_test::lr_at(job.kind, s));
    }
    if (!job.save_to.empty())
      sk::checkpoint::save_checkpoint(job.save_to, model.training_state(), job.save);
    auto state = sk::optim::consolidate_optimizer_state(*model.training_state().optimizer, comm, 0);
    std::vector<float> values;
    if (job.where.stage == Stage::fsdp) {
      auto full = model.full_params();
      values = module_values(ctx, *net);
    } else {
      values = module_values(ctx, *net);
    }
    if (comm.rank() != 0) return;
    out.values = std::move(values);
    out.state = std::move(state);
  });
  return out;
}

// By parameter name: FSDP's units order the parameters differently from the module.
bool same_state(const sk::optim::OptimizerState& a, const sk::optim::OptimizerState& b) {
  if (a.kind != b.kind || a.steps != b.steps || a.params.size() != b.params.size()) return false;
  std::map<std::string, const sk::optim::ParamOptimizerState*> by_name;
  for (const auto& p : b.params) by_name[p.name] = &p;
  for (const auto& p : a.params) {
    const auto found = by_name.find(p.name);
    if (found == by_name.end() || found->second->buffers != p.buffers) return false;
  }
  return true;
}

}  // namespace

TEST_CASE("a checkpoint of any stage and world size loads exactly into any other") {
  const Where sources[] = {{Stage::fsdp, 4}, {Stage::sdp, 3}, {Stage::oss, 2}, {Stage::ddp, 1}};
  const Where targets[] = {
      {Stage::ddp, 1}, {Stage::sdp, 3}, {Stage::fsdp, 2}, {Stage::oss, 4}, {Stage::fsdp, 3}};
  for (auto kind : {OptimizerKind::adamw, OptimizerKind::sgd}) {
    for (auto layout : {CheckpointLayout::full, CheckpointLayout::sharded}) {
      for (const auto& from : sources) {
        const auto dir = scratch("any_to_any");
        CheckpointJob save;
        save.where = from;
        save.kind = kind;
        save.save_to = dir.string();
        save.save.layout = layout;
        const auto saved = run(save);
        REQUIRE(saved.state.steps == 3);
        for (const auto& to : targets) {
          CheckpointJob load;
          load.where = to;
          load.kind = kind;
          load.steps = 0;
          load.seed = 999;  // other initial values: the load must overwrite every one
          load.load_from = dir.string();
          const auto loaded = run(load);
          const std::string what = std::string(sk::checkpoint::checkpoint_layout_name(layout)) +
                                   " " + describe(from) + " -> " + describe(to) + " " +
                                   std::string(sk::optim::optimizer_kind_name(kind));
          CHECK_MESSAGE(dp_test::bitwise_equal(loaded.values, saved.values), what);
          CHECK_MESSAGE(same_state(loaded.state, saved.state), what);
        }
      }
    }
  }
}

TEST_CASE("a run stopped and resumed under another stage continues bit for bit") {
  for (auto kind : {OptimizerKind::adamw, OptimizerKind::sgd}) {
    CheckpointJob whole;
    whole.where = {Stage::fsdp, 3};
    whole.kind = kind;
    whole.steps = 6;
    const auto uninterrupted = run(whole);
    for (auto layout : {CheckpointLayout::sharded, CheckpointLayout::full}) {
      for (auto resume_stage : {Stage::sdp, Stage::ddp, Stage::fsdp}) {
        const auto dir = scratch("resume");
        CheckpointJob first = whole;
        first.steps = 3;
        first.save_to = dir.string();
        first.save.layout = layout;
        first.save.metadata = {{"epoch", "0"}, {"sampler.start_iter", "3"}};
        (void)run(first);
        std::map<std::string, std::string> metadata;
        CheckpointJob second = whole;
        second.where.stage = resume_stage;
        second.first_step = 3;
        second.steps = 3;
        second.seed = 5;
        second.load_from = dir.string();
        second.loaded_metadata = &metadata;
        const auto resumed = run(second);
        const std::string what = std::string(sk::checkpoint::checkpoint_layout_name(layout)) +
                                 " fsdp -> " + std::string(sk::parallel::stage_name(resume_stage));
        CHECK_MESSAGE(dp_test::bitwise_equal(resumed.values, uninterrupted.values), what);
        CHECK_MESSAGE(same_state(resumed.state, uninterrupted.state), what);
        CHECK(metadata ==
              std::map<std::string, std::string>{{"epoch", "0"}, {"sampler.start_iter", "3"}});
      }
    }
  }
}

std::string latest_name(const fs::path& dir) {
  std::ifstream in(dir / "latest");
  std::string name;
  std::getline(in, name);
  return name;
}

// Files a save leaves besides its checkpoint: temporaries and the async save's markers.
std::vector<std::string> leftovers(const fs::path& dir) {
  std::vector<std::string> out;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    const auto name = entry.path().filename().string();
    if (name.find(".tmp.") != std::string::npos || name.rfind(".written.", 0) == 0)
      out.push_back(entry.path().string());
  }
  return out;
}

TEST_CASE("async step checkpoints: step 3's state while training goes on; one save at a time") {
  const auto dir = scratch("async");
  const Where where{Stage::fsdp, 3};
  // Reference: step 3's state saved in the foreground by a run that stops there.
  const auto reference_dir = scratch("async_reference");
  CheckpointJob reference;
  reference.where = where;
  reference.steps = 3;
  reference.save_to = reference_dir.string();
  reference.save.layout = CheckpointLayout::sharded;
  (void)run(reference);

  std::vector<std::string> latest_after_second_save(3);
  // Step 3's checkpoint is kept aside before step 5's replaces it, to compare with the
  // reference: save() copies the state (detail::snapshot_shard) before it returns, and the
  // steps after it change the state while the copy is written.
  const auto kept3_dir = scratch("async_kept3");
  sk::comm::run_ranks(where.world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, reference.seed + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(reference.kind),
                                      options_for(where.stage));
    sk::checkpoint::AsyncCheckpointer saver(dir.string());
    sk::checkpoint::CheckpointOptions options;
    options.layout = CheckpointLayout::sharded;
    for (int s = 0; s < 6; ++s) {
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(dp_test::lr_at(reference.kind, s));
      // Saves after steps 3 and 5; the steps between change the state while step 3 is written.
      if (s == 2) saver.save(3, model.training_state(), options);
      if (s == 4)  // (read in `extra`: before this rank's write, so before step 5's switch)
        saver.save(5, model.training_state(), options, [&](const std::string&) {
          // The save of step 3 was published before this one began.
          latest_after_second_save[static_cast<std::size_t>(comm.rank())] = latest_name(dir);
          CHECK(fs::exists(dir / "step_000000003"));
          if (comm.rank() == 0)
            fs::copy(dir / "step_000000003", kept3_dir, fs::copy_options::recursive);
        });
    }
    saver.finish();
    CHECK_FALSE(saver.in_flight());
  });
  for (const auto& name : latest_after_second_save) CHECK(name == "step_000000003");
  CHECK(latest_name(dir) == "step_000000005");
  CHECK_FALSE(fs::exists(dir / "step_000000003"));  // replaced by the newer one
  CHECK(leftovers(dir).empty());

  // Step 5's checkpoint holds what a foreground save of step 5 holds; loaded, it equals it.
  const auto reference5_dir = scratch("async_reference5");
  CheckpointJob reference5 = reference;
  reference5.steps = 5;
  reference5.save_to = reference5_dir.string();
  (void)run(reference5);
  CheckpointJob load_async;
  load_async.where = where;
  load_async.steps = 0;
  load_async.load_from = (dir / "step_000000005").string();
  CheckpointJob load_reference = load_async;
  load_reference.load_from = reference5_dir.string();
  const auto from_async = run(load_async), from_reference = run(load_reference);
  CHECK(dp_test::bitwise_equal(from_async.values, from_reference.values));
  CHECK(same_state(from_async.state, from_reference.state));
  CHECK(from_async.state.steps == 5);
  // And step 3's, written while the next steps changed the state, holds step 3's.
  CheckpointJob load_kept3 = load_async, load_reference3 = load_async;
  load_kept3.load_from = kept3_dir.string();
  load_reference3.load_from = reference_dir.string();
  const auto from_kept3 = run(load_kept3), from_reference3 = run(load_reference3);
  CHECK(dp_test::bitwise_equal(from_kept3.values, from_reference3.values));
  CHECK(same_state(from_kept3.state, from_reference3.state));
  CHECK(from_kept3.state.steps == 3);
}

TEST_CASE("async step checkpoints: a failed write leaves the previous latest and names the rank") {
  const auto dir = scratch("async_failure");
  std::vector<std::string> errors(2);
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options_for(Stage::sdp));
    sk::checkpoint::AsyncCheckpointer saver(dir.string());
    sk::checkpoint::CheckpointOptions options;
    options.layout = CheckpointLayout::sharded;
    CHECK_THROWS_WITH(saver.save(1, model.training_state()),
                      doctest::Contains("save with the sharded layout"));
    saver.save(1, model.training_state(), options);
    saver.finish();
    // Rank 1's file cannot be renamed into place: a folder stands where it goes.
    saver.save(2, model.training_state(), options, [&](const std::string& folder) {
      if (comm.rank() == 1)
        fs::create_directories(fs::path(folder) / sk::checkpoint::shard_file_name(1, 2) / "x");
    });
    try {
      saver.finish();
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(comm.rank())] =
          std::string(dynamic_cast<const sk::comm::PeerFailed*>(&e) ? "PeerFailed: " : "") +
          e.what();
    }
  });
  CHECK(errors[0].find("PeerFailed: the checkpoint of step 2") == 0);
  CHECK(errors[0].find("failed to write on rank(s) 1") != std::string::npos);
  CHECK(errors[1].find("shard-00001-of-00002") != std::string::npos);
  CHECK(latest_name(dir) == "step_000000001");
}

// A saver destroyed without finish() cannot throw: a lost save is said on stderr -- the rank
// whose write failed names its error, and rank 0 that it did not publish the step.
TEST_CASE("async step checkpoints: a saver destroyed with a failed save says so on stderr") {
  const auto dir = scratch("async_destroyed");
  sk::testing::CapturedStderr captured;
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options_for(Stage::sdp));
    sk::checkpoint::CheckpointOptions options;
    options.layout = CheckpointLayout::sharded;
    {
      sk::checkpoint::AsyncCheckpointer saver(dir.string());
      saver.save(1, model.training_state(), options);
      saver.finish();
    }  // (finished: nothing to say)
    sk::checkpoint::AsyncCheckpointer saver(dir.string());
    saver.save(2, model.training_state(), options, [&](const std::string& folder) {
      if (comm.rank() == 1)  // rank 1's file cannot be renamed into place
        fs::create_directories(fs::path(folder) / sk::checkpoint::shard_file_name(1, 2) / "x");
    });
  });
  captured.restore();
  const std::string text = captured.text();
  CHECK(text.find("step 1") == std::string::npos);
  CHECK(text.find("the background checkpoint of step 2 in '" + dir.string() + "' failed: ") !=
        std::string::npos);
  CHECK(text.find("shard-00001-of-00002") != std::string::npos);
  CHECK(text.find("the background checkpoint of step 2 in '" + dir.string() +
                  "' was not published") != std::string::npos);
  CHECK(latest_name(dir) == "step_000000001");
}

// Only a missing `latest` means "no checkpoint": one that cannot be read, taken for none, would
// start the run afresh, and its first save would remove the checkpoint in force.
TEST_CASE("latest_checkpoint: none only where `latest` is missing; anything else is refused") {
  const auto dir = scratch("latest_pointer");
  CHECK_FALSE(sk::checkpoint::latest_checkpoint((dir / "absent").string()).has_value());
  CHECK_FALSE(sk::checkpoint::latest_checkpoint(dir.string()).has_value());
  fs::create_directories(dir / "step_000000004");
  std::ofstream(dir / "latest") << "step_000000004\n";
  CHECK(sk::checkpoint::latest_checkpoint(dir.string()) == (dir / "step_000000004").string());
  std::ofstream(dir / "latest") << "step_000000009\n";
  CHECK_THROWS_WITH_AS(sk::checkpoint::latest_checkpoint(dir.string()),
                       doctest::Contains("names 'step_000000009', which is missing"), sk::IoError);
  std::ofstream(dir / "latest", std::ios::trunc).flush();
  CHECK_THROWS_WITH_AS(sk::checkpoint::latest_checkpoint(dir.string()),
                       doctest::Contains("latest' names no folder"), sk::IoError);
  fs::remove(dir / "latest");
  fs::create_directories(dir / "latest");
  CHECK_THROWS_WITH_AS(sk::checkpoint::latest_checkpoint(dir.string()),
                       doctest::Contains("latest' is not a file"), sk::IoError);
}

namespace {

// Each rank's error from `save` ("PeerFailed: " before a peer's), or "" where it succeeded.
std::vector<std::string> save_errors(
    int world, Stage stage,
    const std::function<void(sk::parallel::ShardedModule&, sk::comm::Communicator&)>& save) {
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 300 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                      options_for(stage));
    try {
      save(model, comm);
    } catch (const std::exception& e) {
      errors[static_cast<std::size_t>(comm.rank())] =
          std::string(dynamic_cast<const sk::comm::PeerFailed*>(&e) ? "PeerFailed: " : "") +
          e.what();
    }
  });
  return errors;
}

}  // namespace

// Before the write began (here `extra`; also the copy into staging, or rank 0 preparing the
// folder): the rank that failed used to leave save() alone, and the others' finish() believed
// the save while rank 0's thread waited for the missing marker -- a hang.
TEST_CASE("async step checkpoints: a rank failing before its write fails the save everywhere") {
  const auto dir = scratch("async_early_failure");
  const auto errors = save_errors(2, Stage::fsdp, [&](auto& model, auto& comm) {
    sk::checkpoint::AsyncCheckpointer saver(dir.string());
    sk::checkpoint::CheckpointOptions options;
    options.layout = CheckpointLayout::sharded;
    saver.save(1, model.training_state(), options);
    saver.save(2, model.training_state(), options, [&](const std::string&) {
      if (comm.rank() == 1) throw sk::IoError("rank 1's own file: no space left on device");
    });
    std::string second_error;
    try {
      saver.finish();
    } catch (const std::exception& e) {
      second_error = e.what();
    }
    CHECK(!second_error.empty());
    CHECK(latest_name(dir) == "step_000000001");
    CHECK(fs::exists(dir / "step_000000001"));
    saver.save(3, model.training_state(), options);  // the saver goes on after a failed save
    saver.finish();
    throw sk::IoError(second_error);  // (reported through save_errors)
  });
  CHECK(errors[0].find("the checkpoint of step 2") == 0);
  CHECK(errors[0].find("failed to write on rank(s) 1") != std::string::npos);
  CHECK(errors[1] == "rank 1's own file: no space left on device");
  CHECK(latest_name(dir) == "step_000000003");
  CHECK(leftovers(dir).empty());
}

// A foreground save that fails on one rank throws on every rank -- its own error there,
// PeerFailed naming it elsewhere -- where the others used to wait in a barrier for the rank that
// had left. Sharded: rank 1's file cannot be renamed into place (a folder stands where it
// goes). Full: rank 0's writer cannot open its model file (a folder stands at its temporary's
// name), so the collective stream of the pieces goes on without writing and no file of the
// save is committed.
TEST_CASE("a foreground save failing on one rank fails on every rank") {
  for (const auto layout : {CheckpointLayout::sharded, CheckpointLayout::full}) {
    CAPTURE(static_cast<int>(layout));
    const auto dir = scratch("foreground_failure");
    sk::checkpoint::CheckpointOptions options;
    options.layout = layout;
    options.chunk_numel = 16;  // (the full layout's stream in many chunks, none written)
    const int failing = layout == CheckpointLayout::sharded ? 1 : 0;
    const std::string blocked =
        layout == CheckpointLayout::sharded
            ? sk::checkpoint::shard_file_name(1, 2)
            : std::string(sk::checkpoint::kFullModelFile) + ".tmp." + std::to_string(::getpid());
    fs::create_directories(dir / blocked / "x");
    const auto errors = save_errors(2, Stage::sdp, [&](auto& model, auto&) {
      sk::checkpoint::save_checkpoint(dir.string(), model.training_state(), options);
    });
    const auto& own = errors[static_cast<std::size_t>(failing)];
    const auto& peer = errors[static_cast<std::size_t>(1 - failing)];
    CHECK(own.find(blocked) != std::string::npos);
    CHECK(peer.find("PeerFailed: save_checkpoint into") == 0);
    CHECK(peer.find("failed to write its files on rank(s) " + std::to_string(failing)) !=
          std::string::npos);
    if (layout == CheckpointLayout::full) {
      CHECK_FALSE(fs::exists(dir / sk::checkpoint::kFullModelFile));
      CHECK_FALSE(fs::exists(dir / sk::checkpoint::kFullOptimizerFile));
    }
  }
  // `extra` failing on one rank: the step is not published.
  const auto dir = scratch("foreground_extra_failure");
  const auto errors = save_errors(2, Stage::fsdp, [&](auto& model, auto& comm) {
    auto state = model.training_state();
    (void)sk::checkpoint::save_step_checkpoint(dir.string(), 1, state);
    (void)sk::checkpoint::save_step_checkpoint(dir.string(), 2, state, {}, [&](const auto&) {
      if (comm.rank() == 0) throw sk::IoError("rank 0's queue file: disk full");
    });
  });
  CHECK(errors[0] == "rank 0's queue file: disk full");
  CHECK(errors[1].find("PeerFailed: the checkpoint of step 2") == 0);
  CHECK(errors[1].find("failed to write the caller's files on rank(s) 0") != std::string::npos);
  CHECK(latest_name(dir) == "step_000000001");
}

// A trainer saves the same step twice (an epoch's end right after that iteration's save): the
// folder `latest` names must stand until the switch, so the second save goes to the step's
// other folder, and a third back to the first. Each loads as the state it saved.
TEST_CASE("saving the step latest names again never touches the checkpoint in force") {
  for (const bool background : {false, true}) {
    CAPTURE(background);
    const auto dir = scratch(background ? "resave_async" : "resave");
    std::vector<std::string> folders;
    const auto errors = save_errors(2, Stage::fsdp, [&](auto& model, auto& comm) {
      sk::checkpoint::AsyncCheckpointer saver(dir.string());
      for (int k = 0; k < 3; ++k) {
        sk::checkpoint::CheckpointOptions options;
        options.layout = CheckpointLayout::sharded;
        options.metadata = {{"save", std::to_string(k)}};
        auto state = model.training_state();
        // While the save runs (up to its switch), `latest` names a complete checkpoint.
        auto check_in_force = [&](const std::string& folder) {
          if (k == 0) return;
          const auto in_force = sk::checkpoint::latest_checkpoint(dir.string());
          REQUIRE(in_force.has_value());
          CHECK(fs::path(*in_force).filename() != fs::path(folder).filename());
          CHECK(fs::exists(fs::path(*in_force) / sk::checkpoint::shard_file_name(comm.rank(), 2)));
        };
        std::string folder;
        if (background) {
          folder = saver.save(5, state, options, check_in_force);
          saver.finish();
        } else {
          folder =
              sk::checkpoint::save_step_checkpoint(dir.string(), 5, state, options, check_in_force);
        }
        if (comm.rank() == 0) folders.push_back(fs::path(folder).filename().string());
        CHECK(sk::checkpoint::latest_checkpoint(dir.string()) == folder);
        const auto loaded = sk::checkpoint::load_checkpoint(folder, model.training_state());
        CHECK(loaded.metadata.at("save") == std::to_string(k));
      }
    });
    CHECK(errors == std::vector<std::string>(2));
    CHECK(folders ==
          std::vector<std::string>{"step_000000005", "step_000000005.resaved", "step_000000005"});
    CHECK_FALSE(fs::exists(dir / "step_000000005.resaved"));  // removed by the third's switch
    CHECK(leftovers(dir).empty());
  }
}

TEST_CASE("a full save streams through bounded chunks, and its model file is a state dict") {
  const auto dir = scratch("streamed");
  const int world = 3;
  std::vector<float> reference;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 40 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::adamw),
                                      options_for(Stage::fsdp));
    auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
    ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    model.step(0.05f);
    ctx.memory_stats().reset_peak();
    sk::checkpoint::CheckpointOptions options;
    options.chunk_numel = 7;  // every piece split over several chunks
    sk::checkpoint::save_checkpoint(dir.string(), model.training_state(), options);
    // Beyond its shards a rank held at most one chunk, never a unit or the model.
    const auto peak = ctx.memory_stats().snapshot().peak_of(sk::MemoryCategory::communication);
    CHECK(peak > 0);  // (the chunks are counted: a save that gathered elsewhere would show 0)
    CHECK(peak <= 7 * 4);
    auto full = model.full_params();
    if (comm.rank() == 0) reference = module_values(ctx, *net);
  });
  // The model file loads into a plain, unwrapped module by name (PyTorch's load_state_dict).
  sk::Context ctx;
  auto plain = mlp(ctx, 77);
  sk::checkpoint::load_module((dir / "model.safetensors").string(), ctx, *plain, /*strict=*/true);
  CHECK(dp_test::bitwise_equal(module_values(ctx, *plain), reference));
  CHECK(sk::checkpoint::load_optimizer_state((dir / "optimizer.safetensors").string()).steps == 1);
}

// This process's resident memory and its peak since the last reset_peak_rss(), in bytes
// (Linux's /proc/self/status; clear_refs "5" resets the peak).
std::int64_t status_bytes(const std::string& key) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return -1;
}
bool reset_peak_rss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  const bool written = fd >= 0 && ::write(fd, "5", 1) == 1;
  if (fd >= 0) ::close(fd);
  // (A kernel that ignores it leaves the lifetime peak: then the peak is not the current size.)
  return written && status_bytes("VmHWM") - status_bytes("VmRSS") < (1 << 20);
}

TEST_CASE("a sharded save in the foreground writes from the state: no copy of it in RAM") {
  const auto dir = scratch("foreground");
  // One rank, one wide layer under oss: AdamW's f32 master and two moments are 24 MB.
  const std::int64_t in = 1024, out = 2048;
  auto with_wide_model = [&](auto&& body) {
    sk::comm::run_ranks(1, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = std::make_shared<nn::Sequential>();
      net->push_back(std::make_shared<nn::Linear>(ctx, in, out));
      sk::parallel::ParallelOptions options;
      options.stage = Stage::oss;
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::adamw),
                                        options);
      body(ctx, model);
    });
  };
  std::vector<float> saved_master;
  with_wide_model([&](sk::Context& ctx, sk::parallel::ShardedModule& model) {
    auto b = batch(ctx, {4, in}, out, 0, 0);
    ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
    model.step(0.05f);
    const auto state_bytes = static_cast<std::int64_t>(12 * (in * out + out));
    sk::checkpoint::CheckpointOptions sharded;
    sharded.layout = CheckpointLayout::sharded;
    const std::int64_t before = status_bytes("VmRSS");
    const bool measured = before >= 0 && reset_peak_rss();
    sk::checkpoint::save_checkpoint(dir.string(), model.training_state(), sharded);
    if (measured)  // (a snapshot of the state would have taken its 24 MB again)
      CHECK(status_bytes("VmHWM") - before < state_bytes / 4);
    else
      MESSAGE("no /proc/self/clear_refs here: the save's RAM not checked");
    saved_master = sk::to_vector<float>(ctx, model.training_state().optimizer->master_params()[0]);
  });
  // And it loads back: the same master.
  with_wide_model([&](sk::Context& ctx, sk::parallel::ShardedModule& model) {
    sk::checkpoint::load_checkpoint(dir.string(), model.training_state());
    CHECK(sk::to_vector<float>(ctx, model.training_state().optimizer->master_params()[0]) ==
          saved_master);
  });
}

TEST_CASE("checkpoints that do not fit or do not belong together are refused by name") {
  const auto dir = scratch("bad");
  auto save = [&](Where where, CheckpointLayout layout, const std::string& to, int steps = 1) {
    CheckpointJob job;
    job.where = where;
    job.steps = steps;
    job.save_to = to;
    job.save.layout = layout;
    (void)run(job);
  };
  auto load_error = [&](const std::string& from, OptimizerKind kind = OptimizerKind::adamw,
                        bool other_model = false) -> std::string {
    std::string message = "no error";
    try {
      sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        std::shared_ptr<nn::Sequential> net = mlp(ctx, 1);
        if (other_model) net->push_back(std::make_shared<nn::Linear>(ctx, 7, 2));
        sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(kind),
                                          options_for(Stage::sdp));
        (void)sk::checkpoint::load_checkpoint(from, model.training_state());
      });
    } catch (const std::exception& e) {
      message = e.what();
    }
    return message;
  };
  const auto a = (dir / "a").string(), b = (dir / "b").string();
  save({Stage::fsdp, 2}, CheckpointLayout::sharded, a, 1);
  save({Stage::fsdp, 2}, CheckpointLayout::sharded, b, 2);
  CHECK(load_error(a) == "no error");
  // A shard of another save.
  fs::copy_file(fs::path(b) / "shard-00001-of-00002.safetensors",
                fs::path(a) / "shard-00001-of-00002.safetensors",
                fs::copy_options::overwrite_existing);
  CHECK(load_error(a).find("mixes two saves") != std::string::npos);
  fs::remove(fs::path(a) / "shard-00001-of-00002.safetensors");
  CHECK(load_error(a).find("lacks shard-00001-of-00002.safetensors") != std::string::npos);
  // Another optimizer, another model.
  CHECK(load_error(b, OptimizerKind::sgd).find("is for adamw but this optimizer is sgd") !=
        std::string::npos);
  CHECK(load_error(b, OptimizerKind::adamw, true)
            .find("does not fit this model: missing [6.weight, 6.bias]") != std::string::npos);
  // A torn full pair: the optimizer file of another save.
  const auto c = (dir / "c").string(), d = (dir / "d").string();
  save({Stage::ddp, 2}, CheckpointLayout::full, c, 1);
  save({Stage::ddp, 2}, CheckpointLayout::full, d, 2);
  fs::copy_file(fs::path(d) / "optimizer.safetensors", fs::path(c) / "optimizer.safetensors",
                fs::copy_options::overwrite_existing);
  CHECK(load_error(c).find("is torn") != std::string::npos);
  CHECK(load_error((dir / "none").string()).find("no checkpoint folder") != std::string::npos);
  // Saving another layout into a folder replaces what was there.
  save({Stage::oss, 2}, CheckpointLayout::full, b, 3);
  CHECK_FALSE(fs::exists(fs::path(b) / "shard-00000-of-00002.safetensors"));
  CHECK(load_error(b) == "no error");
  // Reserved metadata keys.
  CHECK_THROWS_WITH(
      sk::comm::run_ranks(1,
                          [&](sk::Context& ctx, sk::comm::Communicator& comm) {
                            auto net = mlp(ctx, 1);
                            sk::parallel::ShardedModule model(
                                ctx, comm, net, dp_test::config_for(OptimizerKind::sgd),
                                options_for(Stage::ddp));
                            sk::checkpoint::CheckpointOptions o;
                            o.metadata = {{"steps", "4"}};
                            sk::checkpoint::save_checkpoint(d, model.training_state(), o);
                          }),
      doctest::Contains("metadata key 'steps' is reserved"));
}

TEST_CASE("a flipped bit in any tensor of a checkpoint is refused on load, naming the tensor") {
  const auto dir = scratch("flipped");
  // Each rank's own outcome: its error, or "no error".
  auto rank_errors = [&](const std::string& from) {
    std::vector<std::string> errors(2, "no error");
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, 1);
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::adamw),
                                        options_for(Stage::sdp));
      try {
        (void)sk::checkpoint::load_checkpoint(from, model.training_state());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    return errors;
  };
  auto load_error = [&](const std::string& from) {
    const auto errors = rank_errors(from);
    return errors[0] != "no error" ? errors[0] : errors[1];
  };
  int only_one_rank_read_it = 0;
  std::mt19937 random(11);
  int caught = 0;
  for (const auto layout : {CheckpointLayout::full, CheckpointLayout::sharded}) {
    const auto folder =
        (dir / std::string(sk::checkpoint::checkpoint_layout_name(layout))).string();
    CheckpointJob job;
    job.where = {Stage::fsdp, 2};
    job.save_to = folder;
    job.save.layout = layout;
    (void)run(job);
    REQUIRE(load_error(folder) == "no error");
    for (const auto& entry : fs::directory_iterator(folder)) {
      const auto path = entry.path();
      std::vector<sk::checkpoint::TensorInfo> tensors;
      std::uint64_t data_bytes = 0;
      {
        const sk::checkpoint::SafetensorsReader reader(path.string());
        tensors = reader.tensors();
        for (const auto& t : tensors) data_bytes = std::max(data_bytes, t.end);
      }
      std::ifstream in(path, std::ios::binary);
      const std::string pristine(std::istreambuf_iterator<char>(in), {});
      const std::uint64_t data_start = pristine.size() - data_bytes;
      for (const auto& t : tensors) {
        if (t.bytes() == 0) continue;
        CAPTURE(t.name);
        REQUIRE(t.crc32.has_value());
        std::string damaged = pristine;
        const auto at = data_start + t.begin + random() % t.bytes();
        damaged[at] = static_cast<char>(damaged[at] ^ (1 << (random() % 8)));
        std::ofstream(path, std::ios::binary | std::ios::trunc) << damaged;
        // No rank loads silently: the ranks that read the tensor name it, the others are told
        // which rank failed (so none trains on without the others).
        const auto errors = rank_errors(folder);
        int named = 0;
        for (int r = 0; r < 2; ++r) {
          const auto& e = errors[static_cast<std::size_t>(r)];
          CAPTURE(e);
          if (e.find("tensor '" + t.name + "' is corrupt") != std::string::npos) {
            ++named;
          } else {
            CHECK(e.find("failed on rank(s) " + std::to_string(1 - r)) != std::string::npos);
            ++only_one_rank_read_it;
          }
        }
        CHECK(named >= 1);
        ++caught;
      }
      std::ofstream(path, std::ios::binary | std::ios::trunc) << pristine;
    }
    CHECK(load_error(folder) == "no error");
  }
  CHECK(caught > 20);
  CHECK(only_one_rank_read_it > 0);  // (the sharded optimizer state is read by its owner only)
}

// The "pieces" metadata's element indices are integers: a float was truncated (2.7 read as 2)
// and one beyond int64 was undefined behaviour. (Rewritten here with fresh checksums, as a
// tool would write it: the header checksum would otherwise refuse the change first.)
TEST_CASE("a shard file whose pieces name a non-integer element index is refused, naming it") {
  const auto folder = scratch("pieces_indices").string();
  CheckpointJob job;
  job.where = {Stage::fsdp, 2};
  job.save_to = folder;
  job.save.layout = CheckpointLayout::sharded;
  (void)run(job);
  const auto path = fs::path(folder) / sk::checkpoint::shard_file_name(0, 2);
  const auto pristine = sk::checkpoint::load_safetensors(path.string());
  for (const char* index : {"2.7", "1e300", "-1", "\"3\""}) {
    CAPTURE(index);
    auto pieces = nlohmann::json::parse(pristine.metadata.at("pieces"));
    bool changed = false;
    for (auto& entry : pieces)
      if (!changed && entry.contains("begin")) {
        entry["begin"] = nlohmann::json::parse(index);
        changed = true;
      }
    REQUIRE(changed);
    auto metadata = pristine.metadata;
    metadata["pieces"] = pieces.dump();
    sk::checkpoint::save_safetensors(path.string(), pristine.tensors, metadata);
    std::vector<std::string> errors(2);
    sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, job.seed + static_cast<std::uint64_t>(comm.rank()));
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(job.kind),
                                        options_for(job.where.stage));
      try {
        (void)sk::checkpoint::load_checkpoint(folder, model.training_state());
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(comm.rank())] = e.what();
      }
    });
    const std::string shown = nlohmann::json::parse(index).dump();
    for (const auto& e : errors) {  // (the ranks that read the file name it, the others it)
      CAPTURE(e);
      CHECK((e.find("has begin " + shown + ", not an element index") != std::string::npos ||
             e.find("failed on rank(s)") != std::string::npos));
    }
    CHECK(errors[0].find("has begin " + shown) != std::string::npos);
  }
}

TEST_CASE("a load refused on any rank writes on none: every rank's state stays as it was") {
  const auto folder = scratch("refused").string();
  CheckpointJob job;
  job.where = {Stage::sdp, 2};
  job.save_to = folder;
  job.save.layout = CheckpointLayout::sharded;
  (void)run(job);
  // One rank's file loses a bit in its last tensor: that rank reads (and, before the check,
  // wrote) its other pieces first, and the other rank reads everything it holds intact.
  fs::path damaged_file;
  for (const auto& entry : fs::directory_iterator(folder))
    if (entry.path().extension() == ".safetensors" &&
        entry.path().filename().string().rfind("shard-00001-", 0) == 0)
      damaged_file = entry.path();
  REQUIRE(!damaged_file.empty());
  {
    std::vector<sk::checkpoint::TensorInfo> tensors;
    {
      const sk::checkpoint::SafetensorsReader reader(damaged_file.string());
      tensors = reader.tensors();
    }
    const auto last = std::max_element(tensors.begin(), tensors.end(),
                                       [](const auto& a, const auto& b) { return a.end < b.end; });
    REQUIRE(last != tensors.end());
    std::ifstream in(damaged_file, std::ios::binary);
    std::string bytes(std::istreambuf_iterator<char>(in), {});
    bytes[bytes.size() - 1 - last->bytes() / 2] ^= 0x10;
    std::ofstream(damaged_file, std::ios::binary | std::ios::trunc) << bytes;
  }
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    auto net = mlp(ctx, 900 + static_cast<std::uint64_t>(comm.rank()));
    sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::adamw),
                                      options_for(Stage::sdp));
    for (int s = 0; s < 2; ++s) {  // a state of its own, momentum and step count included
      model.zero_grad();
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), s);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(dp_test::lr_at(OptimizerKind::adamw, s));
    }
    const auto values = module_values(ctx, *net);
    const auto state =
        sk::optim::consolidate_optimizer_state(*model.training_state().optimizer, comm, 0);
    std::string error;
    try {
      (void)sk::checkpoint::load_checkpoint(folder, model.training_state());
    } catch (const sk::Error& e) {
      error = e.what();
    }
    CAPTURE(error);
    CHECK((error.find("is corrupt") != std::string::npos ||
           error.find("failed on rank(s) 1") != std::string::npos));
    CHECK(module_values(ctx, *net) == values);
    const auto after =
        sk::optim::consolidate_optimizer_state(*model.training_state().optimizer, comm, 0);
    if (comm.rank() == 0) CHECK(same_state(after, state));
  });
  fs::remove_all(folder);
}

TEST_CASE("a checkpoint rewritten offline (consolidated, resharded) loads as the original did") {
  const auto dir = scratch("rewritten");
  const auto original = (dir / "original").string();
  CheckpointJob save;
  save.where = {Stage::fsdp, 2};
  save.save_to = original;
  save.save.layout = CheckpointLayout::sharded;
  save.save.metadata = {{"train.epoch", "3"}};
  (void)run(save);
  const auto full = (dir / "full").string(), three = (dir / "three").string(),
             one = (dir / "one").string();
  sk::checkpoint::consolidate_checkpoint(original, full);
  sk::checkpoint::reshard_checkpoint(original, three, 3);
  sk::checkpoint::reshard_checkpoint(full, one, 1);
  auto load = [&](const std::string& from, std::map<std::string, std::string>* metadata) {
    CheckpointJob job;
    job.where = {Stage::oss, 3};
    job.steps = 0;
    job.load_from = from;
    job.loaded_metadata = metadata;
    return run(job);
  };
  std::map<std::string, std::string> expected_metadata;
  const Snapshot reference = load(original, &expected_metadata);
  CHECK(expected_metadata.at("train.epoch") == "3");
  for (const auto& from : {full, three, one}) {
    CAPTURE(from);
    std::map<std::string, std::string> metadata;
    const Snapshot got = load(from, &metadata);
    CHECK(got.values == reference.values);
    CHECK(same_state(got.state, reference.state));
    CHECK(metadata == expected_metadata);
    const sk::checkpoint::CheckpointSource source(from);
    CHECK(source.steps() == 3);
    CHECK(source.stage() == "fsdp");
  }
  CHECK(sk::checkpoint::CheckpointSource(three).world_size() == 3);
  CHECK(sk::checkpoint::CheckpointSource(three).files().size() == 3);
  CHECK_THROWS_WITH(sk::checkpoint::reshard_checkpoint(original, original, 2),
                    doctest::Contains("into the same folder would overwrite what it reads"));
  // An export into the checkpoint's own files replaced its model file with one that is no
  // checkpoint's (and it loaded no more).
  // A model file written into a sharded checkpoint's folder made it hold both layouts; both
  // outputs one file lost the optimizer state.
  for (const std::string& inside :
       {full + "/model.safetensors", full + "/optimizer.safetensors", three + "/model.safetensors"})
    CHECK_THROWS_WITH(sk::checkpoint::export_torch_state(inside.substr(0, inside.rfind('/')),
                                                         inside, (dir / "o").string()),
                      doctest::Contains("would write into the checkpoint's own folder"));
  CHECK_THROWS_WITH(sk::checkpoint::export_torch_state(full, (dir / "m").string(),
                                                       full + "/optimizer.safetensors"),
                    doctest::Contains("would write into the checkpoint's own folder"));
  CHECK_THROWS_WITH(
      sk::checkpoint::export_torch_state(full, (dir / "same").string(), (dir / "same").string()),
      doctest::Contains("would both go to"));
  CHECK(sk::checkpoint::CheckpointSource(full).steps() == 3);
  CHECK(sk::checkpoint::CheckpointSource(three).world_size() == 3);
}

TEST_CASE("state_dict(): the full state dict under every stage, gathered one unit at a time") {
  std::vector<std::vector<float>> per_stage;
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp, Stage::fsdp}) {
    sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      auto net = mlp(ctx, 60 + static_cast<std::uint64_t>(comm.rank()));
      sk::parallel::ShardedModule model(ctx, comm, net, dp_test::config_for(OptimizerKind::adamw),
                                        options_for(stage));
      auto b = batch(ctx, {6, 12}, 7, comm.rank(), 0);
      ag::backward(ctx, ag::cross_entropy(ctx, model(ctx, b.x), b.labels));
      model.step(0.05f);
      ctx.memory_stats().reset_peak();
      const auto dict = model.state_dict();  // rank 0 only
      const auto everywhere = model.state_dict(/*rank0_only=*/false);
      CHECK(everywhere.size() == net->state_dict().size());
      if (stage == Stage::fsdp) {  // never more than the largest unit at a time
        std::int64_t largest = 0;
        const auto& engine = model.engine();
        for (std::size_t u = 0; u < engine.unit_count(); ++u)
          largest = std::max(largest, engine.group(u).plan().trainable_end());
        const auto peak = ctx.memory_stats().snapshot().peak_of(sk::MemoryCategory::communication);
        CHECK(peak > 0);
        CHECK(peak <= largest * 4);
      }
      const auto names = net->state_dict();
      const auto values_of = [&](const auto& entries) {
        std::vector<float> values;
        for (std::size_t i = 0; i < entries.size(); ++i) {
          const auto& [name, t] = entries[i];
          CHECK(name == names[i].first);  // the module's state-dict order
          CHECK(t.device().is_cpu());
          if (t.dtype() != sk::DType::f32) continue;
          const auto v = sk::to_vector<float>(ctx, t);
          values.insert(values.end(), v.begin(), v.end());
        }
        return values;
      };
      // Every rank's full dict: its parameters the same on every rank (gathered; each rank's
      // batch-norm statistics are its own batches', as under PyTorch's DDP), and on rank 0 all
      // of it the rank-0 dict's.
      const auto everywhere_values = values_of(everywhere);
      std::vector<float> params;
      for (const auto& [name, p] : net->named_parameters())
        for (const auto& [entry, t] : everywhere)
          if (entry == name) {
            const auto v = sk::to_vector<float>(ctx, t);
            params.insert(params.end(), v.begin(), v.end());
          }
      REQUIRE(params.size() > 0);
      std::vector<float> all(params.size() * 3);
      comm.all_gather(std::span<const float>(params), std::span<float>(all)).wait();
      for (int r = 0; r < 3; ++r)
        CHECK(std::equal(params.begin(), params.end(),
                         all.begin() + r * static_cast<std::ptrdiff_t>(params.size())));
      if (comm.rank() != 0) {
        CHECK(dict.empty());
        return;
      }
      REQUIRE(dict.size() == names.size());
      const auto values = values_of(dict);
      CHECK(dp_test::bitwise_equal(everywhere_values, values));
      per_stage.push_back(values);
    });
  }
  REQUIRE(per_stage.size() == 4);
  for (std::size_t s = 1; s < per_stage.size(); ++s) {
    CAPTURE(s);
    CHECK(dp_test::bitwise_equal(per_stage[s], per_stage[0]));
  }
}

// An empty parameter (a [0] bias, a layer of no outputs): ddp's sharded save wrote a piece of
// no elements that every later load refused ("does not hold elements [0, 0)"), and its state
// buffers, empty at any step, were refused after the first step ("has 0 values; expected 0").
TEST_CASE("a checkpoint of a model with an empty parameter loads, in every layout and stage") {
  auto specs = dp_test::model_specs();
  specs.insert(specs.begin() + 3, sk::shard::ParamSpec{"empty.bias", {0}});
  for (auto stage : {Stage::ddp, Stage::oss, Stage::sdp}) {
    for (auto layout : {CheckpointLayout::full, CheckpointLayout::sharded}) {
      const auto dir = scratch("empty_param");
      std::vector<sk::optim::OptimizerState> states(2);
      std::vector<std::vector<float>> params(2);  // rank 0's: saved, then loaded
      for (int load = 0; load < 2; ++load) {
        sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
          sk::parallel::ParallelOptions options;
          options.stage = stage;
          sk::parallel::DataParallel dp(ctx, comm, specs, dp_test::config_for(OptimizerKind::adamw),
                                        options);
          if (load == 0) {
            for (int s = 0; s < 2; ++s) {
              dp.zero_grad();
              dp_test::fake_backward(dp, ctx, comm.rank(), s);
              dp.finish();
              dp.step(0.05f);
            }
            sk::checkpoint::CheckpointOptions save;
            save.layout = layout;
            sk::checkpoint::save_checkpoint(dir.string(), dp.training_state(), save);
          } else {
            sk::checkpoint::load_checkpoint(dir.string(), dp.training_state());
          }
          auto state = dp.consolidate_optimizer_state(0);
          if (comm.rank() != 0) return;
          params[static_cast<std::size_t>(load)] = dp_test::all_params(dp, ctx);
          states[static_cast<std::size_t>(load)] = state;
          dp.load_optimizer_state(state);  // (a whole state after steps, into rank 0's share)
        });
      }
      CAPTURE(sk::parallel::stage_name(stage));
      CAPTURE(sk::checkpoint::checkpoint_layout_name(layout));
      CHECK(states[1].steps == 2);
      CHECK(same_state(states[1], states[0]));
      CHECK(dp_test::bitwise_equal(params[1], params[0]));
    }
  }
}

// A folder holding both layouts -- a save into it under the other layout cut short after its
// files were in place, before it removed the older ones -- loaded the shard files whatever
// they were. Now it is refused, naming both.
TEST_CASE("a checkpoint folder holding both layouts is refused by name") {
  const auto dir = scratch("both_layouts"), aside = scratch("both_layouts_aside");
  CheckpointJob job;
  job.where = {Stage::sdp, 2};
  job.save_to = dir.string();
  job.save.layout = CheckpointLayout::sharded;
  (void)run(job);
  for (const auto& entry : fs::directory_iterator(dir))
    fs::copy_file(entry.path(), aside / entry.path().filename());
  job.save.layout = CheckpointLayout::full;
  job.first_step = 3;
  (void)run(job);  // (removes the shard files once its own are in place)
  for (const auto& entry : fs::directory_iterator(aside))
    fs::copy_file(entry.path(), dir / entry.path().filename());
  CHECK_THROWS_WITH_AS(sk::checkpoint::CheckpointSource(dir.string()),
                       doctest::Contains("holds both a full checkpoint (model.safetensors) and "
                                         "shard files of a sharded one"),
                       sk::IoError);
}
