// The data layer: labelled images in memory (IDX files and Fashion-MNIST, synthetic images),
// the stateful distributed sampler (resumable mid-epoch) and a run's position in it. Depends on
// core only. The image file readers (image_decode.hpp, image_folder.hpp) are not included here:
// they need libjpeg and libpng at link time, which a program that reads no image files should not
// need.
#pragma once

#include "shardkit/data/fashion_mnist.hpp"
#include "shardkit/data/idx_file.hpp"
#include "shardkit/data/image_dataset.hpp"
#include "shardkit/data/stateful_sampler.hpp"
#include "shardkit/data/synthetic_images.hpp"
#include "shardkit/data/training_position.hpp"
