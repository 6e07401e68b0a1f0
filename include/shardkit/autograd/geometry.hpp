// The shapes a convolution and a max-pool are given, on either device: what the autograd
// functions compute and the device tables' entries (device_table.hpp) take.
#pragma once

#include <cstdint>

namespace shardkit::autograd {

// Geometry of a 2-D convolution (NCHW input, OIHW weight). A grouped convolution (groups > 1,
// ResNeXt's) splits the input and output channels into `groups` equal runs, output run g reading
// input run g alone: its weight is [out_channels, in_channels / groups, kh, kw].
struct ConvGeometry {
  std::int64_t batch = 0, in_channels = 0, height = 0, width = 0;
  std::int64_t out_channels = 0, kernel_h = 0, kernel_w = 0;
  std::int64_t stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0, dilation_h = 1, dilation_w = 1;
  std::int64_t out_h = 0, out_w = 0;
  std::int64_t groups = 1;

  // The values one output channel reads: a row of the weight.
  std::int64_t patch() const { return in_channels / groups * kernel_h * kernel_w; }
  // One group's convolution (the same image, a group's channels).
  ConvGeometry per_group() const {
    ConvGeometry one = *this;
    one.in_channels = in_channels / groups;
    one.out_channels = out_channels / groups;
    one.groups = 1;
    return one;
  }
  std::int64_t out_plane() const { return out_h * out_w; }
  bool is_pointwise() const {
    return kernel_h == 1 && kernel_w == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 &&
           pad_w == 0;
  }
};

namespace cpu {
// Geometry of a 2-D max-pool window (the name is historical: the CUDA table takes it too).
struct PoolGeometry {
  std::int64_t kernel_h = 1, kernel_w = 1, stride_h = 1, stride_w = 1, pad_h = 0, pad_w = 0;
};
}  // namespace cpu

}  // namespace shardkit::autograd
