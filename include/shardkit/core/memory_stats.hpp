// Per-context memory accounting: current and peak bytes, in total and per category.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "shardkit/core/enum_names.hpp"

namespace shardkit {

// What an allocation holds. Memory claims (ZeRO stage savings, checkpointing) read these.
enum class MemoryCategory : std::uint8_t {
  parameters,
  gradients,
  optimizer_state,
  communication,  // bucket and staging buffers of collectives
  activations,
  other,
};

inline constexpr std::size_t kMemoryCategoryCount = 6;

inline constexpr MemoryCategory kAllMemoryCategories[kMemoryCategoryCount] = {
    MemoryCategory::parameters,    MemoryCategory::gradients,   MemoryCategory::optimizer_state,
    MemoryCategory::communication, MemoryCategory::activations, MemoryCategory::other};

inline constexpr EnumName<MemoryCategory> kMemoryCategoryNames[] = {
    {MemoryCategory::parameters, "parameters"},
    {MemoryCategory::gradients, "gradients"},
    {MemoryCategory::optimizer_state, "optimizer_state"},
    {MemoryCategory::communication, "communication"},
    {MemoryCategory::activations, "activations"},
    {MemoryCategory::other, "other"}};

constexpr std::string_view memory_category_name(MemoryCategory category) {
  return name_of(category, kMemoryCategoryNames);
}

// A copy of the counters at one moment.
struct MemorySnapshot {
  std::array<std::int64_t, kMemoryCategoryCount> current{};
  std::array<std::int64_t, kMemoryCategoryCount> peak{};
  std::int64_t current_total = 0;
  std::int64_t peak_total = 0;
  std::int64_t allocations = 0;  // number of live allocations

  std::int64_t current_of(MemoryCategory c) const { return current[static_cast<std::size_t>(c)]; }
  std::int64_t peak_of(MemoryCategory c) const { return peak[static_cast<std::size_t>(c)]; }
};

// Thread-safe counters (ranks are threads, and a communicator thread may free what a rank
// allocated). The per-category peak is the peak of that category alone; the total peak is the
// peak of the sum, which is what decides whether a job fits.
class MemoryStats {
 public:
  void on_allocate(MemoryCategory category, std::size_t bytes) {
    const auto index = static_cast<std::size_t>(category);
    const auto amount = static_cast<std::int64_t>(bytes);
    raise_peak(peak_[index], current_[index].fetch_add(amount) + amount);
    raise_peak(peak_total_, current_total_.fetch_add(amount) + amount);
    allocations_.fetch_add(1);
  }

  void on_free(MemoryCategory category, std::size_t bytes) {
    const auto amount = static_cast<std::int64_t>(bytes);
    current_[static_cast<std::size_t>(category)].fetch_sub(amount);
    current_total_.fetch_sub(amount);
    allocations_.fetch_sub(1);
  }

  // Starts a new measurement window: peaks drop to the current usage. (Raised again after the
  // store: an allocation of another thread between the load and the store would otherwise
  // leave the peak below what is in use.)
  void reset_peak() {
    for (std::size_t i = 0; i < kMemoryCategoryCount; ++i) {
      peak_[i].store(current_[i].load());
      raise_peak(peak_[i], current_[i].load());
    }
    peak_total_.store(current_total_.load());
    raise_peak(peak_total_, current_total_.load());
  }

  std::int64_t current(MemoryCategory c) const {
    return current_[static_cast<std::size_t>(c)].load();
  }
  std::int64_t peak(MemoryCategory c) const { return peak_[static_cast<std::size_t>(c)].load(); }
  std::int64_t current_total() const { return current_total_.load(); }
  std::int64_t peak_total() const { return peak_total_.load(); }

  MemorySnapshot snapshot() const {
    MemorySnapshot s;
    for (std::size_t i = 0; i < kMemoryCategoryCount; ++i) {
      s.current[i] = current_[i].load();
      s.peak[i] = peak_[i].load();
    }
    s.current_total = current_total_.load();
    s.peak_total = peak_total_.load();
    s.allocations = allocations_.load();
    return s;
  }

 private:
  static void raise_peak(std::atomic<std::int64_t>& peak, std::int64_t value) {
    std::int64_t seen = peak.load();
    while (value > seen && !peak.compare_exchange_weak(seen, value)) {
    }
  }

  std::array<std::atomic<std::int64_t>, kMemoryCategoryCount> current_{};
  std::array<std::atomic<std::int64_t>, kMemoryCategoryCount> peak_{};
  std::atomic<std::int64_t> current_total_{0};
  std::atomic<std::int64_t> peak_total_{0};
  std::atomic<std::int64_t> allocations_{0};
};

}  // namespace shardkit
