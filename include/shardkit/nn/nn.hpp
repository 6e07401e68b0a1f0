// The module layer: Module, layers, Sequential with checkpointed segments, the MLP head, the
// trunks (ResNet, RegNet, EfficientNet).
#pragma once

#include "shardkit/nn/activation_checkpoint.hpp"
#include "shardkit/nn/deferred_init.hpp"
#include "shardkit/nn/efficientnet.hpp"
#include "shardkit/nn/init.hpp"
#include "shardkit/nn/layers.hpp"
#include "shardkit/nn/module.hpp"
#include "shardkit/nn/regnet.hpp"
#include "shardkit/nn/resnet.hpp"
#include "shardkit/nn/sequential.hpp"
#include "shardkit/nn/trunk.hpp"
