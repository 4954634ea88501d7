// backend.cu — the CUDA Backend (placeholder until the ops land).
#include "model/backend.h"
#include "util/error.h"

namespace dfl {
std::unique_ptr<Backend> make_cuda_backend(const Model&, DType, const MemoryPlan&) {
  fail("device 'cuda' requested but the CUDA forward is not implemented yet in this version; use device='cpu'");
}
}  // namespace dfl
