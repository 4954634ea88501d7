// drafter.h — the DFlash drafter at run time: feature ring, draft KV cache,
// and the block forward that proposes a whole block in one call.
//
// Target features of committed positions (the residual stream after each of
// the drafter's target_layer_ids, concatenated) are pushed into a ring of
// `ring_capacity` positions (slot = position mod capacity).  The next
// propose() consumes them: each position's context K/V (fc, hidden_norm, the
// layer's k/v projections, k_norm, RoPE at the position) is computed once and
// kept in a draft KV ring of the same capacity, never recomputed.  The block
// then attends over the cached context of the most recent `capacity`
// positions plus the block itself, so memory is constant in context length.
// The arithmetic follows z-lab's dflash 0.1.0 (DFlashDraftModel.forward).
// It runs on a Backend — the target context's (CPU or CUDA) when it serves
// one, so ring, draft KV and weights live where the target's do — through the
// same ops as the target forward (plain, ungated attention with f32 K/V).
#pragma once
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/dflash_draft.h"
#include "model/qwen35.h"
#include "util/threadpool.h"

namespace dfl {

struct DrafterParams {
  int ring_capacity = 4096;  // positions of features / draft context kept
  int n_threads = 0;         // 0: hardware concurrency (ignored when a pool is shared)
};

class Drafter {
 public:
  // `draft` and `target` must outlive the Drafter.  `backend` (optional) is the
  // target context's, which the drafter then shares; without one it computes
  // on a CPU backend of its own threads.
  Drafter(const DraftModel& draft, const Model& target, const DrafterParams& p, Backend* backend = nullptr);
  ~Drafter();

  const DraftConfig& config() const { return d_.cfg; }
  const DraftModel* draft_model() const { return &d_; }
  int capacity() const { return cap_; }
  int feature_width() const { return d_.cfg.fc_in(); }
  // Next position whose features are expected (= committed tokens pushed so far).
  int32_t n_pos() const { return n_pos_; }
  void reset();

  // Features of committed positions pos0 .. pos0+n-1, [n][feature_width()]
  // (target_layer_ids order within a row).  pos0 must equal n_pos().
  void push_features(int32_t pos0, int n, const float* feats);
  // The same from backend memory (the target context's captured rows, when
  // both share the backend): position pos0 + k takes row rows[k] of src
  // (rows null: row k).
  void push_features_from_backend(int32_t pos0, int n, const float* src, size_t src_stride, const int32_t* rows);
  Backend& backend() { return *be_; }
  // Advances past positions whose features were not captured because they can
  // never be read (older than the newest `capacity` positions of the prompt).
  void skip_features(int32_t pos0, int n);

  // One draft forward over block_tokens[0..n_block) at positions n_pos() ..;
  // block_tokens[0] is the root (the last committed-but-unprocessed token),
  // the rest normally the mask token.  logits: [(n_block-1)][n_vocab], the
  // target's lm_head over the draft states of positions 1..n_block-1.
  void propose(const int32_t* block_tokens, int n_block, float* logits);
  // The same forward, returning per position 1..n_block-1 only the top-k ids
  // and log-probs [(n_block-1)][k] (computed where the logits are).
  void propose_topk(const int32_t* block_tokens, int n_block, int k, int32_t* ids, float* logp);
  // DFlash2: the candidate selector's path for the block (n_block - 1 tokens): per position its
  // selector_top_k candidates, each scored by its log-probability (the transformed logit up to the row's
  // constant) plus the transition <pred[prev] * (P h), succ[cand]> from the token chosen before it, the root
  // first; greedy, the first of equal scores (candidates in (log-prob desc, id asc) order).  With
  // cand_ids / cand_logp [n_block - 1][selector_top_k] the candidates too.
  void propose_path(const int32_t* block_tokens, int n_block, int32_t* path, int32_t* cand_ids = nullptr,
                    float* cand_logp = nullptr);
  // DFlash2: the selector's whole lattice for the block: per depth t its candidates cand_ids / cand_logp
  // [n_block - 1][K] and edge [n_block - 1][K][K], edge[t][i][j] = the score of candidate j of depth t after
  // candidate i of depth t - 1 (the first depth's predecessor is the root: all its K rows are the root's).
  // propose_path is the greedy walk of it.
  void propose_lattice(const int32_t* block_tokens, int n_block, int32_t* cand_ids, float* cand_logp, float* edge);

