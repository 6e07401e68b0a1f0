// HybridMesh: the world's ranks as a 2-D grid for hybrid sharding (PyTorch FSDP's HYBRID_SHARD,
// DeepSpeed's hpZ / MiCS): rows of `group_size` consecutive ranks -- a node, as launchers place
// ranks node after node -- shard the model states among themselves; the ranks at the same
// position of every row hold the same shard, and only they talk across rows.
//
//   world rank w = g * G + s:   shard()     = row g, rank s (G ranks: all-gathers, reduce-scatters)
//                               replicate() = column s, rank g (N / G ranks: the shard's
//                                             gradient all-reduce, the only inter-row traffic)
//
// With one row (G = N) there is no replicate communicator and hybrid sharding is plain
// sharding over the world; with G = 1 every rank keeps everything (DDP's memory).
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/thread_pool.hpp"

namespace shardkit::comm {

// The shard group's size the launch environment implies: the processes on this node
// (OMPI_COMM_WORLD_LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE, MPICH's MPI_LOCALNRANKS, then
// SLURM_NTASKS_PER_NODE), or `world_size` when none is set (one node: plain sharding).
inline int hybrid_group_size_from_launch(int world_size) {
  int local = launcher_local_processes();
  if (local == 1) {
    if (const char* text = std::getenv("SLURM_NTASKS_PER_NODE"); text != nullptr) {
      char* end = nullptr;
      const long value = std::strtol(text, &end, 10);  // "4" or SLURM's "4(x2)"
      if (end != text && value >= 1 && value <= 65536) local = static_cast<int>(value);
    }
  }
  return local > 1 ? local : world_size;
}

class HybridMesh {
 public:
  // Collective over `world`: every rank passes the same group_size, a divisor of the world
  // size. `world` must outlive the mesh.
  HybridMesh(Communicator& world, int group_size) : world_(&world), group_size_(group_size) {
    const bool valid =
        group_size >= 1 && group_size <= world.size() && world.size() % group_size == 0;
    // The ranks first agree on the size, so that every rank refuses a size that is wrong on
    // one of them (a launch variable that differs between nodes) instead of some refusing while
    // the others wait in the splits below, or build rows of other sizes: a split by the size
    // itself holds the whole world only if every rank passed the same valid one.
    const auto agreed = world.split(valid ? group_size : 0, world.rank());
    check(valid, "hybrid sharding: a shard group of ", group_size,
          " ranks does not divide the world of ", world.size(), " ranks; pass a divisor of ",
          world.size(), " (the ranks of one node, e.g. ",
          hybrid_group_size_from_launch(world.size()), ")");
    check(agreed->size() == world.size(), "hybrid sharding: rank ", world.rank(),
          " passed a shard group of ", group_size, " ranks but only ", agreed->size(), " of the ",
          world.size(),
          " ranks did (or another rank's size is not a divisor); pass the same "
          "group size on every rank");
    const int row = world.rank() / group_size, column = world.rank() % group_size;
    shard_ = world.split(row, world.rank());
    replicate_ = world.split(column, world.rank());
    if (replicate_->size() == 1) replicate_.reset();
  }

  Communicator& world() const { return *world_; }
  // The ranks this rank shards the model states with (its row).
  Communicator& shard() const { return *shard_; }
  // The ranks that hold the same shard (its column); nullptr when the mesh has one row.
  Communicator* replicate() const { return replicate_.get(); }

  int group_size() const { return group_size_; }
  int group_count() const { return world_->size() / group_size_; }
  int group_index() const { return world_->rank() / group_size_; }

 private:
  Communicator* world_;
  int group_size_;
  std::unique_ptr<Communicator> shard_;
  std::unique_ptr<Communicator> replicate_;
};

}  // namespace shardkit::comm
