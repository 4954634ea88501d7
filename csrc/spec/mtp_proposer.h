// mtp_proposer.h — the target's own multi-token-prediction head (Model::mtp) as a Proposer.
//
// The head keeps its own KV: slot p holds what it computed from the token at p and the trunk's hidden state
// at p - 1 (after output_norm; zeros before the first position).  Committed positions arrive through
// take_features (the prompt's chunks, then each step's accepted path, with their tokens) and wait, a
// (token, hidden) row each, until the next draft writes them all in one forward (or a full batch does):
// an AR step of auto mode costs the head one row copy, and the catch-up (the rows' K/V alone: Context::
// mtp_forward with nothing asked of its output) is part of the draft it serves.
// The prompt's rows are written when the prefill ends (prompt_done), with the prefill's time: left waiting,
// a long prompt's catch-up would land on the first probe (947 rows cost ~21 ms, 30 AR steps, on the
// bundled pair), which then never pays and makes auto mode skip the head for the rest of the request.  A draft runs
// the head autoregressively from the root: depth 1 reads (root, the trunk's hidden at root_pos - 1), depth
// d > 1 reads (the top-1 of depth d - 1, the head's own output after shared_head_norm), each at the next
// slot (those temporary slots are rewritten when their positions commit).  Each depth's top-K is the
// ranking chain mode and the DDTree builder read.  It computes on the target context's backend.
#pragma once
#include <vector>

#include "runtime/context.h"
#include "spec/proposer.h"

namespace dfl {

class MtpProposer final : public Proposer {
 public:
  // block: draft tokens per step, the root included, when the request sets none
  MtpProposer(Context& ctx, int block);
  const char* name() const override { return "mtp"; }
  unsigned capabilities() const override { return Rank | Chain; }
  int default_block() const override { return block_; }
  bool drafts_by_depth() const override { return true; }
  void propose_topk(const DraftRequest& r, int K, int32_t* ids, float* logp) override;
  void reset() override;
  void prompt_done(const int32_t*, int) override { flush(); }
  // Slots: every slot's waiting rows in one head forward, then each depth of every slot's chain in one
  // (Context::mtp_forward_many); each slot keeps its ranks for its propose_topk this step.
  const void* batch_key() const override { return &ctx_.model().mtp; }
  void prefetch_many(Proposer* const* ps, const DraftRequest* rs, int n) override;
  const std::vector<int32_t>* feature_layers() const override { return &layers_; }
  int feature_capacity() const override { return 1 << 30; }  // every position: the head attends over them all
  void take_features(int32_t pos0, int n, const float* captured, size_t stride, const int32_t* rows,
                     const int32_t* tokens) override;
  size_t state_bytes() const override;

 private:
  Context& ctx_;
  int block_;
  std::vector<int32_t> layers_;  // the trunk's last layer
  void flush();                  // writes the waiting rows' slots (one head forward)
  int32_t n_pos_ = 0;            // positions the head has been given (written or waiting)
  int32_t n_written_ = 0;        // positions whose slots are written; [n_written_, n_pos_) wait in rows_
  std::vector<int32_t> wait_tok_;  // the waiting rows' tokens
  BackendBuf last_h_;            // the trunk's hidden at n_pos_ - 1 (zeros at the start or after a skip)
  BackendBuf rows_;              // [n_batch][H]: the waiting rows' input hidden states
  BackendBuf head_;              // [H]: a draft depth's output, the next depth's input
  PrefetchedRanks pf_;  // prefetch_many's ranks for this slot's next propose_topk
};

}  // namespace dfl
