// Allocators and memory statistics: alignment, current/peak per category, reset, failures; the
// mapped-file allocator (offload to NVMe).
#include <doctest/doctest.h>

#include <sys/vfs.h>
#include <unistd.h>
#include <cerrno>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "shardkit/core/allocator.hpp"
#include "shardkit/core/host_scratch.hpp"
#include "shardkit/core/mapped_file_allocator.hpp"
#include "shardkit/core/small_object_pool.hpp"
#include "shardkit/core/storage.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;
using sk::MemoryCategory;

TEST_CASE("host allocations are 64-byte aligned and counted per category") {
  sk::HostAllocator allocator;
  auto& stats = allocator.stats();
  void* params = allocator.allocate(1000, MemoryCategory::parameters);
  void* grads = allocator.allocate(3000, MemoryCategory::gradients);
  CHECK(reinterpret_cast<std::uintptr_t>(params) % 64 == 0);
  CHECK(reinterpret_cast<std::uintptr_t>(grads) % 64 == 0);
  CHECK(stats.current(MemoryCategory::parameters) == 1000);
  CHECK(stats.current(MemoryCategory::gradients) == 3000);
  CHECK(stats.current(MemoryCategory::optimizer_state) == 0);
  CHECK(stats.current_total() == 4000);
  CHECK(stats.peak_total() == 4000);

  allocator.deallocate(grads, 3000, MemoryCategory::gradients);
  CHECK(stats.current_total() == 1000);
  CHECK(stats.peak_total() == 4000);  // the peak remembers
  CHECK(stats.peak(MemoryCategory::gradients) == 3000);

  void* state = allocator.allocate(2000, MemoryCategory::optimizer_state);
  CHECK(stats.peak_total() == 4000);  // 3000 < 4000: no new peak
  CHECK(stats.snapshot().allocations == 2);

  stats.reset_peak();
  CHECK(stats.peak_total() == 3000);
  CHECK(stats.peak(MemoryCategory::gradients) == 0);
  CHECK(stats.peak(MemoryCategory::optimizer_state) == 2000);

  allocator.deallocate(state, 2000, MemoryCategory::optimizer_state);
  allocator.deallocate(params, 1000, MemoryCategory::parameters);
  CHECK(stats.current_total() == 0);
  CHECK(stats.snapshot().allocations == 0);
}

TEST_CASE("zero-byte allocations return nullptr and count nothing") {
  sk::HostAllocator allocator;
  CHECK(allocator.allocate(0, MemoryCategory::other) == nullptr);
  allocator.deallocate(nullptr, 0, MemoryCategory::other);
  CHECK(allocator.stats().snapshot().allocations == 0);
}

TEST_CASE("an impossible allocation throws OutOfMemory naming the size and category") {
  sk::HostAllocator allocator;
  try {
    allocator.allocate(std::size_t{1} << 62, MemoryCategory::activations);
    FAIL("no throw");
  } catch (const sk::OutOfMemory& e) {
    const std::string text = e.what();
    CHECK(text.find("4611686018427387904 bytes") != std::string::npos);
    CHECK(text.find("activations") != std::string::npos);
    CHECK(text.find("cpu") != std::string::npos);
  }
  CHECK(allocator.stats().current_total() == 0);
}

TEST_CASE("concurrent allocation from many threads keeps exact counts") {
  sk::HostAllocator allocator;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 2000; ++i) {
        const std::size_t bytes = 64 * static_cast<std::size_t>(1 + (i + t) % 7);
        void* p = allocator.allocate(bytes, MemoryCategory::communication);
        allocator.deallocate(p, bytes, MemoryCategory::communication);
      }
    });
  for (auto& thread : threads) thread.join();
  const auto snapshot = allocator.stats().snapshot();
  CHECK(snapshot.current_total == 0);
  CHECK(snapshot.allocations == 0);
  CHECK(snapshot.peak_of(MemoryCategory::communication) >= 64);
  CHECK(snapshot.peak_total <= 4 * 7 * 64);
}

TEST_CASE("storage frees through its allocator; borrowed storage is neither freed nor counted") {
  auto allocator = std::make_shared<sk::HostAllocator>();
  {
    sk::Storage storage(allocator, 512, MemoryCategory::parameters);
    CHECK(storage.owns_memory());
    CHECK(allocator->stats().current(MemoryCategory::parameters) == 512);
  }
  CHECK(allocator->stats().current_total() == 0);
  std::vector<float> mine(16, 1.0f);
  auto borrowed = sk::Storage::borrow(mine.data(), mine.size() * sizeof(float), sk::Device::cpu());
  CHECK_FALSE(borrowed->owns_memory());
  CHECK(borrowed->data() == mine.data());
}

