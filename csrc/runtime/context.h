// context.h — one decoding sequence's state, and the one forward.
//
// A Context owns everything that changes while decoding: the KV cache of the
// full-attention layers (F32/F16/Q8_0/Q4_0), each delta-net layer's conv
// window and recurrent state, and for batches that are verified rather than
// committed each node's delta-net update (what commit replays).  `forward` is the only way the
// model runs: prefill, AR steps, chain verify and tree verify are all a Batch
// of tokens with absolute positions and parent indices.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "model/qwen35.h"
#include "util/threadpool.h"

namespace dfl {

struct ContextParams {
  int n_ctx = 4096;
  int n_batch = 512;      // tokens per internal chunk; also the largest verify batch
  DType kv_type = DType::F16;
  // The delta-net recurrent state (committed and per verified node): F32, BF16
  // or F16.  The state is rounded to it after every token, alone or in a batch,
  // so every choice is exact on its own terms (speculative == AR).
  DType state_type = DType::F32;
  int n_threads = 0;      // 0: hardware concurrency
  Device device = Device::CPU;
};

struct Batch {
  int n = 0;
  const int32_t* tokens = nullptr;
  const int32_t* pos = nullptr;     // absolute positions (RoPE)
  const int32_t* parent = nullptr;  // index in batch of the parent, -1 = committed state; null = chain
};

struct ForwardOutputs {
  int n_logits = 0;
  const int32_t* logit_rows = nullptr;  // batch indices whose logits are wanted
  float* logits = nullptr;              // [n_logits][n_vocab], or null when only the top-k is wanted
  int topk = 0;                         // > 0: per logits row, its top-k ids and log-probs
  int32_t* top_ids = nullptr;           // [n_logits][topk]
  float* top_logp = nullptr;            // [n_logits][topk], or null: the ids alone
  int n_capture = 0;
  const int32_t* capture_layers = nullptr;  // residual stream after these layers
  float* hidden = nullptr;                  // [n][n_capture * n_embd], layer-major within a row
  // Keep the captured rows on the backend instead (captured(), same layout):
  // a drafter on the same backend takes them from there.  Needs n <= n_batch.
  bool hidden_on_backend = false;
};

class Context {
 public:
  // share: another context of the same model whose backend (weights, threads) this one uses too — the slots
  // of a server, each its own sequence, decoded together by forward_many.
  Context(const Model& model, const ContextParams& p, Context* share = nullptr);
  ~Context();

  const Model& model() const { return model_; }
  const ContextParams& params() const { return params_; }
  int n_past() const { return n_past_; }
  void reset();
  Device device() const;
  std::string backend_name() const;

  // commit == true: the batch must be a chain continuing the committed state;
  //   KV and recurrent state advance by n tokens.
  // commit == false: any tree (parent[i] < i); node i's KV goes to slot
  //   n_past + i and its delta-net states are kept per node until
  //   commit_path() picks the accepted nodes; the committed state is untouched.
  void forward(const Batch& b, const ForwardOutputs& out, bool commit);
  void commit_path(const int32_t* nodes, int n);
  // One forward over the batches of n contexts that share one backend (the slots of a server: cs[k] decodes
  // bs[k] as forward(bs[k], outs[k], commit[k]) would): the row-wise work (matmuls, norms, the output head)
  // runs once over every context's rows, attention and the delta-net per context on its own KV and state.
  // Each context's rows get the arithmetic they get alone, so its results are bit-identical to its own
  // forward.  The rows in all must fit the first context's batch size (no chunking across contexts).
  static void forward_many(Context* const* cs, const Batch* bs, const ForwardOutputs* outs, const bool* commit,
                           int n);

  size_t state_bytes() const;
  // The committed state as bytes: per layer in order, KV rows [0, n_past) of
  // attention layers (K then V), conv window and recurrent state of delta-net
  // layers.  Two contexts that decoded the same tokens compare equal (==).
  size_t committed_state_size() const;
  void copy_committed_state(uint8_t* dst) const;

