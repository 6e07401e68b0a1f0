// The shard layer: plans only -- parameter layouts, partitions, shard plans, the piece table and
// gradient bucket plans. Nothing here allocates device memory or talks to other ranks; the
// runtime that does (flat buffers, the gradient bucketer, the coalescer) is parallel/'s.
#pragma once

#include "shardkit/shard/bucket_plan.hpp"
#include "shardkit/shard/param_layout.hpp"
#include "shardkit/shard/partition.hpp"
#include "shardkit/shard/piece_table.hpp"
#include "shardkit/shard/shard_plan.hpp"
