// generator.cpp — autoregressive greedy decoding on top of Context::forward.
#include "spec/generator.h"

#include <algorithm>

namespace dfl {

using Clock = std::chrono::steady_clock;
static double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

void Generator::begin(const int32_t* prompt, int n_prompt, const GenParams& p) {
  const Qwen35Config& c = ctx_.model().cfg;
  if (n_prompt <= 0) fail("empty prompt: give at least one token");
  if (n_prompt >= ctx_.params().n_ctx)
    fail("prompt of %d tokens does not fit the context length %d (leave room for at least one new token)",
         n_prompt, ctx_.params().n_ctx);
  if (p.max_new_tokens < 0) fail("max_new_tokens must be >= 0 (got %d)", p.max_new_tokens);
  p_ = p;
  stats_ = GenStats{};
  stats_.prompt_tokens = n_prompt;
  ctx_.reset();
  logits_.assign(c.n_vocab, 0.f);
  std::vector<int32_t> pos(n_prompt);
  for (int i = 0; i < n_prompt; ++i) pos[i] = i;
  int32_t last = n_prompt - 1;
  Batch b{n_prompt, prompt, pos.data(), nullptr};
  ForwardOutputs out;
  out.n_logits = 1;
  out.logit_rows = &last;
  out.logits = logits_.data();
  auto t0 = Clock::now();
  ctx_.forward(b, out, true);
  stats_.prefill_s = since(t0);
  pending_ = argmax_last();
  done_ = p.max_new_tokens == 0;
  if (done_) stats_.stop = StopReason::Length;
}

int32_t Generator::argmax_last() const {
  // Lowest index wins ties, so the choice never depends on scan order.
  return (int32_t)(std::max_element(logits_.begin(), logits_.end()) - logits_.begin());
}

bool Generator::is_eos(int32_t t) const {
  return !p_.ignore_eos && std::find(p_.eos_ids.begin(), p_.eos_ids.end(), t) != p_.eos_ids.end();
}

int Generator::next(std::vector<int32_t>& out) {
  if (done_) return 0;
  auto t0 = Clock::now();
  const int32_t tok = pending_;
  if (is_eos(tok)) {
    done_ = true;
    stats_.stop = StopReason::Eos;
    return 0;
  }
  out.push_back(tok);
  stats_.generated_tokens++;
  if (stats_.generated_tokens >= p_.max_new_tokens) {
    done_ = true;
    stats_.stop = StopReason::Length;
    stats_.decode_s += since(t0);
    return 1;
  }
  if (ctx_.n_past() + 1 > ctx_.params().n_ctx) {
    done_ = true;
    stats_.stop = StopReason::ContextFull;
    return 1;
  }
  int32_t pos = ctx_.n_past(), zero = 0;
  Batch b{1, &tok, &pos, nullptr};
  ForwardOutputs o;
  o.n_logits = 1;
  o.logit_rows = &zero;
  o.logits = logits_.data();
  ctx_.forward(b, o, true);
  stats_.steps++;
  pending_ = argmax_last();
  stats_.decode_s += since(t0);
  return 1;
}

}  // namespace dfl