  // Prefix reuse (a cache of earlier conversations' states): KV rows of
  // positions [p0, p1) of every attention layer (layer by layer, K rows then
  // V rows), and every delta-net layer's conv window + recurrent state.
  // Restoring rows [0, n) and the recurrent state a context had at n, then
  // set_n_past(n), continues exactly as that context would have.
  size_t kv_bytes_per_position() const;
  void get_kv(int p0, int p1, uint8_t* dst) const;
  void set_kv(int p0, int p1, const uint8_t* src);
  size_t recurrent_bytes() const;
  void get_recurrent(uint8_t* dst) const;
  void set_recurrent(const uint8_t* src);
  void set_n_past(int n);
  // The delta-net state copied to / from backend memory (draft-model rollback).
  BackendBuf new_recurrent_snapshot();
  void save_recurrent(BackendBuf& dst) const;
  void restore_recurrent(const BackendBuf& src);

  // The model's MTP head (Model::mtp) over n <= n_batch rows at positions pos0 .. pos0+n-1 of the head's own
  // KV (a chain: row t sees the head's slots [0, pos0 + t]).  Row t reads tokens[t] and hidden row t (backend
  // memory, [n][n_embd]): the trunk's last-layer residual at the position before (post_norm false: output_norm
  // is applied here), or the head's own output of the depth before (post_norm true).  Writes the head's K/V
  // at those slots; k > 0: each row's top-k ids and log-probs [n][k]; head_out (backend memory [n][n_embd],
  // optional): each row's hidden after shared_head_norm, the next depth's input.  The trunk's state is
  // untouched.
  // logits (host, optional): every row's logits [n][n_vocab] (tests).
  void mtp_forward(const int32_t* tokens, int n, int32_t pos0, const float* hidden, bool post_norm, int k,
                   int32_t* ids, float* logp, float* head_out, float* logits = nullptr);
  // mtp_forward for the slots of a server in one forward: part p runs on cs[p]'s head KV as cs[p]->mtp_forward
  // would (every part's rows get the arithmetic they get alone: the same bits), the row-wise work (the head's
  // matmuls, norms and the output matrix) once over all parts' rows.  The contexts share one backend and model;
  // the rows in all must fit the first context's batch size.
  struct MtpRows {
    const int32_t* tokens;
    int n;
    int32_t pos0;
    const float* hidden;
    int32_t* ids;
    float* logp;
    float* head_out;
    float* logits;
  };
  static void mtp_forward_many(Context* const* cs, const MtpRows* rs, int n_parts, bool post_norm, int k);

  // Target forwards run since construction (tests count them per step).
  int64_t n_forwards() const { return n_forwards_; }
  // The context's worker threads, shared with a drafter serving it.
  ThreadPool& pool();
  // The backend the context computes on, shared with a drafter serving it.
  Backend& backend();
  const Backend& backend() const;
  // Backend memory: the last forward's captured rows when it asked for hidden_on_backend.
  const float* captured() const;

 private:
  struct Impl;
  // Every delta-net layer's conv window and recurrent state (backend memory, bytes), in layer order: the
  // layout of get/set_recurrent and of the snapshots.
  std::vector<std::pair<void*, size_t>> gdn_state_parts() const;
  void check_forward(const Batch& b, const ForwardOutputs& out, bool commit);
  void prepare_verify(const Batch& b);  // per-node state room and the tree's parents, for commit_path
  // Rows [off, off + n) of context ctx's batch b, at rows row0.. of the lead context's scratch.
  struct Segment {
    Context* ctx;
    const Batch* b;
    int off, n;
    const ForwardOutputs* out;
    bool commit;
    int row0;
  };
  // Every layer over the segments' rows (this context's scratch; each segment's own KV, state and plan).
  void run_segments(const Segment* segs, int n_segs);
  // One attention part: the rows row0.. of a plan's tokens, with their context's K/V cache of the layer.
  struct AttnRows {
    const ChunkPlan* plan;
    uint8_t* k;
    uint8_t* v;
    int row0;
  };
  // The sublayers the trunk's attention layers and the MTP head share, on the chunk begun: gated full attention
  // of the normed rows (scratch hn, n in all) part by part, into scratch out (`all`: the plan of every row, for
  // the row-wise matmuls); x += residual (the sublayer before's output), then x += SwiGLU(post_norm(x)), the
  // residual and the norm in one backend op (add_rmsnorm).
  void attention_sublayer(const LayerWeights& w, const AttnRows* parts, int n_parts, int n, const ChunkPlan& all);
  void mlp_sublayer(const LayerWeights& w, float* x, const float* residual, int n);

  const Model& model_;
  ContextParams params_;
  int n_past_ = 0;
  int n_verify_ = 0;  // nodes held by the last non-committing forward
  int64_t n_forwards_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dfl
