// The shard layer: flat parameter buffers, partitions, shard plans, gradient buckets.
#pragma once

#include "shardkit/shard/bucket_plan.hpp"
#include "shardkit/shard/flat_buffer.hpp"
#include "shardkit/shard/grad_bucketer.hpp"
#include "shardkit/shard/param_layout.hpp"
#include "shardkit/shard/partition.hpp"
#include "shardkit/shard/piece_table.hpp"
#include "shardkit/shard/shard_plan.hpp"
