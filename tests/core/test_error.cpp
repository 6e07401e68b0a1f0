// Errors: the hierarchy, messages that name the thing and the fix, and the library check macros.
#include <doctest/doctest.h>

#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <string_view>

#include "shardkit/core/config.hpp"
#include "shardkit/core/error.hpp"

#if SK_WITH_CUDA
#include "shardkit/autograd/ranked_algorithms.hpp"
#include "shardkit/core/cublas_check.hpp"
#include "shardkit/core/cuda_check.hpp"
#include "shardkit/core/cudnn_check.hpp"
#include "shardkit/core/device.hpp"
#include "shardkit/core/nccl_check.hpp"
#endif

namespace sk = shardkit;

namespace {

template <class E, class Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  FAIL("expected an exception");
  return {};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("every shardkit exception is an sk::Error and a std::exception") {
  CHECK_THROWS_AS(sk::fail<sk::InvalidArgument>("x"), sk::Error);
  CHECK_THROWS_AS(sk::fail<sk::OutOfMemory>("x"), sk::Error);
  CHECK_THROWS_AS(sk::fail<sk::TimeoutError>("x"), sk::Error);
  CHECK_THROWS_AS(throw sk::CudaError("x", 1), sk::LibraryError);
  CHECK_THROWS_AS(sk::fail<sk::StateError>("x"), std::exception);
}

TEST_CASE("check() concatenates the message parts and throws the requested type") {
  CHECK_NOTHROW(sk::check(true, "never"));
  const auto text = message_of<sk::InvalidArgument>(
      [] { sk::check(false, "bucket size is ", 0, "; pass a positive number of bytes"); });
  CHECK(text == "bucket size is 0; pass a positive number of bytes");
  CHECK_THROWS_AS(sk::check<sk::StateError>(false, "late"), sk::StateError);
}

namespace {
struct Named {  // a type printed through an operator<< found by argument-dependent lookup
  int id;
  friend std::ostream& operator<<(std::ostream& out, const Named& n) { return out << "#" << n.id; }
};
enum class Colour { red = 2 };
std::ostream& operator<<(std::ostream& out, Colour) { return out << "red"; }
}  // namespace

TEST_CASE("a message prints its parts exactly as an ostream fold of them would") {
  // concat hands its parts to one out-of-line loop (error.hpp): the text must be the fold's, for
  // literals of every length, strings, characters, numbers, manipulators and user types.
  const std::string text = "str";
  const std::string_view view = "view";
  char buffer[8] = "buf";
  const char* pointer = "ptr";
  const std::int8_t small = 65;
  std::ostringstream fold;
  fold << "a" << text << view << buffer << pointer << 'c' << small << true << -7 << 3000000000LL
       << 1.5f << 2.0 / 3 << std::fixed << std::setprecision(2) << 2.0 / 3 << std::hex << 255
       << std::setw(6) << Named{4} << Colour::red << "";
  CHECK(sk::detail::concat("a", text, view, buffer, pointer, 'c', small, true, -7, 3000000000LL,
                           1.5f, 2.0 / 3, std::fixed, std::setprecision(2), 2.0 / 3, std::hex, 255,
                           std::setw(6), Named{4}, Colour::red, "") == fold.str());
  CHECK(sk::detail::concat() == "");
  const auto thrown = message_of<sk::IoError>([&] { sk::fail<sk::IoError>(view, ": ", Named{9}); });
  CHECK(thrown == "view: #9");
}

#ifndef NDEBUG
TEST_CASE("SK_ASSERT names the violated invariant and its place") {
  const auto text = message_of<sk::Error>([] { SK_ASSERT(1 + 1 == 3); });
  CHECK(contains(text, "1 + 1 == 3"));
  CHECK(contains(text, "test_error.cpp:"));
}
#endif

#if SK_WITH_CUDA
TEST_CASE("SK_CUDA_CHECK throws CudaError with place, call and CUDA's message") {
  CHECK_NOTHROW(SK_CUDA_CHECK(cudaSuccess));
  try {
    SK_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no throw");
  } catch (const sk::CudaError& e) {
    const std::string text = e.what();
    CHECK(e.code() == cudaErrorInvalidValue);
    CHECK(contains(text, "test_error.cpp:"));
    CHECK(contains(text, "`cudaErrorInvalidValue`"));
    CHECK(contains(text, "cudaErrorInvalidValue: invalid argument"));
  }
  // The check resets the runtime's last error: the next query is clean. (Without a driver every
  // runtime call answers "insufficient driver", so this can only be seen on a GPU machine.)
  if (shardkit::cuda_device_count() > 0) CHECK(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("SK_CUBLAS_CHECK, SK_CUDNN_CHECK and SK_NCCL_CHECK carry the library's status text") {
  const auto cublas =
      message_of<sk::CublasError>([] { SK_CUBLAS_CHECK(CUBLAS_STATUS_NOT_INITIALIZED); });
  CHECK(contains(cublas, "cuBLAS call `CUBLAS_STATUS_NOT_INITIALIZED` failed with status 1"));
  const auto cudnn = message_of<sk::CudnnError>([] { SK_CUDNN_CHECK(CUDNN_STATUS_BAD_PARAM); });
  CHECK(contains(cudnn, "CUDNN_STATUS_BAD_PARAM"));
  const auto nccl = message_of<sk::NcclError>([] { SK_NCCL_CHECK(ncclInvalidArgument); });
  CHECK(contains(nccl, "invalid argument"));
  CHECK_NOTHROW(SK_NCCL_CHECK(ncclInProgress));  // non-blocking communicators answer this
}

// A convolution plan's algorithms (autograd/ranked_algorithms.hpp), over cuDNN's status codes
// alone: the candidates drawn from a ranking, and a call that cuDNN refuses moving the plan on.
TEST_CASE("a convolution plan takes cuDNN's ranked algorithms in order, the next where one fails") {
  namespace cu = sk::autograd::cuda;
  struct Perf {  // cudnnConvolutionFwdAlgoPerf_t's fields that the choice reads
    int algo;
    cudnnStatus_t status;
    std::size_t memory;
    cudnnDeterminism_t determinism;
  };
  const Perf ranking[] = {
      {1, CUDNN_STATUS_SUCCESS, 64, CUDNN_NON_DETERMINISTIC},
      {2, CUDNN_STATUS_NOT_SUPPORTED, 0, CUDNN_DETERMINISTIC},  // did not run: left out
      {3, CUDNN_STATUS_SUCCESS, 32, CUDNN_DETERMINISTIC},
      {4, CUDNN_STATUS_SUCCESS, 1 << 20, CUDNN_DETERMINISTIC},  // over the limit
      {3, CUDNN_STATUS_SUCCESS, 16, CUDNN_DETERMINISTIC},       // again (another math type)
      {5, CUDNN_STATUS_SUCCESS, 8, CUDNN_DETERMINISTIC},        // refused by the descriptors
      {6, CUDNN_STATUS_SUCCESS, 8, CUDNN_DETERMINISTIC},
  };
  const auto workspace = [](int algo, std::size_t* bytes) {
    *bytes = algo == 6 ? 128 : 0;  // cuDNN's answer for the plan's own descriptors
    return algo == 5 ? CUDNN_STATUS_NOT_SUPPORTED : CUDNN_STATUS_SUCCESS;
  };
  using Pairs = std::vector<std::pair<int, std::size_t>>;
  // Deterministic ones only where asked (as torch.backends.cudnn.deterministic), unless the
  // ranking has none; each algorithm once, the larger workspace, within the limit.
  CHECK(cu::ranked_within_limit(ranking, 7, 4096, "forward", true, workspace).candidates ==
        Pairs{{3, 32}, {6, 128}});
  auto ranked = cu::ranked_within_limit(ranking, 7, 4096, "forward", false, workspace);
  CHECK(ranked.candidates == Pairs{{1, 64}, {3, 32}, {6, 128}});
  CHECK(cu::ranked_within_limit(ranking, 2, 4096, "forward", true, workspace).candidates ==
        Pairs{{1, 64}});
  CHECK_THROWS_AS(cu::ranked_within_limit(ranking, 2, 16, "forward", true, workspace),
                  sk::NotAvailable);

  // Refused at the call: the next candidate that the call takes, for good.
  std::vector<int> tried;
  const auto refuse_1 = [&](int algo, std::size_t bytes) {
    tried.push_back(algo);
    CHECK(bytes == (algo == 1 ? 64u : algo == 3 ? 32u : 128u));
    return algo == 1 ? CUDNN_STATUS_NOT_SUPPORTED_SHAPE : CUDNN_STATUS_SUCCESS;
  };
  cu::run_ranked(ranked, "cudnnConvolutionForward", false, refuse_1);
  CHECK(tried == std::vector<int>{1, 3});
  cu::run_ranked(ranked, "cudnnConvolutionForward", false, refuse_1);
  CHECK(tried == std::vector<int>{1, 3, 3});
  // A bad parameter is the caller's: thrown at once, the plan kept.
  tried.clear();
  const auto fail_with = [&](cudnnStatus_t status) {
    return [&tried, status](int algo, std::size_t) {
      tried.push_back(algo);
      return status;
    };
  };
  CHECK_THROWS_AS(
      cu::run_ranked(ranked, "cudnnConvolutionForward", false, fail_with(CUDNN_STATUS_BAD_PARAM)),
      sk::CudnnError);
  CHECK(tried == std::vector<int>{3});
  // Every candidate left failing: the first failure is thrown, the plan kept.
  tried.clear();
  const auto message = message_of<sk::CudnnError>([&] {
    cu::run_ranked(ranked, "cudnnConvolutionForward", false, [&](int algo, std::size_t) {
      tried.push_back(algo);
      return algo == 3 ? CUDNN_STATUS_EXECUTION_FAILED : CUDNN_STATUS_INTERNAL_ERROR;
    });
  });
  CHECK(tried == std::vector<int>{3, 6});
  CHECK(contains(message, "cudnnConvolutionForward"));
  CHECK(contains(message, "EXECUTION_FAILED"));
  CHECK(ranked.algo() == 3);
  // Inside a capture a failed launch spoils the capture: only "not supported" moves on.
  tried.clear();
  CHECK_THROWS_AS(cu::run_ranked(ranked, "cudnnConvolutionForward", true,
                                 fail_with(CUDNN_STATUS_EXECUTION_FAILED)),
                  sk::CudnnError);
  CHECK(tried == std::vector<int>{3});
  cu::run_ranked(ranked, "cudnnConvolutionForward", true, [](int algo, std::size_t) {
    return algo == 3 ? CUDNN_STATUS_NOT_SUPPORTED : CUDNN_STATUS_SUCCESS;
  });
  CHECK(ranked.algo() == 6);
}

TEST_CASE("a CUDA build refuses a GPU the machine does not have, naming the count and the fix") {
  const int count = sk::cuda_device_count();
  const auto text =
      message_of<sk::NotAvailable>([&] { sk::check_device_usable(sk::Device::cuda(count)); });
  CHECK(contains(text, "cuda:" + std::to_string(count)));
  CHECK(contains(text, std::to_string(count) + " usable CUDA GPU"));
  CHECK(contains(text, "Device::cpu()"));
  CHECK_NOTHROW(sk::check_device_usable(sk::Device::cpu()));
}
#endif
