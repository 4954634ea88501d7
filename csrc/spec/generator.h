// generator.h — the decode loop as an explicit state machine.
//
// PREFILL -> STEP (one target forward, greedy pick) -> EMIT ... -> DONE.
// It prints nothing and times itself into a stats struct.  Later modes
// (chain, DDTree) add DRAFT/VERIFY/COMMIT states here rather than a second
// loop elsewhere.
#pragma once
#include <chrono>
#include <vector>

#include "model/context.h"

namespace dfl {

enum class StopReason : int { Running = 0, Length = 1, Eos = 2, ContextFull = 3 };

struct GenParams {
  int max_new_tokens = 256;
  bool ignore_eos = false;
  std::vector<int32_t> eos_ids;
};

struct GenStats {
  int prompt_tokens = 0, generated_tokens = 0, steps = 0;
  StopReason stop = StopReason::Running;
  double prefill_s = 0, decode_s = 0;
};

class Generator {
 public:
  explicit Generator(Context& ctx) : ctx_(ctx) {}
  void begin(const int32_t* prompt, int n_prompt, const GenParams& p);
  // Appends the tokens decided by one step; returns how many (0 when done).
  int next(std::vector<int32_t>& out);
  const GenStats& stats() const { return stats_; }

 private:
  int32_t argmax_last() const;
  bool is_eos(int32_t t) const;

  Context& ctx_;
  GenParams p_;
  GenStats stats_;
  std::vector<float> logits_;
  int32_t pending_ = -1;  // decided but not yet fed to the target
  bool done_ = true;
};

}  // namespace dfl
