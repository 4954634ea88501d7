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
#include <utility>
#include <vector>

#include "model/qwen35.h"
#include "util/threadpool.h"

namespace dfl {

enum class Device { CPU = 0, CUDA = 1 };

// The part of a batch one chunk of the forward needs on the backend: token
// ids, positions, and for every token which KV slots it attends to — a
// contiguous prefix [0, n_prefix[t]) then `extra_count[t]` more slots listed
// in `extra_slots` from `extra_begin[t]` (a tree node's ancestors and itself,
// ascending; tokens that see the same slots may share one range) — and for delta-net layers which state each token starts from
// (`parent[t]`: -1 = the committed state, else an earlier token of the chunk).
struct ChunkPlan {
  int n = 0;
  bool commit = true;  // chain appended to the committed state (else: verify, states kept per node)
  std::vector<int32_t> tokens, pos, n_prefix, extra_begin, extra_count, extra_slots, parent;
  int max_visible = 0;  // max over t of n_prefix + extra_count
  // Token t's K/V rows go to slot kv_slot0 + t.  A plan value, not a kernel argument, so that an AR
  // step's launches are the same bytes every step (what lets the CUDA backend replay them as a graph).
  int32_t kv_slot0 = 0;
};

// Shape of an attention layer: the target's gated attention (q rows per head
// [q | gate], output times sigmoid(gate)) or the drafter's plain one (q rows
// per head [q]); RoPE (NeoX, maybe scaled) on the first rope.n_rot dims of q and k heads.
struct AttnShape {
  int n_head = 0, n_head_kv = 0, head_dim = 0;
  RopeSpec rope;  // NeoX over the first rope.n_rot dims (model/rope.h)
  float eps = 0.f;
  bool gated = false;
  DType kv_type = DType::F32;  // K/V cache rows: n_head_kv * head_dim values of this type
  int q_stride() const { return (gated ? 2 : 1) * head_dim; }
};

// Arguments of the attention-layer ops (one layer, one chunk).
struct AttnLayer {
  AttnShape s;
  uint8_t* k_cache;  // rows of row_bytes(kv_type, n_head_kv * head_dim) bytes
  uint8_t* v_cache;  // token t's rows go to slot ChunkPlan::kv_slot0 + t
  const float* q_norm;  // backend vectors (head_dim)
  const float* k_norm;
};

// What a verified node's delta-net update was, per layer, so that commit
// rebuilds the accepted node's state from the committed one instead of
// keeping every node's whole state (150 MiB per node for Qwen3.5-27B): a
// node's recurrent update is rank one per value head, S' = decay S + k delta^T,
// and its conv window is its parent's shifted by one input row.  Per node,
// `stride` floats: [xin: Cconv conv inputs | k: nk*dk L2-normalised keys |
// delta: nv*dv, beta (v - (decay S)^T k) | decay: nv, exp(g)].
struct GdnNodeLayout {
  size_t xin = 0, k = 0, delta = 0, decay = 0, stride = 0;
  explicit GdnNodeLayout(const Qwen35Config& c)
      : xin(0), k((size_t)c.conv_channels()), delta(k + (size_t)c.ssm_nk * c.ssm_dk),
        decay(delta + (size_t)c.ssm_nv * c.ssm_dv), stride(decay + (size_t)c.ssm_nv) {}
};

// Arguments of the gated delta-net op (one layer, one chunk).
struct GdnLayer {
  const float* conv1d;  // [Cconv][K] backend vector
  const float* dt_bias, *ssm_a, *ssm_norm;
  float* conv;          // committed conv window [(K-1)][Cconv] (f32)
  void* rec;            // committed recurrent state [nv][dk][dv] of state_type
  // verify only (null when committing): every chunk token's window and state
  // after it — scratch, shared by all layers, read by the token's children —
  // and its update [n][GdnNodeLayout::stride], kept per layer for commit.
  // node_rec must hold at least the state of the last node; those of the nodes a
  // child other than the next in the walk starts from (`node_rec_kept`) it holds
  // unless the backend keeps them elsewhere through the op (CUDA: the CTA's shared
  // memory while they fit); the others may stay unwritten (the CPU keeps a chain's
  // states in cache).
  // node_conv is scratch a backend may use for the windows (the CPU reads each
  // token's window from its ancestors' inputs instead and leaves it untouched).
  float* node_conv;
  void* node_rec;       // [n][nv][dk][dv] of state_type
  float* node_upd;
  // F32, BF16 or F16: the state is rounded to it after every token (chain or
  // tree alike), computed in f32.
  DType state_type;
};

// The order the delta-net's serial walk takes a verify's tokens in: depth-first, children in batch order (a
// preorder: parents still come first).  A token that follows its parent in the walk starts from the state in
// hand; any other reloads its parent's state from node_rec, where the parent had to write it.  Preorder
// reloads only after a leaf: a best-first DDTree's own order (the builder's) had a 23-node tree on the synthetic
// 0.8B reload 13 states and write 6, preorder 8 and 1, and its CPU verify took 8% less time.  Each token's
// arithmetic is the same in any order.  Identity for a chain; a token of parent -1 starts from the committed
// state wherever it comes.
inline std::vector<int32_t> gdn_walk_order(const int32_t* parent, int n) {
  std::vector<std::vector<int32_t>> kids((size_t)n);  // in batch order
  for (int u = 0; u < n; ++u)
    if (parent[u] >= 0) kids[(size_t)parent[u]].push_back(u);
  std::vector<int32_t> order, stack;
  order.reserve((size_t)n);
  for (int r = 0; r < n; ++r) {
    if (parent[r] >= 0) continue;
    for (stack.push_back(r); !stack.empty();) {
      const int u = stack.back();
      stack.pop_back();
      order.push_back(u);
      stack.insert(stack.end(), kids[(size_t)u].rbegin(), kids[(size_t)u].rend());  // the first child next
    }
  }
  return order;
}

// The verify nodes whose states GdnLayer::node_rec must hold: the last node and every node a child other than
// the node after it in the walk (gdn_walk_order's) starts from.
inline std::vector<uint8_t> node_rec_kept(const int32_t* parent, const std::vector<int32_t>& walk) {
  const int n = (int)walk.size();
  std::vector<uint8_t> keep(n, 0);
  if (n > 0) keep[n - 1] = 1;
  for (int v = 1; v < n; ++v) {
    const int u = walk[(size_t)v];
    if (parent[u] >= 0 && parent[u] != walk[(size_t)v - 1]) keep[parent[u]] = 1;
  }
  return keep;
}

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
  // `rows` rows of `row_bytes`, src rows src_pitch bytes apart, host rows host_pitch apart (one transfer).
  virtual void download_rows(void* host, size_t host_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                             size_t rows) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // `rows` rows of `row_bytes` within backend memory, with their own pitches.
  virtual void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                         size_t rows) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  virtual void sync() = 0;

  // The backend's copy of a model weight / f32 vector (host handle -> backend pointer).
  virtual const void* weight(const Weight& w) = 0;
  virtual const float* vec(const std::vector<float>& v) = 0;
  // Makes more host tensors (address, bytes) reachable through weight()/vec():
  // the drafter's.  Uploaded once per `owner` while a backend of it lives.
  virtual void add_weights(const void* owner, const std::vector<std::pair<const void*, size_t>>& tensors) = 0;

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
  // x += y (n rows of dim), then out = rmsnorm(x) with w: a sublayer's residual and the next norm in one op
  // where a backend can fuse them (CUDA: one pass over x); the same bits as add then rmsnorm.
  virtual void add_rmsnorm(float* x, const float* y, const float* w, int n, int dim, float eps, float* out) {
    add(x, y, (size_t)n * dim);
    rmsnorm(x, w, n, dim, eps, out);
  }
  // x *= s over count values.
  virtual void scale(float* x, float s, size_t count) = 0;
  // g = silu(g) * u over count values.
  virtual void swiglu(float* g, const float* u, size_t count) = 0;
  // DFlash2's grouped dynamic causal convolution over one draft block of n rows of width H, groups of H / G
  // channels, T taps: out[i][c] = sum over t < T of (base[side][t][c] + delta[i][side][t][c / (H / G)]) * u[i - t][c],
  // rows before the block's first as zero.  base [2][T][H] is a backend vector, delta [n][2][T][G] the
  // kernel projection's output; per element the coefficient is summed first, then the taps in order t = 0..T-1.
  virtual void grouped_conv(const float* u, const float* base, const float* delta, int side, int n, int H, int T,
                            int G, float* out) = 0;
  // Per chunk token: each q head of qg and each k head of kk gets its RMSNorm
  // and NeoX RoPE at the token's position; K and V rows are written
  // (converted to kv_type) to the plan's kv_slot0 + t.  n_head may be 0 (K/V only).
  virtual void attn_store(float* qg, float* kk, const float* vv, const AttnLayer& L) = 0;
  // o[t] = softmax over the token's visible slots of q.k / sqrt(hd), times V
  // (times sigmoid(gate) when gated): n_head heads of head_dim, GQA over n_head_kv.
  virtual void attention(const float* qg, const AttnLayer& L, float* o) = 0;
  // Gated delta-net core per chunk token, in order: conv1d over the window of
  // the token's starting state (then SiLU), L2-norm of q/k heads, the delta
  // rule per value head, gated RMSNorm with silu(z).  mm: [n][Cconv] conv
  // inputs (scratch afterwards), z: [n][Cv], beta/alpha: [n][nv] raw, y: [n][Cv] out.
  virtual void gdn(float* mm, const float* z, const float* beta, const float* alpha, const GdnLayer& L,
                   float* y) = 0;
  // The accepted path of the last verify, for the commit ops that follow
  // (kv_commit, gdn_commit): m verify nodes, root first, path[k] >= k; node i's
  // K/V are in slot base + i.  A plan value like ChunkPlan (host array, copied):
  // on CUDA it goes to the device, so a commit's launches are the same bytes
  // whatever the path.
  virtual void begin_commit(const int32_t* path, int m, int32_t base) = 0;
  // The path's K/V rows to consecutive slots: slot base + k <- slot base +
  // path[k], k ascending (a row is read before any later move overwrites it).
  virtual void kv_commit(uint8_t* k_cache, uint8_t* v_cache, size_t kv_row) = 0;
  // Commit of the path in one delta-net layer, from the nodes' updates
  // (node_upd of the same layer, GdnNodeLayout): conv <- the last K-1 inputs
  // of (committed window, the path's conv inputs); rec <- the path's updates
  // applied in order, each exactly as gdn applied it (S = S * decay;
  // S += k delta^T; rounded to state_type), so both are bit-identical to what
  // the verify computed for the path's last node.
  virtual void gdn_commit(float* conv, void* rec, DType state_type, const float* node_upd) = 0;
  // Starts what the ops so far have queued without waiting for it: CUDA's graph mode holds
  // launches back until a segment ends, and a commit's must not wait for the next step.
  virtual void submit() {}
  // Per row of logits: the k largest (descending; ties: lower id first) as ids
  // and log-softmax values — what greedy acceptance (k = 1) and the DDTree
  // builder need, so only k values per row leave the device.  logp null: the ids alone.
  virtual void row_topk(const float* rows, int n_rows, int n_cols, int k, int32_t* ids, float* logp) = 0;
};

