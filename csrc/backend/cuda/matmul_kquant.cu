// matmul_kquant.cu — matmul kernel instances: Q4_K, Q5_K, Q6_K (see matmul.cu).
#include "matmul_launch.cuh"

namespace dfl {
namespace cuda {
namespace kern {

DFL_MATMUL_LAUNCH(FmtQ4_K);
DFL_MATMUL_LAUNCH(FmtQ5_K);
DFL_MATMUL_LAUNCH(FmtQ6_K);

}  // namespace kern
}  // namespace cuda
}  // namespace dfl