TEST_CASE("released storage gives its bytes back, refuses access with the reason, comes back") {
  auto allocator = std::make_shared<sk::HostAllocator>();
  auto storage = std::make_shared<sk::Storage>(allocator, 1024, MemoryCategory::communication);
  storage->release("unit 'layer1' is not gathered; call gather() first");
  CHECK(storage->released());
  CHECK(allocator->stats().current(MemoryCategory::communication) == 0);
  CHECK(allocator->stats().peak(MemoryCategory::communication) == 1024);
  CHECK_THROWS_WITH_AS((void)storage->data(), doctest::Contains("unit 'layer1' is not gathered"),
                       sk::StateError);
  storage->release("twice is harmless");
  storage->materialize();
  CHECK_FALSE(storage->released());
  CHECK(storage->data() != nullptr);
  CHECK(allocator->stats().current(MemoryCategory::communication) == 1024);
  storage->release("freed again before destruction");
  storage.reset();  // the destructor must not free twice
  CHECK(allocator->stats().current_total() == 0);

  std::vector<float> mine(4, 1.0f);
  auto borrowed = sk::Storage::borrow(mine.data(), mine.size() * sizeof(float), sk::Device::cpu());
  CHECK_THROWS_AS(borrowed->release("x"), sk::StateError);
}

TEST_CASE("the host allocator caches freed small blocks for their next use, within its bound") {
  sk::HostAllocator allocator(std::size_t{64} << 10);
  using C = sk::MemoryCategory;
  void* first = allocator.allocate(30000, C::communication);
  allocator.deallocate(first, 30000, C::communication);
  CHECK(allocator.stats().current(C::communication) == 0);  // cached is not in use
  CHECK(allocator.cached_bytes() == 32768);                 // (4 KiB granules)
  void* again = allocator.allocate(29000, C::gradients);    // the same rounded size
  CHECK(again == first);
  CHECK(allocator.cached_bytes() == 0);
  allocator.deallocate(again, 29000, C::gradients);
  // Below 4 KiB by their size rounded up to 64 bytes (a tiny op's output every step).
  void* small = allocator.allocate(1000, C::other);
  CHECK(reinterpret_cast<std::uintptr_t>(small) % sk::HostAllocator::kAlignment == 0);
  allocator.deallocate(small, 1000, C::other);
  CHECK(allocator.cached_bytes() == 32768 + 1024);
  CHECK(allocator.allocate(1010, C::activations) == small);  // the same 64-byte class
  void* other_class = allocator.allocate(1030, C::activations);
  CHECK(other_class != small);
  allocator.deallocate(other_class, 1030, C::activations);
  allocator.deallocate(small, 1010, C::activations);
  CHECK(allocator.cached_bytes() == 32768 + 1024 + 1088);
  CHECK(allocator.stats().current_total() == 0);
  CHECK(allocator.segment_bytes_held() == 0);  // (all below the segments' 64 KiB)
  // Beyond the bound, frees go to the system.
  void* more = allocator.allocate(40000, C::other);
  allocator.deallocate(more, 40000, C::other);
  CHECK(allocator.cached_bytes() == 32768 + 2112);  // + 40 KiB would pass the 64 KiB bound
  allocator.release_cached();
  CHECK(allocator.cached_bytes() == 0);
}

