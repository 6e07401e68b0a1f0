// Fused ops on the CPU against float64 references (the cases are shared with test_ops_gpu.cu).
#include "cpu_backend.hpp"

namespace ops_test {
using Backend = CpuBackend;
}  // namespace ops_test

#include "ops_test_list.hpp"
