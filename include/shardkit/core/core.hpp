// The core layer: configuration, errors, dtypes, devices, memory accounting, tensors, contexts.
#pragma once

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/config.hpp"
#include "shardkit/core/context.hpp"
#include "shardkit/core/deferred_init.hpp"
#include "shardkit/core/device.hpp"
#include "shardkit/core/dtype.hpp"
#include "shardkit/core/error.hpp"
#include "shardkit/core/float16.hpp"
#include "shardkit/core/memory_stats.hpp"
#include "shardkit/core/philox.hpp"
#include "shardkit/core/step_graph.hpp"
#include "shardkit/core/storage.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/core/tensor_ops.hpp"