TEST_CASE("the host allocator carves large blocks out of segments: best fit, split, merged") {
  constexpr std::size_t MiB = std::size_t{1} << 20;
  using C = sk::MemoryCategory;
  sk::HostAllocator allocator(std::size_t{1} << 30);
  char* a = static_cast<char*>(allocator.allocate(3 * MiB, C::activations));
  CHECK(allocator.segment_bytes_held() == sk::HostAllocator::kSegmentBytes);
  CHECK(allocator.cached_bytes() == sk::HostAllocator::kSegmentBytes - 3 * MiB);
  CHECK(allocator.stats().current_total() == std::int64_t(3 * MiB));
  char* b = static_cast<char*>(allocator.allocate(5 * MiB - 100, C::activations));
  CHECK(b == a + 3 * MiB);  // the rest of the segment, split again
  allocator.deallocate(a, 3 * MiB, C::activations);
  // The smallest free block that holds 2 MiB is a's 3 MiB, not the segment's tail.
  char* c = static_cast<char*>(allocator.allocate(2 * MiB, C::gradients));
  CHECK(c == a);
  char* d = static_cast<char*>(allocator.allocate(MiB, C::gradients));
  CHECK(d == a + 2 * MiB);  // what c left of a's block
  allocator.deallocate(c, 2 * MiB, C::gradients);
  allocator.deallocate(b, 5 * MiB - 100, C::activations);
  allocator.deallocate(d, MiB, C::gradients);
  // Merged back into one free block, the whole segment: a request of its size takes it.
  CHECK(allocator.cached_bytes() == sk::HostAllocator::kSegmentBytes);
  CHECK(allocator.allocate(sk::HostAllocator::kSegmentBytes, C::other) == a);
  CHECK(allocator.segment_bytes_held() == sk::HostAllocator::kSegmentBytes);
  allocator.deallocate(a, sk::HostAllocator::kSegmentBytes, C::other);

  // A step's forward frees blocks of some sizes, its backward asks for others: the freed blocks
  // serve them (a cache by exact size would hold both sets). 8 blocks of 3, 5, ..., 17 MiB,
  // freed, then 8 of 10 MiB: no segment more.
  std::vector<void*> forward, backward;
  for (std::size_t i = 0; i < 8; ++i)
    forward.push_back(allocator.allocate((3 + 2 * i) * MiB, C::activations));
  const std::size_t held = allocator.segment_bytes_held();
  for (std::size_t i = 0; i < 8; ++i)
    allocator.deallocate(forward[i], (3 + 2 * i) * MiB, C::activations);
  for (std::size_t i = 0; i < 8; ++i)
    backward.push_back(allocator.allocate(10 * MiB, C::gradients));
  CHECK(allocator.segment_bytes_held() == held);
  CHECK(held <= 2 * sk::HostAllocator::kSegmentBytes);
  for (void* p : backward) allocator.deallocate(p, 10 * MiB, C::gradients);
  // A block beyond the segment size is a segment of its own; release_cached() gives back every
  // wholly free segment.
  void* huge = allocator.allocate(100 * MiB, C::other);
  CHECK(allocator.segment_bytes_held() == held + 100 * MiB);
  allocator.deallocate(huge, 100 * MiB, C::other);
  allocator.release_cached();
  CHECK(allocator.segment_bytes_held() == 0);
  CHECK(allocator.cached_bytes() == 0);

  // Within the bound: a segment wholly free once more than max_cached could go back goes back.
  // The free blocks of a segment still in use do not count against it (they cannot go back):
  // small blocks are still cached beside them.
  sk::HostAllocator bounded(8 * MiB);
  void* e = bounded.allocate(3 * MiB, C::other);
  void* small = bounded.allocate(1000, C::other);
  bounded.deallocate(small, 1000, C::other);
  CHECK(bounded.cached_bytes() == sk::HostAllocator::kSegmentBytes - 3 * MiB + 1024);
  CHECK(bounded.allocate(1000, C::other) == small);
  bounded.deallocate(small, 1000, C::other);
  bounded.deallocate(e, 3 * MiB, C::other);
  CHECK(bounded.segment_bytes_held() == 0);
  CHECK(bounded.cached_bytes() == 1024);
}

