// The io layer: datasets (IDX / Fashion-MNIST) and the stateful distributed sampler.
#pragma once

#include "shardkit/io/fashion_mnist.hpp"
#include "shardkit/io/idx_file.hpp"
#include "shardkit/io/stateful_sampler.hpp"
