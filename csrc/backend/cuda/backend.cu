// backend.cu — the CUDA Backend: device memory, the model's weights on the
// device, and the forward's ops as kernels on one stream.
//
// Weights are uploaded once per Model (shared by every CUDA context of it)
// into one allocation, each tensor 256-byte aligned with 16 bytes of slack
// (the matmul kernels read rows with 16-byte loads).  A chunk's plan (ids,
// positions, visibility, parents) is one upload; ops then queue kernels with
// no host round trip; only `download` (logits, captured features, state)
// waits for the stream.  In graph mode (the default) the ops' launches are
// recorded and replayed as CUDA graphs where they repeat (graph.cuh).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "attention_mma.cuh"
#include "common.cuh"
#include "forward_kernels.cuh"
#include "launch.cuh"
#include "matmul.cuh"
#include "matmul_exact.cuh"
#include "profile.cuh"
#include "backend/backend.h"
#include "quant/quant.h"

namespace dfl {
namespace cuda {
namespace {

// set_attention_rows: the attention CTA grouping pinned for every context (0 = chosen per launch).
std::atomic<int> g_attn_pin_toks{0}, g_attn_pin_heads{0};
// set_attention_kernel: 1 the tensor-core kernel where the head allows it, -1 the f32 kernel
// everywhere, 0 as DFLASH27B_CUDA_ATTN said when the context was created.
std::atomic<int> g_attn_kernel_pin{0};

std::string mib(uint64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%.1f MiB", (double)b / (1 << 20));
  return s;
}

// The model's tensors on the device, keyed by their host address.
struct DeviceWeights {
  void* arena = nullptr;
  uint64_t bytes = 0;
  std::map<const void*, void*> dev;
  ~DeviceWeights() {
    device_free(arena);
  }
  void* lookup(const void* host) const {
    auto it = dev.find(host);
    return it == dev.end() ? nullptr : it->second;
  }
  void* find(const void* host) const {
    void* p = lookup(host);
    if (!p) fail("internal: a weight was not uploaded to the device");
    return p;
  }
};

// Host tensors (address, bytes) into one device allocation.
void upload_tensors(const std::vector<std::pair<const void*, size_t>>& parts, DeviceWeights& W) {
  std::map<const void*, size_t> offset;
  uint64_t total = 0;
  for (auto& p : parts) {
    if (offset.count(p.first)) continue;  // tied embeddings: one copy
    offset[p.first] = total;
    total += (p.second + 16 + 255) / 256 * 256;
  }
  W.arena = device_alloc(total ? total : 256);
  W.bytes = total;
  for (auto& p : parts) {
    uint8_t* d = static_cast<uint8_t*>(W.arena) + offset[p.first];
    if (W.dev.count(p.first)) continue;
    CUDA_CHECK(cudaMemcpy(d, p.first, p.second, cudaMemcpyHostToDevice));
    W.dev[p.first] = d;
  }
  // A pageable cudaMemcpy returns once the bytes are staged, on the legacy stream, which the forward's
  // non-blocking stream does not wait for: the upload is complete only after this.
  CUDA_CHECK(cudaDeviceSynchronize());
}

// Every tensor the forward reads: matrices, then f32 vectors.
void upload_model(const Model& m, DeviceWeights& W) {
  std::vector<std::pair<const void*, size_t>> parts;
  m.for_each_tensor([&](const Weight& w) { parts.push_back({w.data, (size_t)w.rows * w.row_bytes}); },
                    [&](const std::vector<float>& v) { parts.push_back({v.data(), v.size() * 4}); });
  upload_tensors(parts, W);
}

// One DeviceWeights per owner (a drafter) while any backend uses it.
std::shared_ptr<DeviceWeights> tensors_for(const void* owner, const std::vector<std::pair<const void*, size_t>>& t) {
  static std::mutex mu;
  static std::map<const void*, std::weak_ptr<DeviceWeights>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto w = cache[owner].lock()) return w;
  uint64_t need = 0;
  for (auto& p : t) need += (p.second + 16 + 255) / 256 * 256;
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (need > free_b)
    fail("the drafter does not fit on the GPU: its weights need %s but %s are free", mib(need).c_str(),
         mib(free_b).c_str());
  auto w = std::make_shared<DeviceWeights>();
  upload_tensors(t, *w);
  cache[owner] = w;
  return w;
}

// One DeviceWeights per Model while any context uses it.
std::shared_ptr<DeviceWeights> weights_for(const Model& m, const MemoryPlan& plan) {
  static std::mutex mu;
  static std::map<const Model*, std::weak_ptr<DeviceWeights>> cache;
  std::lock_guard<std::mutex> lock(mu);
  if (auto w = cache[&m].lock()) {
    MemoryPlan rest = plan;
    rest.weights = 0;
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    if (rest.total() > free_b)
      fail("the context does not fit on the GPU: it needs %s (weights already loaded) but %s are free",
           mib(rest.total()).c_str(), mib(free_b).c_str());
    return w;
  }
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  if (plan.total() > free_b)
    fail("the model does not fit on the GPU: it needs %s (weights %s, KV cache %s, recurrent state %s, tree "
         "state %s, workspace %s) but %s of %s are free; use a smaller context (-c), a smaller KV type "
         "(--kv-type q4_0) or a smaller quant",
         mib(plan.total()).c_str(), mib(plan.weights).c_str(), mib(plan.kv).c_str(), mib(plan.recurrent).c_str(),
         mib(plan.tree_state).c_str(), mib(plan.workspace).c_str(), mib(free_b).c_str(), mib(total_b).c_str());
  auto w = std::make_shared<DeviceWeights>();
  upload_model(m, *w);
  cache[&m] = w;
  return w;
}

template <class F>
void launch_embed(const uint8_t* table, int64_t row_bytes, int64_t cols, const int32_t* tokens, int n, float* x,
                  cudaStream_t s) {
  launch(fwd::embed_kernel<F>, dim3((unsigned)n), dim3(128), 0, s, table, row_bytes, cols, tokens, x);
}

// DFLASH27B_CUDA_MATMUL: exact (the default) or float (see CudaBackend::matmul).
bool exact_matmul_chosen() {
  const char* v = std::getenv("DFLASH27B_CUDA_MATMUL");
  if (!v || !*v || !std::strcmp(v, "exact")) return true;
  if (!std::strcmp(v, "float")) return false;
  fail("DFLASH27B_CUDA_MATMUL=%s: use exact or float", v);
}

// DFLASH27B_CUDA_ATTN: mma (the default: attention_mma_kernel for every cache type with head_dim <= 256,
// attention_split_kernel for wider heads) or simt (attention_split_kernel everywhere), read when
// a context is created.  The two round differently (each within tolerance of the CPU), so a run's modes are
// bit-identical to its AR under either, not across them.
int attention_kernel_chosen() {
  const char* v = std::getenv("DFLASH27B_CUDA_ATTN");
  if (!v || !*v || !std::strcmp(v, "mma")) return 1;
  if (!std::strcmp(v, "simt")) return -1;
  fail("DFLASH27B_CUDA_ATTN=%s: use mma or simt", v);
}

// DFLASH27B_CUDA_GRAPHS: 1 (the default: replay repeating launch segments as graphs) or 0.
bool graphs_chosen() {
  const char* v = std::getenv("DFLASH27B_CUDA_GRAPHS");
  if (!v || !*v) return kGraphsPossible;
  if (!std::strcmp(v, "0")) return false;
  if (!std::strcmp(v, "1")) {
    if (!kGraphsPossible) fail("DFLASH27B_CUDA_GRAPHS=1: this build cannot zero argument padding, so graph mode is off");
    return true;
  }
  fail("DFLASH27B_CUDA_GRAPHS=%s: use 1 or 0", v);
}

unsigned elementwise_grid(size_t n) { return (unsigned)std::min<size_t>((n + 255) / 256, 4096); }

// The shared-memory slot of each kept delta-net state of a tree verify (-1: node_rec; fwd::kDeltaStashMax): a
// kept node's slot is busy from its step in the walk to its last child's, a node kept while every slot is busy
// goes to node_rec, and so does the last node, which GdnLayer::node_rec must hold.
std::vector<int32_t> delta_stash(const int32_t* parent, const std::vector<int32_t>& walk,
                                 const std::vector<uint8_t>& keep, int slots) {
  const int n = (int)walk.size();
  std::vector<int32_t> stash((size_t)n, -1), at((size_t)n), last_child((size_t)n, -1);
  for (int w = 0; w < n; ++w) at[(size_t)walk[(size_t)w]] = w;
  for (int u = 0; u < n; ++u)
    if (parent[u] >= 0) last_child[(size_t)parent[u]] = std::max(last_child[(size_t)parent[u]], at[(size_t)u]);
  std::vector<int> busy_until((size_t)std::max(slots, 0), -1);
  for (int w = 0; w < n; ++w) {
    const int u = walk[(size_t)w];
    if (!keep[(size_t)u] || u == n - 1) continue;
    for (size_t k = 0; k < busy_until.size(); ++k)
      if (busy_until[k] < w) {
        stash[(size_t)u] = (int32_t)k;
        busy_until[k] = last_child[(size_t)u];
        break;
      }
  }
  return stash;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Model& m, const MemoryPlan& plan) : c_(m.cfg) {
    require_device();
    CUDA_CHECK(cudaSetDevice(0));
    if (c_.conv_kernel > fwd::kMaxConvK) fail("conv kernel %d exceeds the CUDA limit %d", c_.conv_kernel, fwd::kMaxConvK);
    if (c_.ssm_dv % fwd::kDeltaCols)
      fail("delta-net value head dim %d is not a multiple of %d", c_.ssm_dv, fwd::kDeltaCols);
    if (c_.ssm_dk != 32 && c_.ssm_dk != 64 && c_.ssm_dk != 128 && c_.ssm_dk != 256)
      fail("delta-net key head dim %d: the CUDA kernel is built for 32, 64, 128 and 256", c_.ssm_dk);
    weights_ = weights_for(m, plan);
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUDA_CHECK(cudaGetDeviceProperties(&prop_, 0));
    exact_matmul_ = exact_matmul_chosen();
    graphs_ = graphs_chosen();
    attn_kernel_ = attention_kernel_chosen();
    // a tree verify's kept delta-net states in shared memory: as many slots as the device's CTA allows
    const size_t dstatic = fwd::delta_static_smem_bytes(c_.ssm_dk), dslot = fwd::delta_stash_slot_bytes(c_.ssm_dk);
    const size_t optin = (size_t)prop_.sharedMemPerBlockOptin;
    delta_stash_slots_ = optin > dstatic ? (int)std::min<size_t>(fwd::kDeltaStashMax, (optin - dstatic) / dslot) : 0;
    delta_stash_bytes_ = (size_t)delta_stash_slots_ * dslot;
    if (delta_stash_bytes_ > 0) {
      switch (c_.ssm_dk) {
        case 32: set_delta_smem(fwd::delta_kernel<32>); break;
        case 64: set_delta_smem(fwd::delta_kernel<64>); break;
        case 128: set_delta_smem(fwd::delta_kernel<128>); break;
        default: set_delta_smem(fwd::delta_kernel<256>); break;
      }
    }
    static std::once_flag attn_smem_opt_in;  // over the default 48 KiB: the largest CTA the device allows
    std::call_once(attn_smem_opt_in, [this] {
      const int bytes = (int)std::min(fwd::attn_mma_smem_bytes(2, fwd::kMmaAttnRows, fwd::kMmaAttnMaxHeadDim),
                                      (size_t)prop_.sharedMemPerBlockOptin);
      CUDA_CHECK(cudaFuncSetAttribute(fwd::attention_mma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
      CUDA_CHECK(cudaFuncSetAttribute(fwd::attention_mma_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    });
    rec_.bind(stream_);
  }
  ~CudaBackend() override {
    try {
      rec_.flush();
    } catch (...) {
    }
    part_.reset();
    act_q_.reset();
    if (stream_) cudaStreamSynchronize(stream_);
    rec_.drop_graphs();
    for (PlanStage& st : plan_stage_) {
      if (st.host) cudaFreeHost(st.host);
      if (st.done) cudaEventDestroy(st.done);
    }
    device_free(plan_words_.p);
    device_free(commit_words_.p);
    if (stream_) cudaStreamDestroy(stream_);
  }

  Device device() const override { return Device::CUDA; }
  std::string name() const override { return std::string("cuda (") + prop_.name + ")"; }

  void* alloc(size_t bytes) override {
    rec_.flush();
    act_q_of_ = {};
    const size_t n = (bytes + 16 + 255) / 256 * 256;
    void* p = device_alloc(n);
    CUDA_CHECK(cudaMemsetAsync(p, 0, n, stream_));
    return p;
  }
  void release(void* p) override {
    rec_.flush();
    act_q_of_ = {};
    cudaStreamSynchronize(stream_);
    OpProfiler::count_sync("release");
    prof_.resolve();
    device_free(p);
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    rec_.flush();
    act_q_of_ = {};
    CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` may be reused as soon as we return
    OpProfiler::count_sync("upload");
    prof_.resolve();
  }
  void download(void* host, const void* src, size_t bytes) override {
    rec_.flush();
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    OpProfiler::count_sync("download");
    prof_.resolve();
  }
  void download_rows(void* host, size_t host_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                     size_t rows) override {
    if (!rows) return;
    rec_.flush();
    CUDA_CHECK(cudaMemcpy2DAsync(host, host_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDeviceToHost, stream_));
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    OpProfiler::count_sync("download");
    prof_.resolve();
  }
  void copy_rows(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t row_bytes,
                 size_t rows) override {
    if (!rows) return;
    const OpScope op(*this, "copy", (double)rows * row_bytes);
    device_copy(stream_, dst, dst_pitch, src, src_pitch, row_bytes, rows);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    const OpScope op(*this, "copy", (double)bytes);
    device_copy(stream_, dst, bytes, src, bytes, bytes, 1);
  }
  void fill_zero(void* dst, size_t bytes) override {
    const OpScope op(*this, "fill_zero");
    device_zero(stream_, dst, bytes);
  }
  void sync() override {
    rec_.flush();
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    OpProfiler::count_sync("sync");
    prof_.resolve();
  }

  const void* weight(const Weight& w) override { return find(w.data); }
  const float* vec(const std::vector<float>& v) override {
    return v.empty() ? nullptr : static_cast<const float*>(find(v.data()));
  }
  void add_weights(const void* owner, const std::vector<std::pair<const void*, size_t>>& tensors) override {
    for (auto& e : extra_)
      if (e.first == owner) return;
    extra_.push_back({owner, tensors_for(owner, tensors)});
  }

  void begin_chunk(const ChunkPlan& p) override {
    rec_.flush();  // the recorded launches read the plan this upload replaces
    n_ = p.n;
    commit_ = p.commit;
    max_visible_ = p.max_visible;
    // every token's parent the one before it (prefill chunks, AR steps, chains); a plan of several slots'
    // tokens has no parents (forward_many: each slot's delta-net runs under its own plan)
    chain_ = p.parent.size() == (size_t)p.n;
    for (int t = 0; chain_ && t < p.n; ++t) chain_ = p.parent[(size_t)t] == t - 1;
    // One int32 upload: tokens | pos | n_prefix | extra_begin | extra_count | parent | keep | walk | stash |
    // kv_slot0 | extra_slots.  The device plan is rewritten in stream order, after the kernels that read it.
    const size_t words = 9 * (size_t)p.n + 1 + p.extra_slots.size();
    int32_t* d = upload_words(plan_words_, words, [&](int32_t* h) {
      for (const std::vector<int32_t>* v : {&p.tokens, &p.pos, &p.n_prefix, &p.extra_begin, &p.extra_count, &p.parent}) {
        std::copy(v->begin(), v->end(), h);
        h += p.n;
      }
      // the delta-net's part: which verify nodes' states are kept (none when committing), the order it walks
      // the tokens in (gdn_walk_order: a tree's preorder; committing, the batch's) and the shared-memory slot
      // of each kept state (delta_stash; -1: node_rec)
      if (p.commit) {
        std::fill(h, h + p.n, 0);
        for (int t = 0; t < p.n; ++t) h[p.n + t] = t;
        std::fill(h + 2 * p.n, h + 3 * p.n, -1);
      } else {
        const std::vector<int32_t> walk = gdn_walk_order(p.parent.data(), p.n);
        const std::vector<uint8_t> keep = node_rec_kept(p.parent.data(), walk);
        std::copy(keep.begin(), keep.end(), h);
        std::copy(walk.begin(), walk.end(), h + p.n);
        const std::vector<int32_t> stash = delta_stash(p.parent.data(), walk, keep, chain_ ? 0 : delta_stash_slots_);
        std::copy(stash.begin(), stash.end(), h + 2 * p.n);
      }
      h += 3 * p.n;
      *h++ = p.kv_slot0;
      std::copy(p.extra_slots.begin(), p.extra_slots.end(), h);
    });
    tokens_ = d; d += p.n;
    pos_ = d; d += p.n;
    n_prefix_ = d; d += p.n;
    extra_begin_ = d; d += p.n;
    extra_count_ = d; d += p.n;
    parent_ = d; d += p.n;
    keep_ = d; d += p.n;
    walk_ = d; d += p.n;
    stash_ = d; d += p.n;
    kv_slot0_ = d; d += 1;
    extra_slots_ = d;
  }

  // The commit plan, [base | m | path], goes up as the chunk plan does (its own device buffer: a chunk
  // plan's readers may still be queued), so every commit's launches are the same bytes.
  void begin_commit(const int32_t* path, int m, int32_t base) override {
    rec_.flush();
    if (m < 1) fail("commit of an empty path");
    commit_plan_ = upload_words(commit_words_, 2 + (size_t)m, [&](int32_t* h) {
      h[0] = base;
      h[1] = m;
      std::copy(path, path + m, h + 2);
    });
  }

  void embed(const Weight& table, float* x) override {
    const OpScope op(*this, "embed");
    const uint8_t* w = static_cast<const uint8_t*>(weight(table));
    const int64_t rb = (int64_t)table.row_bytes, cols = table.cols;
    if (cols % 8) fail("embedding width %lld is not a multiple of 8", (long long)cols);
    switch (table.type) {
      case DType::F32: return launch_embed<FmtF32>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::F16: return launch_embed<FmtF16>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::BF16: return launch_embed<FmtBF16>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::Q4_0: return launch_embed<FmtQ4_0>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::Q8_0: return launch_embed<FmtQ8_0>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::Q4_K: return launch_embed<FmtQ4_K>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::Q5_K: return launch_embed<FmtQ5_K>(w, rb, cols, tokens_, n_, x, stream_);
      case DType::Q6_K: return launch_embed<FmtQ6_K>(w, rb, cols, tokens_, n_, x, stream_);
    }
    fail("embedding of type %u is not supported on CUDA", (unsigned)table.type);
  }

  void rmsnorm(const float* x, const float* w, int n, int dim, float eps, float* y) override {
    const OpScope op(*this, "rmsnorm");
    const int nq = dim / 4, pv = (nq + 1023) / 1024;
    if (dim % 4 == 0 && pv <= 4) {  // the CTA's width and each thread's quads follow from dim alone
      const dim3 grid((unsigned)n), block((unsigned)(((nq + pv - 1) / pv + 31) / 32 * 32));
      switch (pv) {
        case 1: return launch(fwd::rmsnorm_quad_kernel<1>, grid, block, 0, stream_, x, w, dim, eps, y);
        case 2: return launch(fwd::rmsnorm_quad_kernel<2>, grid, block, 0, stream_, x, w, dim, eps, y);
        case 3: return launch(fwd::rmsnorm_quad_kernel<3>, grid, block, 0, stream_, x, w, dim, eps, y);
        default: return launch(fwd::rmsnorm_quad_kernel<4>, grid, block, 0, stream_, x, w, dim, eps, y);
      }
    }
    launch(fwd::rmsnorm_kernel, dim3((unsigned)n), dim3(256), 0, stream_, x, w, dim, eps, y);
  }

  void add_rmsnorm(float* x, const float* r, const float* w, int n, int dim, float eps, float* y) override {
    const int nq = dim / 4, pv = (nq + 1023) / 1024;
    if (dim % 4 || pv > 4) return Backend::add_rmsnorm(x, r, w, n, dim, eps, y);  // the two ops
    const OpScope op(*this, "add_rmsnorm");
    // rmsnorm's CTA shape for dim, so the sums of squares are added in its order
    const dim3 grid((unsigned)n), block((unsigned)(((nq + pv - 1) / pv + 31) / 32 * 32));
    switch (pv) {
      case 1: return launch(fwd::add_rmsnorm_quad_kernel<1>, grid, block, 0, stream_, x, r, w, dim, eps, y);
      case 2: return launch(fwd::add_rmsnorm_quad_kernel<2>, grid, block, 0, stream_, x, r, w, dim, eps, y);
      case 3: return launch(fwd::add_rmsnorm_quad_kernel<3>, grid, block, 0, stream_, x, r, w, dim, eps, y);
      default: return launch(fwd::add_rmsnorm_quad_kernel<4>, grid, block, 0, stream_, x, r, w, dim, eps, y);
    }
  }

  // Every matmul of a K-quant, Q8_0, Q4_0, F16 or BF16 model (the drafter's BF16
  // included) takes the batch-invariant kernels (matmul_exact.cuh): a token's
  // result is the same for every batch size, so an AR step, a verify of any tree
  // and a prefill chunk of any length agree bit for bit, with one weight pass per
  // 64 tokens (Q8_0 / Q4_0: 32).  Quantised weights: the CPU's integer arithmetic;
  // F16 / BF16: the tf32 tensor cores.  F32 weights (and every format with
  // DFLASH27B_CUDA_MATMUL=float, kept to compare the two on a GPU) take the float
  // kernels: a verify batch runs the matvec kernel in groups of up to 8 tokens,
  // whose per-token result is bit-identical to an AR step's, and prefill chunks
  // the tiled kernel.
  void matmul(const Weight& W, const float* x, int n, float* y) override {
    const void* w = weight(W);
    const bool exact = exact_matmul_ && matmul_exact_supported(W.type);
    OpScope op(*this, "matmul", (double)W.rows * W.row_bytes);
    if (op.on) {  // one row per format, shape and token count
      char label[96];
      std::snprintf(label, sizeof label, "matmul %s %lldx%lld n=%d%s", type_traits((uint32_t)W.type)->name,
                    (long long)W.rows, (long long)W.cols, n, exact ? "" : " (float kernels)");
      op.label = label;
    }
    if (exact) {
      const ExactAct kind = matmul_exact_act(W.type);
      if (kind != ExactAct::none && !act_q_of_.holds(x, n, W.cols, kind)) {
        const size_t need = matmul_exact_scratch_bytes(W.cols, n);
        if (act_q_.bytes < need) act_q_ = BackendBuf(*this, need);  // once, at the first widest batch
        matmul_exact_quantize(kind, x, W.cols, n, act_q_.p, stream_);
        act_q_of_ = {x, n, W.cols, kind};
      }
      matmul_exact_quantized(W.type, w, W.rows, W.cols, x, n, y, act_q_.p, stream_);
      act_q_of_.forget_if_written(y, (int64_t)n * W.rows);
      return;
    }
    act_q_of_.forget_if_written(y, (int64_t)n * W.rows);
    if (commit_ || n <= kMatvecMaxTokens) return cuda::matmul(W.type, w, W.rows, W.cols, x, n, y, stream_);
    for (int g = 0; g < n; g += kMatvecMaxTokens)
      cuda::matmul(W.type, w, W.rows, W.cols, x + (int64_t)g * W.cols, std::min(kMatvecMaxTokens, n - g),
                   y + (int64_t)g * W.rows, stream_);
  }

  void add(float* x, const float* y, size_t count) override {
    const OpScope op(*this, "add");
    launch(fwd::add_kernel, dim3(elementwise_grid(count)), dim3(256), 0, stream_, x, y, (int64_t)count);
  }
  void scale(float* x, float s, size_t count) override {
    const OpScope op(*this, "scale");
    launch(fwd::scale_kernel, dim3(elementwise_grid(count)), dim3(256), 0, stream_, x, s, (int64_t)count);
  }
  void swiglu(float* g, const float* u, size_t count) override {
    const OpScope op(*this, "swiglu");
    launch(fwd::swiglu_kernel, dim3(elementwise_grid(count)), dim3(256), 0, stream_, g, u, (int64_t)count);
  }
  void grouped_conv(const float* u, const float* base, const float* delta, int side, int n, int H, int T, int G,
                    float* out) override {
    const OpScope op(*this, "grouped_conv");
    launch(fwd::grouped_conv_kernel, dim3(elementwise_grid((size_t)n * H)), dim3(256), 0, stream_, u, base, delta,
           side, n, H, T, G, out);
  }

  void attn_store(float* qg, float* kk, const float* vv, const AttnLayer& L) override {
    const OpScope op(*this, "attn_store");
    const AttnShape& s = check_shape(L.s);
    fwd::StoreArgs a{qg, kk, vv, L.k_cache, L.v_cache, L.q_norm, L.k_norm, pos_, kv_slot0_, s.n_head, s.n_head_kv,
                     s.head_dim, s.q_stride(), kv_row(s), head_bytes(s), s.eps, s.rope, s.kv_type};
    const unsigned threads = (unsigned)((s.head_dim + 31) / 32 * 32);
    launch(fwd::attn_store_kernel, dim3((unsigned)n_, (unsigned)(s.n_head + 2 * s.n_head_kv)), dim3(threads), 0,
           stream_, a);
  }

  // Split-K over the visible slots (see forward_kernels.cuh); tokens go in
  // groups small enough that their partials fit the scratch budget.  The split
  // count is rounded up to a power of two, so that the launches of an AR step
  // change only when the context doubles (a graph can be replayed between):
  // the extra splits see no slot, and an empty split adds nothing to the
  // combine — the result is bit-identical to the exact count.
  void attention(const float* qg, const AttnLayer& L, float* o) override {
    const OpScope op(*this, "attention");
    const AttnShape& s = check_shape(L.s);
    int n_split = 1;
    while (n_split * fwd::kSplit < max_visible_) n_split *= 2;
    const size_t per_token = (size_t)s.n_head * n_split * (s.head_dim + 2) * 4;
    const int group = (int)std::max<size_t>(1, std::min<size_t>(n_, kAttnScratchBytes / per_token));
    if (part_.bytes < per_token * group) part_ = BackendBuf(*this, per_token * group);
    const int kD = (s.head_dim + fwd::kAttnThreads - 1) / fwd::kAttnThreads;
    const int pin = g_attn_kernel_pin.load(std::memory_order_relaxed);
    const int mma_rows = mma_attention_rows(s.head_dim);
    const bool mma = (pin ? pin : attn_kernel_) > 0 && fwd::attn_mma_supported(s.head_dim) && mma_rows;
    for (int t0 = 0; t0 < n_; t0 += group) {
      const int g = std::min(group, n_ - t0);
      const AttnRows rows = attention_rows(s, g, n_split, mma ? mma_rows : fwd::attn_max_rows(kD));
      fwd::AttnArgs a{qg, L.k_cache, L.v_cache, o, n_prefix_, extra_begin_, extra_count_, extra_slots_, part_.f(),
                      t0, g, n_split, s.n_head, s.n_head_kv, s.head_dim, s.q_stride(), rows.toks, rows.heads,
                      kv_row(s), head_bytes(s), 1.f / std::sqrt((float)s.head_dim), s.kv_type, s.gated};
      const dim3 grid((unsigned)((g + rows.toks - 1) / rows.toks),
                      (unsigned)(s.n_head_kv * (s.n_head / s.n_head_kv / rows.heads)), (unsigned)n_split);
      if (mma) {
        const int mt = rows.toks * rows.heads > 16 ? 2 : 1;
        const size_t smem = fwd::attn_mma_smem_bytes(mt, rows.toks, s.head_dim);
        if (mt == 1) launch(fwd::attention_mma_kernel<1>, grid, dim3(fwd::kAttnThreads), smem, stream_, a);
        else launch(fwd::attention_mma_kernel<2>, grid, dim3(fwd::kAttnThreads), smem, stream_, a);
      } else {
        const size_t smem = fwd::attn_smem_bytes(rows.toks * rows.heads, rows.toks, s.head_dim);
        switch (kD) {
          case 1: launch(fwd::attention_split_kernel<1>, grid, dim3(fwd::kAttnThreads), smem, stream_, a); break;
          case 2: launch(fwd::attention_split_kernel<2>, grid, dim3(fwd::kAttnThreads), smem, stream_, a); break;
          case 3: launch(fwd::attention_split_kernel<3>, grid, dim3(fwd::kAttnThreads), smem, stream_, a); break;
          default: launch(fwd::attention_split_kernel<4>, grid, dim3(fwd::kAttnThreads), smem, stream_, a); break;
        }
      }
      launch(fwd::attention_combine_kernel, dim3((unsigned)g, (unsigned)s.n_head), dim3(fwd::kAttnThreads), 0,
             stream_, a);
    }
  }

  // delta_kernel<DK>'s stash over the 48 KiB a CTA gets unasked
  template <class K>
  void set_delta_smem(K kernel) {
    if (fwd::delta_static_smem_bytes(c_.ssm_dk) + delta_stash_bytes_ > (48u << 10))
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)delta_stash_bytes_));
  }

  // The most rows (32 or 16) an attention_mma_kernel CTA may take for this head_dim within the shared memory
  // a CTA can have here (227 KiB on sm_90: 32 at head_dim 256; 99 KiB on sm_86 / sm_89: 16), 0 if not 16.
  int mma_attention_rows(int head_dim) const {
    for (int mt = 2; mt >= 1; --mt)
      if (fwd::attn_mma_smem_bytes(mt, 16 * mt, head_dim) <= prop_.sharedMemPerBlockOptin) return 16 * mt;
    return 0;
  }

  // How many tokens and query heads of one KV head an attention CTA takes.  A
  // K / V row is read once per CTA, so the more rows the less traffic, but the
  // device wants CTAs: start from the whole KV group and as many tokens as fit,
  // and halve the tokens, then the heads, while there would be fewer than two
  // CTAs per SM.  The grouping never changes a result (forward_kernels.cuh), so
  // this is speed only; cuda::set_attention_rows pins it for tests.
  struct AttnRows {
    int toks, heads;
  };
  AttnRows attention_rows(const AttnShape& s, int n_tok, int n_split, int max_rows) const {
    const int gs = s.n_head / s.n_head_kv;
    auto largest_divisor = [&](int cap) {  // of gs, at most cap
      for (int h = std::min(cap, gs); h > 1; --h)
        if (gs % h == 0) return h;
      return 1;
    };
    if (const int pt = g_attn_pin_toks.load(std::memory_order_relaxed); pt > 0) {
      const int heads = largest_divisor(std::max(1, g_attn_pin_heads.load(std::memory_order_relaxed)));
      return {std::max(1, std::min({pt, n_tok, max_rows / heads})), heads};
    }
    AttnRows r{1, largest_divisor(max_rows)};
    r.toks = std::max(1, std::min(n_tok, max_rows / r.heads));
    const int64_t want = 2 * (int64_t)std::max(1, prop_.multiProcessorCount);
    auto ctas = [&](const AttnRows& x) {
      return (int64_t)((n_tok + x.toks - 1) / x.toks) * s.n_head_kv * (gs / x.heads) * n_split;
    };
    while (ctas(r) < want && (r.toks > 1 || r.heads > 1)) {
      if (r.toks > 1) r.toks = (r.toks + 1) / 2;
      else r.heads = largest_divisor(r.heads - 1);
    }
    return r;
  }

  void gdn(float* mm, const float* z, const float* bb, const float* aa, const GdnLayer& L, float* y) override {
    const int C = c_.conv_channels();
    const GdnNodeLayout U(c_);
    {  // three profile rows: the conv, the serial state walk, the gated norm
      const OpScope op(*this, "gdn conv");
      fwd::ConvArgs ca{mm, L.conv1d, L.conv, L.node_conv, L.node_upd, parent_, n_, C, c_.conv_kernel,
                       (int64_t)U.stride};
      if (!L.node_conv && chain_ && n_ >= 2 * fwd::kConvChainWarps)  // a committing chain: tokens split by warp
        launch(fwd::conv_chain_kernel, dim3((unsigned)((C + 31) / 32)), dim3(32 * fwd::kConvChainWarps), 0, stream_,
               ca);
      else
        launch(fwd::conv_kernel, dim3((unsigned)((C + 127) / 128)), dim3(128), 0, stream_, ca);
    }
    {
      const OpScope op(*this, "gdn delta");
      fwd::DeltaArgs da{mm, bb, aa, L.dt_bias, L.ssm_a, L.rec, L.node_rec, keep_, L.node_upd, parent_, walk_,
                        stash_, y, n_, c_.ssm_nk, c_.ssm_nv, c_.ssm_dv, C, c_.rms_eps, (int64_t)U.stride,
                        (int64_t)U.k, (int64_t)U.delta, (int64_t)U.decay, (int)L.state_type};
      const dim3 grid((unsigned)c_.ssm_nv, (unsigned)(c_.ssm_dv / fwd::kDeltaCols)), block(fwd::kDeltaThreads);
      const size_t smem = commit_ || chain_ ? 0 : delta_stash_bytes_;  // the stash: a tree verify's
      switch (c_.ssm_dk) {
        case 32: launch(fwd::delta_kernel<32>, grid, block, smem, stream_, da); break;
        case 64: launch(fwd::delta_kernel<64>, grid, block, smem, stream_, da); break;
        case 128: launch(fwd::delta_kernel<128>, grid, block, smem, stream_, da); break;
        default: launch(fwd::delta_kernel<256>, grid, block, smem, stream_, da); break;
      }
    }
    const OpScope op(*this, "gdn norm");
    launch(fwd::gated_norm_kernel, dim3((unsigned)n_, (unsigned)c_.ssm_nv), dim3(32), 0, stream_, y, z, L.ssm_norm,
           c_.ssm_nv, c_.ssm_dv, c_.rms_eps);
  }

  void kv_commit(uint8_t* k_cache, uint8_t* v_cache, size_t kv_row) override {
    const OpScope op(*this, "kv_commit");
    if (!commit_plan_) fail("kv_commit without begin_commit");
    if (kv_row % 2) fail("KV rows of %zu bytes: the commit moves 2-byte units", kv_row);
    const fwd::KvCommitArgs a{k_cache, v_cache, (int64_t)kv_row, commit_plan_};
    launch(fwd::kv_commit_kernel, dim3((unsigned)((kv_row / 2 + 255) / 256), 2), dim3(256), 0, stream_, a);
  }

  void submit() override { rec_.flush(); }

  void gdn_commit(float* conv, void* rec, DType state_type, const float* node_upd) override {
    const OpScope op(*this, "gdn_commit");
    if (!commit_plan_) fail("gdn_commit without begin_commit");
    const GdnNodeLayout U(c_);
    const fwd::ConvCommitArgs ca{conv, node_upd + U.xin, (int64_t)U.stride, commit_plan_, c_.conv_channels(),
                                 c_.conv_kernel - 1};
    launch(fwd::conv_commit_kernel, dim3((unsigned)((ca.C + 127) / 128)), dim3(128), 0, stream_, ca);
    const fwd::DeltaCommitArgs a{rec, node_upd, (int64_t)U.stride, (int64_t)U.k, (int64_t)U.delta, (int64_t)U.decay,
                                 commit_plan_, c_.ssm_nk, c_.ssm_dk, c_.ssm_dv, (int)state_type};
    const int64_t hs = (int64_t)c_.ssm_dk * c_.ssm_dv;
    launch(fwd::delta_commit_kernel, dim3((unsigned)((hs + 255) / 256), (unsigned)c_.ssm_nv), dim3(256), 0, stream_, a);
  }

  void row_topk(const float* rows, int n_rows, int n_cols, int k, int32_t* ids, float* logp) override {
    const OpScope op(*this, "row_topk");
    if (k < 1 || k > n_cols) fail("top-k of %d over %d columns", k, n_cols);
    launch(fwd::row_topk_kernel, dim3((unsigned)n_rows), dim3(fwd::kTopkThreads), 0, stream_, rows, n_cols, k, ids,
           logp);
  }

 private:
  // Brackets one op with profile events (profile.cuh) while profiling is on;
  // else, in graph mode, records its launches (graph.cuh).
  struct OpScope {
    CudaBackend& be;
    std::string label;
    double bytes;
    bool on;
    LaunchRecorder::Scope recording;
    OpScope(CudaBackend& b, const char* op, double read_bytes = 0.0)
        : be(b), label(op), bytes(read_bytes), on(b.profile_begin()),
          recording(b.recorder_for_op(on)) {
      if (std::strcmp(op, "matmul")) b.act_q_of_ = {};  // any other op may write the quantised input
    }
    ~OpScope() {
      if (on) be.prof_.end(be.stream_, std::move(label), bytes);
    }
  };

  // The recorder an op's launches go to: none while profiling (each op is issued and timed on its own) or
  // with graph mode off, and then whatever was recorded is issued first.
  LaunchRecorder* recorder_for_op(bool profiling) {
    const int o = graph_mode_override().load(std::memory_order_relaxed);
    if (!profiling && (o < 0 ? graphs_ : o == 1)) return &rec_;
    rec_.flush();
    return nullptr;
  }

  // With the profile on, each op is issued and timed on its own: what was recorded goes first.
  bool profile_begin() {
    if (!op_profile().on.load(std::memory_order_relaxed)) return false;
    rec_.flush();
    return prof_.begin(stream_);
  }

  // A device int32 buffer written through pinned staging (begin_chunk, begin_commit).
  struct DeviceWords {
    int32_t* p = nullptr;
    size_t cap = 0;
    const char* growth;  // the host-sync row when it must grow
  };
  // Writes `words` int32 (fill(host)) to dst without a host wait: the staging buffers, two in turn, are
  // each rewritten only once the upload that last read them has run (long done: an upload back), so the
  // host queues the next kernels while the GPU finishes the last ones.
  template <class Fill>
  int32_t* upload_words(DeviceWords& dst, size_t words, const Fill& fill) {
    PlanStage& st = plan_stage_[plan_stage_i_ ^= 1];
    if (st.used) CUDA_CHECK(cudaEventSynchronize(st.done));
    if (st.cap < words) {
      if (st.host) CUDA_CHECK(cudaFreeHost(st.host));
      st.host = nullptr;
      st.cap = std::max(words, (size_t)4096);
      CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&st.host), st.cap * 4));
    }
    if (!st.done) CUDA_CHECK(cudaEventCreateWithFlags(&st.done, cudaEventDisableTiming));
    fill(st.host);
    if (words > dst.cap) {
      CUDA_CHECK(cudaStreamSynchronize(stream_));
      OpProfiler::count_sync(dst.growth);
      device_free(dst.p);
      dst.p = nullptr;
      dst.cap = std::max(words, (size_t)4096);
      dst.p = static_cast<int32_t*>(device_alloc(dst.cap * 4));
    }
    CUDA_CHECK(cudaMemcpyAsync(dst.p, st.host, words * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaEventRecord(st.done, stream_));
    st.used = true;
    return dst.p;
  }

  static const AttnShape& check_shape(const AttnShape& s) {
    if (s.head_dim > fwd::kMaxHeadDim || s.head_dim % 32)
      fail("attention head_dim %d: the CUDA kernels take multiples of 32 up to %d", s.head_dim, fwd::kMaxHeadDim);
    return s;
  }
  static int64_t kv_row(const AttnShape& s) { return (int64_t)row_bytes(s.kv_type, (int64_t)s.n_head_kv * s.head_dim); }
  static int64_t head_bytes(const AttnShape& s) {
    const TypeTraits* tt = type_traits((uint32_t)s.kv_type);
    return (int64_t)(s.head_dim / tt->block_elems) * tt->block_bytes;
  }
  void* find(const void* host) const {
    for (auto& e : extra_)
      if (void* p = e.second->lookup(host)) return p;
    return weights_->find(host);
  }

  const Qwen35Config& c_;
  std::shared_ptr<DeviceWeights> weights_;
  std::vector<std::pair<const void*, std::shared_ptr<DeviceWeights>>> extra_;  // the drafter's
  cudaStream_t stream_ = nullptr;
  cudaDeviceProp prop_{};
  int attn_kernel_ = 1;  // DFLASH27B_CUDA_ATTN: 1 mma, -1 simt
  // the current chunk's plan on the device
  int n_ = 0;
  int delta_stash_slots_ = 0;      // kept delta-net states a tree verify's CTA holds in shared memory
  size_t delta_stash_bytes_ = 0;
  bool commit_ = true;
  bool chain_ = true;  // the current chunk's tokens form one chain (begin_chunk)
  int max_visible_ = 0;
  BackendBuf part_;  // attention partials
  BackendBuf act_q_;  // the exact matmul's quantised activations
  // Which input act_q_ holds quantised, so that consecutive matmuls of one input (a layer's q / k / v, its
  // four delta-net projections, its gate / up) quantise it once.  Every op but a matmul forgets it, as does
  // every host write into device memory and a matmul whose output overlaps the input: it may have changed.
  struct ActQuantised {
    const float* x = nullptr;
    int n = 0;
    int64_t cols = 0;
    ExactAct kind = ExactAct::none;
    bool holds(const float* x_, int n_, int64_t cols_, ExactAct kind_) const {
      return x && x == x_ && n == n_ && cols == cols_ && kind == kind_;
    }
    void forget_if_written(const float* y, int64_t count) {  // y[0, count) was just written
      if (x && y < x + (int64_t)n * cols && x < y + count) *this = {};
    }
  } act_q_of_;
  bool exact_matmul_ = true;
  OpProfiler prof_;
  bool graphs_ = false;
  LaunchRecorder rec_;  // graph mode: the ops' launches, issued in segments
  static constexpr size_t kAttnScratchBytes = (size_t)64 << 20;
  struct PlanStage {  // pinned staging of a plan's upload (upload_words)
    int32_t* host = nullptr;
    size_t cap = 0;
    cudaEvent_t done = nullptr;  // recorded after its last upload
    bool used = false;
  } plan_stage_[2];
  int plan_stage_i_ = 0;
  DeviceWords plan_words_{nullptr, 0, "plan growth"}, commit_words_{nullptr, 0, "commit plan growth"};
  const int32_t* commit_plan_ = nullptr;  // [base | m | path] of the current commit
  const int32_t *tokens_ = nullptr, *pos_ = nullptr, *n_prefix_ = nullptr, *extra_begin_ = nullptr,
                *extra_count_ = nullptr, *parent_ = nullptr, *keep_ = nullptr, *walk_ = nullptr, *stash_ = nullptr, *kv_slot0_ = nullptr,
                *extra_slots_ = nullptr;
};

}  // namespace
// Pin the attention CTA grouping to `toks` tokens x `heads` query heads of a KV head (clamped to
// what fits; heads rounded down to a divisor of the KV group), 0 = automatic: for tests and
// dfl_cuda_attention_rows.
void set_attention_rows(int toks, int heads) {
  g_attn_pin_heads.store(heads);
  g_attn_pin_toks.store(toks);
}
void set_attention_kernel(int kind) { g_attn_kernel_pin.store(kind); }

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(const Model& m, const MemoryPlan& plan) {
  return std::make_unique<cuda::CudaBackend>(m, plan);
}

}  // namespace dfl
