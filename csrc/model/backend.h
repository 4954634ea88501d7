// backend.h — the small op interface the one forward runs on.
//
// forward.cpp owns the layer loop and every decision about state (which KV
// slot a token writes, which state a tree node starts from); a Backend owns
// memory and does arithmetic.  Pointers passed to ops are the backend's own
// memory (host memory for the CPU backend, device memory for CUDA), except the
// host-side `Weight` / norm-vector handles, which the backend maps to its copy
// of the model (`weight()` / `vec()`).  Every op computes a token's result from
// that token's inputs alone (batch invariance); ops are issued in order and
// may run asynchronously until `download` or `sync`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/qwen35.h"
#include "util/threadpool.h"

namespace dfl {

enum class Device { CPU = 0, CUDA = 1 };

// The part of a batch one chunk of the forward needs on the backend: token
// ids, positions, and for every token which KV slots it attends to — a
// contiguous prefix [0, n_prefix[t]) then `extra_count[t]` more slots listed
// in `extra_slots` from `extra_begin[t]`, ascending (a tree node's ancestors
// and itself) — and for delta-net layers which state each token starts from
// (`parent[t]`: -1 = the committed state, else an earlier token of the chunk).
struct ChunkPlan {
  int n = 0;
  bool commit = true;  // chain appended to the committed state (else: verify, states kept per node)
  std::vector<int32_t> tokens, pos, n_prefix, extra_begin, extra_count, extra_slots, parent;
  int max_visible = 0;  // max over t of n_prefix + extra_count
};

// Arguments of the attention-layer ops (one layer, one chunk).
struct AttnLayer {
  uint8_t* k_cache;  // n_ctx rows of kv_row bytes (kv_type, n_head_kv * head_dim values)
  uint8_t* v_cache;
  int slot0;         // KV slot of the chunk's first token
  const float* q_norm;  // backend vectors (head_dim)
  const float* k_norm;
};

// Arguments of the gated delta-net op (one layer, one chunk).
struct GdnLayer {
  const float* conv1d;  // [Cconv][K] backend vector
  const float* dt_bias, *ssm_a, *ssm_norm;
  float* conv;          // committed conv window [(K-1)][Cconv]
  float* rec;           // committed recurrent state [nv][dk][dv]
  float* node_conv;     // verify: per chunk token, its own window / state after it
  float* node_rec;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Device device() const = 0;
  virtual std::string name() const = 0;

  // ---- memory ----
  virtual void* alloc(size_t bytes) = 0;  // zero-filled, 64-byte aligned
  virtual void release(void* p) = 0;
  virtual void upload(void* dst, const void* host, size_t bytes) = 0;
  virtual void download(void* host, const void* src, size_t bytes) = 0;  // waits for the ops before it
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void sync() = 0;

  // The backend's copy of a model weight / f32 vector (host handle -> backend pointer).
  virtual const void* weight(const Weight& w) = 0;
  virtual const float* vec(const std::vector<float>& v) = 0;

  // ---- ops ----
  // Uploads what the chunk's ops read (ids, positions, visibility, parents).
  virtual void begin_chunk(const ChunkPlan& plan) = 0;
  // x[t] = row tokens[t] of the embedding table, as f32.
  virtual void embed(const Weight& table, float* x) = 0;
  // y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, n rows of dim (in place allowed).
  virtual void rmsnorm(const float* x, const float* w, int n, int dim, float eps, float* y) = 0;
  // y[t][r] = W[r] . x[t].
  virtual void matmul(const Weight& W, const float* x, int n, float* y) = 0;
  // x += y over count values.
  virtual void add(float* x, const float* y, size_t count) = 0;
  // g = silu(g) * u over count values.
  virtual void swiglu(float* g, const float* u, size_t count) = 0;
  // Per chunk token: each q head of qg ([q | gate] per head) and each k head
  // of kk gets its RMSNorm and NeoX RoPE at the token's position; K and V
  // rows are written (converted to kv_type) to slot0 + t.
  virtual void attn_store(float* qg, float* kk, const float* vv, const AttnLayer& L) = 0;
  // o[t] = softmax over the token's visible slots of q.k / sqrt(hd), times V,
  // times sigmoid(gate): n_head heads of head_dim, GQA over n_head_kv.
  virtual void attention(const float* qg, const AttnLayer& L, float* o) = 0;
  // Gated delta-net core per chunk token, in order: conv1d over the window of
  // the token's starting state (then SiLU), L2-norm of q/k heads, the delta
  // rule per value head, gated RMSNorm with silu(z).  mm: [n][Cconv] conv
  // inputs (scratch afterwards), z: [n][Cv], beta/alpha: [n][nv] raw, y: [n][Cv] out.
  virtual void gdn(float* mm, const float* z, const float* beta, const float* alpha, const GdnLayer& L,
                   float* y) = 0;
};

// The worker threads are the context's (the CPU backend computes on them; a
// CUDA context keeps them for the CPU-side drafter).
std::unique_ptr<Backend> make_cpu_backend(const Model& m, DType kv_type, ThreadPool& pool);
// Bytes a context needs on its device, by part (printed before loading, and
// checked against the device's free memory).
struct MemoryPlan {
  uint64_t weights = 0, kv = 0, recurrent = 0, tree_state = 0, workspace = 0;
  uint64_t total() const { return weights + kv + recurrent + tree_state + workspace; }
};
struct ContextParams;
// Verify nodes the plan reserves tree state for (DDTree's default budget 22 +
// root, with room): larger trees allocate more when they first run.
constexpr int kPlanVerifyNodes = 32;
MemoryPlan memory_plan(const Model& m, const ContextParams& p, int max_nodes);

// Uploads the model's weights once per Model (shared by its CUDA contexts)
// after checking `plan` against the device's free memory.  Fails with a clear
// message when CUDA is not built, no device is usable, or the plan does not fit.
std::unique_ptr<Backend> make_cuda_backend(const Model& m, DType kv_type, const MemoryPlan& plan);

}  // namespace dfl
