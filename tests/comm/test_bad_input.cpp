// Bad input: mismatches between ranks (caught by the local backend when the last rank posts),
// and what each rank can check alone (root, sizes, dtypes, aliasing): clear errors that name
// the call, the rank and the sizes; never memory corruption.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace sk = shardkit;
namespace comm = shardkit::comm;

namespace {

// Runs `call` on every rank of a local world and returns each rank's error message ("" if none).
std::vector<std::string> errors_of(
    int n, const std::function<void(sk::Context&, comm::Communicator&)>& call) {
  std::vector<std::string> messages(static_cast<std::size_t>(n));
  comm::run_ranks(n, [&](sk::Context& ctx, comm::Communicator& c) {
    try {
      call(ctx, c);
    } catch (const sk::InvalidArgument& e) {
      messages[static_cast<std::size_t>(c.rank())] = e.what();
    }
    // The communicator stays usable after a rejected call.
    std::vector<float> one{1.0f};
    c.all_reduce(one).wait();
    CHECK(one[0] == static_cast<float>(c.size()));
  });
  return messages;
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("mismatched counts, dtypes, roots, ops and calls between ranks fail on every rank") {
  SUBCASE("count") {
    const auto errors = errors_of(3, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> data(c.rank() == 1 ? 1001 : 1000, 1.0f);
      c.all_reduce(data).wait();
    });
    for (const auto& e : errors) {
      CAPTURE(e);
      CHECK(contains(e, "all_reduce #0"));
      CHECK(contains(e, "rank 1 passed a count of 1001 but rank 0 passed 1000"));
    }
  }
  SUBCASE("dtype") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f);
      std::vector<double> d(10, 1.0);
      if (c.rank() == 0)
        c.broadcast(f, 0).wait();
      else
        c.broadcast(d, 0).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "rank 1 passed dtype f64 but rank 0 passed f32"));
  }
  SUBCASE("root") {
    const auto errors = errors_of(4, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f);
      c.broadcast(f, c.rank() == 3 ? 1 : 0).wait();
    });
    for (const auto& e : errors) CHECK(contains(e, "rank 3 passed root 1 but rank 0 passed 0"));
  }
  SUBCASE("op") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f);
      c.all_reduce(f, c.rank() == 0 ? comm::ReduceOp::sum : comm::ReduceOp::max).wait();
    });
    for (const auto& e : errors) CHECK(contains(e, "rank 1 passed op max but rank 0 passed sum"));
  }
  SUBCASE("call") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f), g(20);
      if (c.rank() == 0)
        c.all_reduce(f).wait();
      else
        c.all_gather(f, g).wait();
    });
    for (const auto& e : errors) {
      CHECK(contains(e, "rank 1 passed the call all_gather but rank 0 passed all_reduce"));
      CHECK(contains(e, "same order"));
    }
  }
  SUBCASE("per-owner counts") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f);
      const std::vector<std::size_t> counts =
          c.rank() == 0 ? std::vector<std::size_t>{4, 6} : std::vector<std::size_t>{5, 5};
      c.all_gather_v(f, counts).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "rank 1 passed counts [5, 5] but rank 0 passed [4, 6]"));
  }
}

// Two FSDP units of the same size gather in the same shape: only what issued the calls (the
// communicator's label) tells one rank's unit 1 from another's unit 2. With the order check on,
// the local backend compares the labels too, as MPI's fingerprint does; without it the calls
// meet (nothing in their shapes differs).
TEST_CASE("with the order check, a same-shape call issued for another unit fails on every rank") {
  for (const bool check : {true, false}) {
    CAPTURE(check);
    comm::RunRanksOptions options;
    options.comm.validate_order = check;
    std::vector<std::string> messages(2);
    comm::run_ranks(
        2,
        [&](sk::Context&, comm::Communicator& c) {
          std::vector<float> f(10, 1.0f);
          try {
            auto label = c.label(c.rank() == 0 ? "unit 1's gather" : "unit 2's gather");
            c.all_reduce(f).wait();
          } catch (const sk::InvalidArgument& e) {
            messages[static_cast<std::size_t>(c.rank())] = e.what();
          }
          auto label = c.label("unit 3's gather");  // the same label on both: met
          std::vector<float> one{1.0f};
          c.all_reduce(one).wait();
          CHECK(one[0] == 2.0f);
        },
        options);
    for (const auto& e : messages) {
      CAPTURE(e);
      if (check)
        CHECK(
            contains(e, "rank 1 issued it for 'unit 2's gather' but rank 0 for 'unit 1's gather'"));
      else
        CHECK(e.empty());
    }
  }
}

