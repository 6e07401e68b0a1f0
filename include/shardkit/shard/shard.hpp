// The shard layer: flat parameter buffers, partitions of parameters over ranks, flat splits.
#pragma once

#include "shardkit/shard/flat_buffer.hpp"
#include "shardkit/shard/flat_split.hpp"
#include "shardkit/shard/param_layout.hpp"
#include "shardkit/shard/partition.hpp"
