// The comm layer: the Communicator interface, the local (threads), MPI (with SHARDKIT_WITH_MPI)
// and NCCL (with CUDA) backends, run_ranks, launch detection, make_communicator and the hybrid
// sharding mesh.
#pragma once

#include "shardkit/comm/bootstrap.hpp"
#include "shardkit/comm/buffer.hpp"
#include "shardkit/comm/comm_stats.hpp"
#include "shardkit/comm/communicator.hpp"
#include "shardkit/comm/hybrid_mesh.hpp"
#include "shardkit/comm/launch.hpp"
#include "shardkit/comm/local_communicator.hpp"
#include "shardkit/comm/mpi_communicator.hpp"
#include "shardkit/comm/mpi_session.hpp"
#include "shardkit/comm/nccl_communicator.hpp"
#include "shardkit/comm/recorder_dump.hpp"
#include "shardkit/comm/reduction.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/comm/work.hpp"
