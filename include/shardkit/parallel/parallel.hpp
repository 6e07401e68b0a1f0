// The parallel layer: DDP, OSS (ZeRO-1) and SDP (ZeRO-2) for custom training loops.
#pragma once

#include "shardkit/parallel/data_parallel.hpp"