TEST_CASE("the host allocator's blocks never overlap, under random sizes and frees") {
  using C = sk::MemoryCategory;
  sk::HostAllocator allocator;
  std::mt19937 random(7);
  struct Held {
    unsigned char* data;
    std::size_t bytes;
    unsigned char mark;
  };
  std::vector<Held> live;
  std::int64_t peak = 0;
  for (int i = 0; i < 4000; ++i) {
    const std::uint32_t r = random();
    if (live.empty() || r % 2 != 0) {  // (a random walk: some tens of blocks live at a time)
      const std::size_t bytes = random() % 2 ? 1 + random() % (6 << 20)  // segments' blocks
                                             : 1 + random() % 70000;     // both kinds
      auto* data = static_cast<unsigned char*>(allocator.allocate(bytes, C::other));
      REQUIRE(reinterpret_cast<std::uintptr_t>(data) % sk::HostAllocator::kAlignment == 0);
      const auto mark = static_cast<unsigned char>(i);
      std::memset(data, mark, bytes);
      live.push_back({data, bytes, mark});
      peak = std::max(peak, allocator.stats().current_total());
    } else {
      const std::size_t k = random() % live.size();
      const Held h = live[k];
      // Every byte still as written: no other block was handed out over it.
      CHECK(std::count(h.data, h.data + h.bytes, h.mark) == std::int64_t(h.bytes));
      allocator.deallocate(h.data, h.bytes, C::other);
      live[k] = live.back();
      live.pop_back();
    }
  }
  for (const Held& h : live) {
    CHECK(std::count(h.data, h.data + h.bytes, h.mark) == std::int64_t(h.bytes));
    allocator.deallocate(h.data, h.bytes, C::other);
  }
  CHECK(allocator.stats().current_total() == 0);
  CHECK(allocator.segment_bytes_held() <= std::size_t(2 * peak) + sk::HostAllocator::kSegmentBytes);
  allocator.release_cached();
  CHECK(allocator.segment_bytes_held() == 0);
}

TEST_CASE("make_pooled objects reuse the blocks their thread's earlier ones gave back") {
  struct Payload {
    std::int64_t values[20];
  };
  if (!sk::detail::kPoolSmallObjects) return;  // (AddressSanitizer: the pool is bypassed)
  std::vector<const void*> first;
  {
    std::vector<std::shared_ptr<Payload>> held;
    for (int i = 0; i < 8; ++i) held.push_back(sk::make_pooled<Payload>());
    for (const auto& p : held) first.push_back(p.get());
  }
  // The eight blocks are back in this thread's free list and the next eight are those.
  std::vector<std::shared_ptr<Payload>> again;
  for (int i = 0; i < 8; ++i) again.push_back(sk::make_pooled<Payload>());
  for (const auto& p : again)
    CHECK(std::find(first.begin(), first.end(), static_cast<const void*>(p.get())) != first.end());

  // An object freed on another thread goes to that thread's list (which gives its blocks back to
  // the heap when the thread ends). The block is the object with its reference counts.
  using Pool = sk::detail::SmallObjectPool;
  const std::size_t block = sizeof(Payload) + 16;  // (libstdc++'s in-place control block)
  auto shared = sk::make_pooled<Payload>();
  shared->values[19] = 42;
  std::size_t kept_before = 0, kept_after = 0;
  std::thread([&, moved = std::move(shared)]() mutable {
    CHECK(moved->values[19] == 42);
    kept_before = Pool::kept(block);
    moved.reset();
    kept_after = Pool::kept(block);
  }).join();
  CHECK(kept_after == kept_before + 1);
}

