// topk.h — the k most likely tokens of one logits row with their log-probabilities: the reference that a
// backend's top-k on the device reproduces, and what the sampler, the tree builder and logprobs read.
#pragma once
#include <cstdint>

namespace dfl {

// Top-k of log-softmax(row): tokens by descending log-prob, lower id first on ties; NaN never picked
// while k numbers remain.  logp null: the ids alone (no log-sum-exp).
void topk_logprobs(const float* row, int n_vocab, int k, int32_t* tokens, float* logp);

}  // namespace dfl
