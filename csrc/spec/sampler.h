// sampler.h — sampling the target's logits, with counter-based randomness.
//
// A logit bias first (llama.cpp's logit-bias sampler, OpenAI's logit_bias), then the penalties, then the
// filters in llama.cpp's default order and semantics: top-k, then top-p, then
// min-p (each on the softmax of the surviving logits at temperature 1), then
// temperature, then a draw.  temperature <= 0 means greedy (argmax, lowest id
// on ties).  The uniform number for the token at absolute position `pos` is a
// pure function of (seed, pos), never a stream consumed in call order: a
// speculative step samples every verified node with the number of the
// position its token would occupy, exactly as AR decoding would, so sampled
// output is the same token for token in every mode.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace dfl {

struct SamplerParams {
  float temperature = 0.f;  // <= 0: greedy
  int top_k = 0;            // <= 0: off
  float top_p = 1.f;        // 1: off; must be in (0, 1]
  float min_p = 0.f;        // 0: off; must be in [0, 1]
  float typical_p = 1.f;    // 1: off; must be in (0, 1]: locally typical sampling, after top-k
  uint64_t seed = 0;
  // Repetition penalties, applied first, as llama.cpp's penalties sampler: for
  // each token seen c > 0 times in the last repeat_last_n tokens of the
  // sequence (prompt included; -1 = all, 0 = none), its logit is divided by
  // repeat_penalty when positive (multiplied when negative), then lowered by
  // c * frequency_penalty + presence_penalty.
  float repeat_penalty = 1.f;     // 1: off
  float frequency_penalty = 0.f;  // 0: off
  float presence_penalty = 0.f;   // 0: off
  int repeat_last_n = 64;
  // Added to the logit of each token before everything else: (token, bias), tokens ascending, each once.
  std::vector<std::pair<int32_t, float>> logit_bias;
  bool greedy() const { return !(temperature > 0.f); }
  bool biased() const { return !logit_bias.empty(); }
  bool penalized() const {
    return repeat_last_n != 0 && (repeat_penalty != 1.f || frequency_penalty != 0.f || presence_penalty != 0.f);
  }
};

// Throws a one-line dfl::Error naming the bad parameter (n_vocab: the token ids' range; 0 = unchecked).
void validate_sampler(const SamplerParams& p, int n_vocab = 0);

// Uniform in [0, 1) for the token at absolute position pos (SplitMix64-style hash).
double position_uniform(uint64_t seed, int64_t pos);

// The penalties of p applied in place to a logits row whose sequence so far
// (every token before the one this row predicts) is hist[0, n_hist).
void apply_penalties(float* logits, int n_vocab, const SamplerParams& p, const int32_t* hist, size_t n_hist,
                     std::vector<int32_t>& scratch);

// The token for position `pos` drawn from logits[n_vocab] under p.
int32_t sample_token(const float* logits, int n_vocab, const SamplerParams& p, int64_t pos,
                     std::vector<std::pair<float, int32_t>>& scratch);

}  // namespace dfl
