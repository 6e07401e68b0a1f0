// The data layer: IDX files and Fashion-MNIST, and the stateful distributed sampler (resumable
// mid-epoch). Depends on core only.
#pragma once

#include "shardkit/data/fashion_mnist.hpp"
#include "shardkit/data/idx_file.hpp"
#include "shardkit/data/stateful_sampler.hpp"