// Offload to NVMe's memory (core/mapped_file_allocator.hpp): unnamed files in a directory,
// counted like any allocator, written back and dropped from RAM on request, read back intact.
TEST_CASE("a mapped-file allocator's memory is unnamed files, spilled out of RAM and read back") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("shardkit_mapped_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto files = std::make_shared<sk::MappedFileAllocator>(dir.string());
  sk::ContextOptions options;
  options.allocator = files;
  sk::Context ctx(options);
  {
    const sk::Tensor t = sk::empty(ctx, {(1 << 20) + 7}, sk::DType::f32);  // 4 MiB and a bit
    sk::uniform_(ctx, t, -1.0, 1.0);
    const auto before = sk::to_vector<float>(ctx, t);
    CHECK(ctx.memory_stats().snapshot().current_total == static_cast<std::int64_t>(t.nbytes()));
    CHECK(files->resident_bytes(t.data_ptr(), t.nbytes()) >= t.nbytes());
    // A piece from inside a page to inside another: written back, dropped, read back the same.
    files->spill(static_cast<const char*>(t.data_ptr()) + 1000, 2'000'000, false);
    files->spill(t.data_ptr(), t.nbytes(), true);
    struct statfs fs {};
    REQUIRE(::statfs(dir.c_str(), &fs) == 0);
    const bool tmpfs = fs.f_type == 0x01021994;  // (its pages are the file: never dropped)
    if (!tmpfs)
      CHECK(files->resident_bytes(t.data_ptr(), t.nbytes()) < t.nbytes() / 16);
    else
      MESSAGE("the temporary directory is tmpfs: RAM residency not checked");
    // Loaded back whole before load() returns (Linux 5.14's MADV_POPULATE_*; where the kernel
    // refuses them, load() only starts the read-ahead and says so), for writing and for
    // reading, and dropped again.
    for (const bool for_writing : {true, false}) {
      files->load(t.data_ptr(), t.nbytes(), for_writing);
      if (files->loads_whole())
        CHECK(files->resident_bytes(t.data_ptr(), t.nbytes()) >= t.nbytes());
      else
        MESSAGE("MADV_POPULATE_* refused here: load() only starts the read-ahead");
      files->spill(t.data_ptr(), t.nbytes(), true);
      if (!tmpfs) CHECK(files->resident_bytes(t.data_ptr(), t.nbytes()) < t.nbytes() / 16);
    }
    CHECK(sk::to_vector<float>(ctx, t) == before);
    // Unnamed: nothing to clean up in the directory, even after a crash.
    CHECK(std::filesystem::is_empty(dir));
  }
  CHECK(ctx.memory_stats().snapshot().current_total == 0);
  {
    // A failed write-back (injected: EIO) is the file's for good. Linux reports it once and may
    // leave the pages that failed clean, so a later spill would succeed and drop them, and the
    // state would read back as what the disk held before: every later spill() and load() of the
    // file fails instead, and drop_clean() keeps its pages. Another file is unaffected.
    const sk::Tensor t = sk::empty(ctx, {1 << 18}, sk::DType::f32);
    const sk::Tensor other = sk::empty(ctx, {1 << 18}, sk::DType::f32);
    sk::uniform_(ctx, t, -1.0, 1.0);
    sk::uniform_(ctx, other, -1.0, 1.0);
    const auto before = sk::to_vector<float>(ctx, t);
    files->inject_write_back_error(EIO);
    CHECK_THROWS_WITH_AS(files->spill(t.data_ptr(), t.nbytes(), true),
                         doctest::Contains("failed (Input/output error)"), sk::IoError);
    CHECK_THROWS_WITH_AS(files->spill(t.data_ptr(), t.nbytes(), true),
                         doctest::Contains("failed earlier (Input/output error)"), sk::IoError);
    CHECK_THROWS_WITH_AS(files->load(t.data_ptr(), 4096), doctest::Contains("failed earlier"),
                         sk::IoError);
    files->drop_clean(t.data_ptr(), t.nbytes());
    CHECK(files->resident_bytes(t.data_ptr(), t.nbytes()) >= t.nbytes());
    CHECK(sk::to_vector<float>(ctx, t) == before);
    files->spill(other.data_ptr(), other.nbytes(), true);  // (its own file: no error)
    files->load(other.data_ptr(), other.nbytes());
  }
  CHECK(ctx.memory_stats().snapshot().current_total == 0);
  CHECK_THROWS_WITH_AS(sk::MappedFileAllocator((dir / "missing").string()),
                       doctest::Contains("is not a directory"), sk::InvalidArgument);
  std::filesystem::remove_all(dir);
}

TEST_CASE("HostScratch frames hand out distinct arrays and take them back when they end") {
  double* outer_array = nullptr;
  {
    sk::HostScratch outer;
    outer_array = outer.doubles(100);
    CHECK(std::all_of(outer_array, outer_array + 100, [](double v) { return v == 0.0; }));
    std::fill_n(outer_array, 100, 7.0);
    {
      sk::HostScratch inner;  // a kernel called from a kernel: the next buffers, not the outer's
      float* inner_array = inner.uninitialised<float>(1000);
      CHECK(reinterpret_cast<std::uintptr_t>(inner_array) % 64 == 0);
      std::fill_n(inner_array, 1000, -1.0f);
      CHECK(static_cast<void*>(inner_array) != static_cast<void*>(outer_array));
    }
    CHECK(std::all_of(outer_array, outer_array + 100, [](double v) { return v == 7.0; }));
  }
  sk::HostScratch next;  // the frame ended: its buffer serves the next frame's first array
  CHECK(next.doubles(50) == outer_array);
}

TEST_CASE("HostScratch refuses a count whose bytes wrap, and the frame stays usable") {
  sk::HostScratch scratch;
  const std::size_t wrapping = std::numeric_limits<std::size_t>::max() / sizeof(double) + 2;
  CHECK_THROWS_AS(scratch.uninitialised<double>(wrapping), std::bad_array_new_length);
  double* values = scratch.doubles(8);
  values[7] = 1.5;
  CHECK(values[7] == 1.5);
}
