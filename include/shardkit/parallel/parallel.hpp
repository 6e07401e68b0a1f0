// The parallel layer: one Engine under every ZeRO stage (engine.hpp) -- DDP, OSS (ZeRO-1), SDP
// (ZeRO-2) as one param group, FSDP (ZeRO-3) as one group per unit -- for custom training loops
// (DataParallel, FsdpEngine) and for nn::Module (ShardedModule); the options (options.hpp),
// resolved once (policy.hpp); the memory planner; SyncBatchNorm.
#pragma once

#include "shardkit/parallel/data_parallel.hpp"
#include "shardkit/parallel/engine.hpp"
#include "shardkit/parallel/engine_contract.hpp"
#include "shardkit/parallel/fsdp_engine.hpp"
#include "shardkit/parallel/memory_plan.hpp"
#include "shardkit/parallel/options.hpp"
#include "shardkit/parallel/param_rows.hpp"
#include "shardkit/parallel/policy.hpp"
#include "shardkit/parallel/sharded_module.hpp"
#include "shardkit/parallel/stage.hpp"
#include "shardkit/parallel/sync_batch_norm.hpp"
