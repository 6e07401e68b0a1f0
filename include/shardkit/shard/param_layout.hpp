// ParamLayout: where each parameter of a model lives inside one flat buffer (name, shape,
// offset, numel, trainable), with every parameter's start aligned for vector loads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardkit/core/tensor.hpp"

namespace shardkit::shard {

struct ParamSpec {
  std::string name;  // PyTorch-style state-dict name, e.g. "layer1.0.conv1.weight"
  Shape shape;
  bool trainable = true;
};

struct ParamSlot {
  std::string name;
  Shape shape;
  std::int64_t offset = 0;  // first element inside the flat buffer
  std::int64_t numel = 0;
  bool trainable = true;
};

class ParamLayout {
 public:
  // Parameters are laid out in the given (registration) order; each starts at a multiple of
  // `alignment` elements (16 f32 = 64 bytes by default) so kernels can use 16-byte loads.
  explicit ParamLayout(const std::vector<ParamSpec>& specs, std::int64_t alignment = 16)
      : alignment_(alignment) {
    check(alignment > 0, "ParamLayout alignment must be > 0 elements, got ", alignment);
    slots_.reserve(specs.size());
    std::int64_t offset = 0;
    for (const auto& spec : specs) {
      check_spec(spec, slots_.size());
      const auto [it, inserted] = index_.emplace(spec.name, slots_.size());
      check(inserted, "parameter name '", spec.name, "' appears twice (#", it->second, " and #",
            slots_.size(), "); names must be unique");
      const std::int64_t numel = shape_numel(spec.shape);
      slots_.push_back(ParamSlot{spec.name, spec.shape, offset, numel, spec.trainable});
      offset += round_up(numel);
      if (spec.trainable) trainable_numel_ += numel;
      numel_ += numel;
    }
    padded_numel_ = offset;
  }

  // Explicit placement: parameter i starts at offsets[i]; the buffer holds `total` elements.
  // Parameters must not overlap or run past `total` (a ShardPlan reorders and pads this way).
  ParamLayout(const std::vector<ParamSpec>& specs, const std::vector<std::int64_t>& offsets,
              std::int64_t total, std::int64_t alignment)
      : alignment_(alignment) {
    check(specs.size() == offsets.size(), "ParamLayout: ", specs.size(), " parameters but ",
          offsets.size(), " offsets");
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const auto& spec = specs[i];
      check_spec(spec, i);
      const auto [it, inserted] = index_.emplace(spec.name, i);
      check(inserted, "parameter name '", spec.name, "' appears twice (#", it->second, " and #", i,
            "); names must be unique");
      const std::int64_t numel = shape_numel(spec.shape);
      slots_.push_back(ParamSlot{spec.name, spec.shape, offsets[i], numel, spec.trainable});
      numel_ += numel;
      if (spec.trainable) trainable_numel_ += numel;
    }
    std::vector<const ParamSlot*> by_offset;
    for (const auto& slot : slots_) by_offset.push_back(&slot);
    // (An empty parameter shares its offset with the next one: it sorts first there.)
    std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) {
      return a->offset != b->offset ? a->offset < b->offset : a->numel < b->numel;
    });
    std::int64_t end = 0;
    for (const auto* slot : by_offset) {
      check(slot->offset >= end, "ParamLayout: parameter '", slot->name, "' at offset ",
            slot->offset, " overlaps the parameter before it (which ends at ", end, ")");
      end = slot->offset + slot->numel;
    }
    check(end <= total, "ParamLayout: parameters reach element ", end, " beyond the total ", total);
    padded_numel_ = total;
  }

  std::size_t size() const { return slots_.size(); }
  const ParamSlot& operator[](std::size_t i) const { return slots_[i]; }
  const std::vector<ParamSlot>& slots() const { return slots_; }
  std::int64_t alignment() const { return alignment_; }
  std::int64_t numel() const { return numel_; }  // sum of parameter sizes
  std::int64_t trainable_numel() const { return trainable_numel_; }
  std::int64_t padded_numel() const { return padded_numel_; }  // flat buffer length

  std::size_t index_of(const std::string& name) const {
    const auto it = index_.find(name);
    check(it != index_.end(), "no parameter named '", name, "' in this layout of ", size(),
          " parameters");
    return it->second;
  }

  // Element counts per parameter, in layout order (what partitioners take).
  std::vector<std::int64_t> sizes() const {
    std::vector<std::int64_t> out;
    out.reserve(slots_.size());
    for (const auto& slot : slots_) out.push_back(slot.numel);
    return out;
  }

  // A fingerprint of names, shapes and flags: ranks compare it to catch a parameter list that
  // differs between ranks before any collective goes wrong.
  std::uint64_t fingerprint() const {
    std::uint64_t hash = 1469598103934665603ull;  // FNV-1a
    auto mix = [&](std::uint64_t value) {
      for (int byte = 0; byte < 8; ++byte) {
        hash ^= (value >> (8 * byte)) & 0xff;
        hash *= 1099511628211ull;
      }
    };
    for (const auto& slot : slots_) {
      for (unsigned char c : slot.name) mix(c);
      for (auto d : slot.shape) mix(static_cast<std::uint64_t>(d));
      mix(slot.trainable ? 1 : 2);
    }
    mix(static_cast<std::uint64_t>(alignment_));
    return hash;
  }

  // Parameter #i's name is set and no dimension of its shape is negative.
  static void check_spec(const ParamSpec& spec, std::size_t i) {
    check(!spec.name.empty(), "parameter #", i, " has an empty name");
    for (auto d : spec.shape)
      check(d >= 0, "parameter '", spec.name, "' has a negative size in shape ",
            shape_text(spec.shape));
  }

 private:
  std::int64_t round_up(std::int64_t n) const {
    return (n + alignment_ - 1) / alignment_ * alignment_;
  }

  std::int64_t alignment_;
  std::vector<ParamSlot> slots_;
  std::unordered_map<std::string, std::size_t> index_;
  std::int64_t numel_ = 0;
  std::int64_t trainable_numel_ = 0;
  std::int64_t padded_numel_ = 0;
};

}  // namespace shardkit::shard
