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
#pragma once
#include <memory>
#include <vector>

#include "model/dflash_draft.h"
#include "model/qwen35.h"
#include "ops/cpu_ops.h"
#include "util/threadpool.h"

namespace dfl {

struct DrafterParams {
  int ring_capacity = 4096;  // positions of features / draft context kept
  int n_threads = 0;         // 0: hardware concurrency (ignored when a pool is shared)
};

class Drafter {
 public:
  // `draft` and `target` must outlive the Drafter; `pool` (optional) is shared
  // with the target's context so both run on the same threads.
  Drafter(const DraftModel& draft, const Model& target, const DrafterParams& p, ThreadPool* pool = nullptr);
  ~Drafter();

  const DraftConfig& config() const { return d_.cfg; }
  int capacity() const { return cap_; }
  int feature_width() const { return d_.cfg.fc_in(); }
  // Next position whose features are expected (= committed tokens pushed so far).
  int32_t n_pos() const { return n_pos_; }
  void reset();

  // Features of committed positions pos0 .. pos0+n-1, [n][feature_width()]
  // (target_layer_ids order within a row).  pos0 must equal n_pos().
  void push_features(int32_t pos0, int n, const float* feats);
  // Advances past positions whose features were not captured because they can
  // never be read (older than the newest `capacity` positions of the prompt).
  void skip_features(int32_t pos0, int n);

  // One draft forward over block_tokens[0..n_block) at positions n_pos() ..;
  // block_tokens[0] is the root (the last committed-but-unprocessed token),
  // the rest normally the mask token.  logits: [(n_block-1)][n_vocab], the
  // target's lm_head over the draft states of positions 1..n_block-1.
  void propose(const int32_t* block_tokens, int n_block, float* logits);

  // Bytes held by the ring and the draft KV cache (constant in context length).
  size_t state_bytes() const;

 private:
  void consume_features();
  void project_context(int32_t pos0, int n);  // ring rows -> draft KV rows

  const DraftModel& d_;
  const Model& t_;
  int cap_;
  std::unique_ptr<ThreadPool> own_pool_;
  ThreadPool* pool_;
  int32_t n_pos_ = 0;     // positions pushed
  int32_t consumed_ = 0;  // positions whose K/V are in the draft cache
  std::vector<float> ring_;                 // [cap][feature_width]
  std::vector<std::vector<float>> k_, v_;   // per layer [cap][kv_dim]
  // scratch
  std::vector<float> x_, hn_, q_, kb_, vb_, att_, out_, g_, u_, ctx_;
  ActScratch act_;
};

}  // namespace dfl