  // The blocks of n drafters of one draft model on one backend (the slots of a server: Generator::next_many) in
  // one forward: the row-wise work (embedding, norms, projections, MLP, the lm_head) once over every block's
  // rows, attention and DFlash2's convolutions per block on its own drafter's context.  Each drafter keeps its
  // block's result for its next propose* call on the same block at the same position (no forward then);
  // each block's rows get exactly the arithmetic of its own forward, so those calls give the same bits.
  static void prefetch_blocks(Drafter* const* ds, const int32_t* const* blocks, const int* n_block, int n);

 private:
  struct SelectorScores;
  struct BlockResult;
  // propose_topk's work, returning the block's result (the selector reads its final-normed rows)
  BlockResult topk_block(const int32_t* block_tokens, int n_block, int k, int32_t* ids, float* logp);
  SelectorScores selector_scores(const int32_t* block_tokens, int n_block, int32_t* cand_ids, float* cand_logp);

 public:

  // Bytes held by the ring and the draft KV cache (constant in context length).
  size_t state_bytes() const;
  // Projects every position pushed and not yet projected into the draft KV now (the next draft would): called
  // when a prompt's prefill ends, so a long prompt's projection is prefill time, not the first probe's.
  void catch_up() { consume_features(); }

 private:
  void consume_features();
  void project_context(int32_t pos0, int n);  // ring rows -> draft KV rows (no ring wrap inside)
  void ensure_scratch(int rows);
  void ensure_block_rows(int B);
  // The plan of a block attending with this layer kind (causal, window W).
  // A block's forward up to its (multiplied) logits and final-normed rows (rows = n_block - 1): a result
  // prefetched for this block (prefetch_blocks), else the drafter's own forward.
  struct BlockResult {
    const float* logits = nullptr;  // backend memory [(n_block - 1)][n_vocab]
    const float* hn = nullptr;      // backend memory [(n_block - 1)][hidden]: the draft's final norm
  };
  BlockResult forward_block(const int32_t* block_tokens, int n_block);
  // The forward of n drafters' blocks in the lead's (ds[0]'s) scratch; each drafter's result there.
  static void forward_blocks(Drafter* const* ds, const int32_t* const* blocks, const int* n_block, int n,
                             BlockResult* out);
  void plan_block(const int32_t* tokens, int B, bool causal, int64_t W, ChunkPlan& P) const;

  const DraftModel& d_;
  const Model& t_;
  int cap_;
  std::unique_ptr<ThreadPool> own_pool_;
  std::unique_ptr<Backend> own_be_;
  Backend* be_;
  AttnShape attn_;
  int32_t n_pos_ = 0;     // positions pushed
  int32_t consumed_ = 0;  // positions whose K/V are in the draft cache
  BackendBuf ring_;                 // [cap][feature_width]
  std::vector<BackendBuf> k_, v_;   // per layer [cap + block_rows_][kv_dim] f32: context ring, then the block
  int block_rows_ = 0;
  // scratch (backend memory) for `scratch_rows_` rows
  int scratch_rows_ = 0;
  BackendBuf x_, hn_, q_, kb_, vb_, att_, out_, g_, u_, ctx_;
  BackendBuf dl_, cv_;  // DFlash2: the conv kernels' projection [rows][2][T][G], a convolved row block
  BackendBuf sel_;      // DFlash2: P h of the block's rows [rows][selector_rank]
  BackendBuf logits_;  // [(block - 1)][n_vocab], grown on demand
  BackendBuf top_;     // top-k ids then log-probs
  ChunkPlan plan_a_, plan_b_, plan_all_;
  // A prefetched block's result, valid while its lead's scratch is untouched (the lead's epoch) and this
  // drafter has read no new position.
  struct Prefetched {
    const Drafter* lead = nullptr;
    uint64_t epoch = 0;
    int32_t pos = -1;
    std::vector<int32_t> block;
    BlockResult r;
  } prefetched_;
  uint64_t epoch_ = 0;  // bumped whenever this drafter's scratch is written
};

}  // namespace dfl