// The worker threads are the context's (the CPU backend computes on them; a
// CUDA context keeps them for the CPU-side drafter).
std::unique_ptr<Backend> make_cpu_backend(const Model& m, ThreadPool& pool);
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
std::unique_ptr<Backend> make_cuda_backend(const Model& m, const MemoryPlan& plan);

// Backend memory released through its backend.
struct BackendBuf {
  Backend* be = nullptr;
  void* p = nullptr;
  size_t bytes = 0;
  BackendBuf() = default;
  BackendBuf(Backend& b, size_t n) : be(&b), p(b.alloc(n)), bytes(n) {}
  BackendBuf(BackendBuf&& o) noexcept : be(o.be), p(o.p), bytes(o.bytes) { o.p = nullptr; o.bytes = 0; }
  BackendBuf& operator=(BackendBuf&& o) noexcept {
    if (this != &o) {
      reset();
      be = o.be; p = o.p; bytes = o.bytes;
      o.p = nullptr; o.bytes = 0;
    }
    return *this;
  }
  ~BackendBuf() { reset(); }
  void reset() {
    if (p) be->release(p);
    p = nullptr;
    bytes = 0;
  }
  float* f() const { return static_cast<float*>(p); }
  uint8_t* u8() const { return static_cast<uint8_t*>(p); }
};

}  // namespace dfl
