// The host API in a plain g++ translation unit: only -I include and the host libraries (Eigen,
// zlib, nlohmann-json), no CUDA headers, no test framework. A CPU tensor round trip must work there
// (CPU-only use is a real use).
#include <shardkit/shardkit.hpp>

#include <Eigen/Core>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#if SK_WITH_CUDA || defined(__CUDA_RUNTIME_H__) || defined(CUDART_VERSION)
#error "the host API pulled in CUDA in a plain host build"
#endif

namespace sk = shardkit;

#define EXPECT(cond)                                                          \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: failed: %s\n", __FILE__, __LINE__, #cond); \
      return 1;                                                               \
    }                                                                         \
  } while (0)

// A pool whose threads cannot all start throws, after joining those that did: before, the error
// left the constructor with joinable threads, which terminates the process. A child process
// whose address space is capped a little above what it maps already cannot give 256 threads
// their stacks. (Here, without OpenMP, the pool starts threads of its own. Not under the
// sanitizers: their shadow memory needs the address space.) 0 when it holds.
int thread_start_failure_is_an_error() {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return 0;
#else
  const pid_t child = ::fork();
  if (child < 0) return 1;
  if (child == 0) {
    long pages = 0;
    if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(statm, "%ld", &pages) != 1) pages = 0;
      std::fclose(statm);
    }
    const auto mapped = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
    const rlimit cap{mapped + (64u << 20), mapped + (64u << 20)};
    if (pages == 0 || ::setrlimit(RLIMIT_AS, &cap) != 0) ::_exit(5);
    try {
      sk::ThreadPool pool(256);
      ::_exit(2);  // (every thread started: the cap did not bite)
    } catch (const sk::StateError& e) {
      ::_exit(std::string(e.what()).find("of a pool of 256") != std::string::npos ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  int status = 0;
  if (::waitpid(child, &status, 0) != child) return 1;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
  std::fprintf(stderr, "the capped child's wait status: %d\n", status);
  return 1;
#endif
}

int main() {
  EXPECT(thread_start_failure_is_an_error() == 0);
  sk::Context ctx({.seed = 2024});
  std::vector<float> values(4 * 5);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = 0.25f * static_cast<float>(i) - 2.0f;

  // host vector -> tensor -> strided view -> contiguous copy -> host vector
  auto t = sk::from_vector(ctx, values, {4, 5}, sk::MemoryCategory::parameters);
  {
    auto transposed = sk::contiguous(ctx, t.transpose(0, 1));
    auto back = sk::to_vector<float>(ctx, transposed);
    for (int r = 0; r < 4; ++r)
      for (int c = 0; c < 5; ++c)
        EXPECT(back[static_cast<std::size_t>(c * 4 + r)] ==
               values[static_cast<std::size_t>(r * 5 + c)]);

    // f32 -> bf16 -> f32 keeps these values (they need few mantissa bits).
    auto round_trip = sk::cast(ctx, sk::cast(ctx, t, sk::DType::bf16), sk::DType::f32);
    EXPECT(sk::to_vector<float>(ctx, round_trip) == values);
    // Copies made from t are counted under t's category while they live.
    EXPECT(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 80 + 80 + 80);
  }

  // Tensor memory maps onto Eigen without copies.
  Eigen::Map<const Eigen::Matrix<float, 4, 5, Eigen::RowMajor>> matrix(t.data<float>());
  EXPECT(matrix(2, 3) == values[13]);

  sk::uniform_(ctx, t, 0.0, 1.0);
  EXPECT(ctx.memory_stats().current(sk::MemoryCategory::parameters) == 80);
  EXPECT(!sk::cuda_available());

  std::printf("host-only round trip ok\n");
  return 0;
}
