// The parallel layer: DDP, OSS (ZeRO-1), SDP (ZeRO-2) for custom training loops (DataParallel)
// and for nn::Module (ShardedModule); FSDP (ZeRO-3) for custom loops (FsdpEngine) and through
// ShardedModule (Fsdp).
#pragma once

#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/fsdp.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/parallel/stage.hpp"
#include "shardkit/parallel/sync_batch_norm.hpp"
