// matmul_float.cu — matmul kernel instances: F32, F16, BF16, Q4_0, Q8_0 (see matmul.cu).
#include "matmul_launch.cuh"

namespace dfl {
namespace cuda {
namespace kern {

DFL_MATMUL_LAUNCH(FmtF32);
DFL_MATMUL_LAUNCH(FmtF16);
DFL_MATMUL_LAUNCH(FmtBF16);
DFL_MATMUL_LAUNCH(FmtQ4_0);
DFL_MATMUL_LAUNCH(FmtQ8_0);

}  // namespace kern
}  // namespace cuda
}  // namespace dfl
