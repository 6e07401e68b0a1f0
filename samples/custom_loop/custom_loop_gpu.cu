// The GPU path of the custom-loop sample: the training loop (train.hpp) instantiated for
// GpuDevice (mlp_gpu.cuh). nvcc compiles it; custom_loop.cpp calls it for --device gpu. The
// CPU MLP stays out of this file: under nvcc, Eigen would compile it without SIMD.
#include "mlp_gpu.cuh"
#include "train.hpp"

namespace custom_loop {

Results train_gpu(const Setup& setup) { return train<GpuDevice>(setup); }

}  // namespace custom_loop