TEST_CASE("what one rank can check is rejected at the call, naming the rank and sizes") {
  SUBCASE("root out of range") {
    const auto errors = errors_of(4, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> f(10, 1.0f);
      c.broadcast(f, 4).wait();
    });
    for (int r = 0; r < 4; ++r) {
      const auto& e = errors[static_cast<std::size_t>(r)];
      CHECK(contains(
          e, "broadcast on rank " + std::to_string(r) + " of 4 (local): root 4 is out of range"));
      CHECK(contains(e, "[0, 4)"));
    }
  }
  SUBCASE("a count whose total over the ranks wraps") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<std::uint8_t> bytes(16);
      // (never touched: the calls are refused before they move anything)
      const comm::Buffer huge(bytes.data(), std::size_t{1} << 63, sk::DType::u8);
      const comm::Buffer small(bytes);
      bool gather_refused = false;
      try {
        c.all_gather(huge, small).wait();
      } catch (const sk::InvalidArgument& e) {
        gather_refused = contains(e.what(),
                                  "send.count = 9223372036854775808 times 2 ranks "
                                  "overflows");
      }
      CHECK(gather_refused);
      std::vector<float> floats(4);
      const comm::Buffer huge_floats(floats.data(), std::size_t{1} << 63, sk::DType::f32);
      c.reduce_scatter(comm::Buffer(floats), huge_floats).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "recv.count = 9223372036854775808 times 2 ranks overflows"));
  }
  SUBCASE("all_gather output too small") {
    const auto errors = errors_of(3, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> send(10, 1.0f), recv(29);
      c.all_gather(send, recv).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "recv holds 29 f32 elements but needs size() x send.count = 30"));
  }
  SUBCASE("reduce_scatter input too small") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<double> send(15, 1.0), recv(8);
      c.reduce_scatter(send, recv).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "send holds 15 f64 elements but needs size() x recv.count = 16"));
  }
  SUBCASE("all_reduce output too small, dtype or device differ") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> send(10, 1.0f), small(9);
      std::vector<double> other(10);
      CHECK_THROWS_WITH_AS(c.all_reduce(send, small).wait(),
                           doctest::Contains("recv holds 9 f32 elements but needs send.count = 10"),
                           sk::InvalidArgument);
      CHECK_THROWS_WITH_AS(c.all_reduce(send, other).wait(),
                           doctest::Contains("recv is f64 but the data is f32"),
                           sk::InvalidArgument);
      comm::Buffer on_gpu(other.data(), 10, sk::DType::f32, sk::Device::cuda(0));
      c.all_reduce(send, on_gpu).wait();
    });
    for (const auto& e : errors) CHECK(contains(e, "recv is on cuda:0 but the data is on cpu"));
  }
  SUBCASE("per-owner counts of the wrong length or beyond the buffer") {
    const auto errors = errors_of(3, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> data(10, 1.0f);
      const std::vector<std::size_t> two{5, 5};
      CHECK_THROWS_WITH_AS(c.all_gather_v(data, two).wait(),
                           doctest::Contains("2 counts given for 3 ranks"), sk::InvalidArgument);
      const std::vector<std::size_t> big{4, 4, 4};
      c.reduce_scatter_v(data, data, big).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "send holds 10 f32 elements but the counts add up to 12"));
  }
  SUBCASE("per-owner counts whose sum wraps past 2^64") {
    // (the sum wrapped to 2, which a buffer of 4 passed; the gather then copied ~2^64 bytes)
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> data(4, 1.0f);
      const std::vector<std::size_t> counts{SIZE_MAX, 3};
      c.all_gather_v(data, counts).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "data holds 4 f32 elements but the counts add up to more than 2^64"));
  }
  SUBCASE("overlapping buffers other than the in-place forms") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> data(40, 1.0f);
      comm::Buffer whole(data);
      CHECK_THROWS_WITH_AS(c.all_reduce(whole.slice(0, 20), whole.slice(10, 20)).wait(),
                           doctest::Contains("send and recv partly overlap"), sk::InvalidArgument);
      // all_gather in place must use this rank's own segment
      const std::size_t wrong = c.rank() == 0 ? 10 : 0;
      c.all_gather(whole.slice(wrong, 10), whole.slice(0, 20)).wait();
    });
    for (const auto& e : errors)
      CHECK(contains(e, "send overlaps recv but is not this rank's segment"));
  }
  SUBCASE("all_to_all_v: a recv smaller than size() x counts[rank], or overlapping send") {
    const auto errors = errors_of(2, [](sk::Context&, comm::Communicator& c) {
      std::vector<float> data(40, 1.0f), small(9, 0.0f);
      const std::vector<std::size_t> counts{5, 5};
      bool refused_small = false;
      try {
        c.all_to_all_v(comm::Buffer(data).slice(0, 10), small, counts).wait();
      } catch (const sk::InvalidArgument& e) {
        refused_small = contains(e.what(),
                                 "recv holds 9 f32 elements but needs size() x "
                                 "counts[rank] = 10");
      }
      CHECK(refused_small);
      comm::Buffer whole(data);
      c.all_to_all_v(whole.slice(0, 10), whole.slice(5, 10), counts).wait();
    });
    REQUIRE(errors.size() == 2);
    for (const auto& e : errors) CHECK(contains(e, "all_to_all_v on rank"));
    for (const auto& e : errors) CHECK(contains(e, "send and recv overlap"));
  }
  SUBCASE("unsupported dtype and non-contiguous tensors") {
    const auto errors = errors_of(2, [](sk::Context& ctx, comm::Communicator& c) {
      std::vector<std::int32_t> ints(4, 1);
      CHECK_THROWS_WITH_AS(c.all_reduce(ints).wait(),
                           doctest::Contains("dtype i32 is not supported"), sk::InvalidArgument);
      auto t = sk::zeros(ctx, {4, 6}, sk::DType::f32);
      c.all_reduce(t.transpose(0, 1)).wait();
    });
    for (const auto& e : errors) CHECK(contains(e, "non-contiguous"));
  }
}
