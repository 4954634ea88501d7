"""What a decode returns: the tokens and text, and its stats (per-step records included).  Shared by the
in-process Decoder and the daemon's client, which rebuilds them from the wire."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class GenerateStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    decode_tok_s: float
    prefill_tok_s: float
    steps: int
    stop_reason: str
    mode: str = "ar"
    device: str = "cpu"
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache instead of prefilled
    mean_accept: float = 1.0
    block_size: int = 1
    budget: int = 0
    temperature: float = 0.0
    seed: int = 0
    # per decode step (z-lab's convention: tokens committed incl. the bonus; the prefill's token
    # belongs to no step; the last step counts only tokens kept within max_new_tokens)
    accept_lengths: list[int] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    tree_ms: list[float] = field(default_factory=list)
    verify_ms: list[float] = field(default_factory=list)
    commit_ms: list[float] = field(default_factory=list)
    target_forwards: list[int] = field(default_factory=list)
    tree_size: list[int] = field(default_factory=list)   # draft nodes verified per step
    tree_depth: list[int] = field(default_factory=list)
    draft_depth: list[int] = field(default_factory=list)  # depths asked of the drafter below the root (0: none)
    # auto mode with prompt lookup beside a model drafter: verified nodes lookup added to that drafter's tree
    merged: list[int] = field(default_factory=list)
    # auto mode, per step: the budget chosen (0 = AR; -1 in the other modes), forced probes, and the
    # estimates behind the choice (expected tokens, expected tok/s of the choice and of an AR step)
    auto_budget: list[int] = field(default_factory=list)
    probe: list[bool] = field(default_factory=list)
    expected_tokens: list[float] = field(default_factory=list)
    est_tok_s: list[float] = field(default_factory=list)
    est_ar_tok_s: list[float] = field(default_factory=list)
    # under a constraint (json_schema / grammar), per step: draft nodes it forbade (pruned before the verify)
    # and the time its masks took
    pruned: list[int] = field(default_factory=list)
    mask_ms: list[float] = field(default_factory=list)
    # auto mode with several drafters, per step: the one that drafted ("" = an AR step)
    drafter: list[str] = field(default_factory=list)

    @property
    def auto_summary(self) -> str:
        """Auto mode's choices in a few words: the share of AR steps and the speculative budgets."""
        if self.mode != "auto" or not self.auto_budget:
            return ""
        spec = [b for b in self.auto_budget if b > 0]
        out = f"{len(self.auto_budget) - len(spec)} AR + {len(spec)} tree steps"
        if spec:
            out += f" (budget {min(spec)}-{max(spec)}, mean {sum(spec) / len(spec):.1f})"
        probes = sum(self.probe)
        out += f", {probes} probes" if probes else ""
        names = sorted({d for d in self.drafter if d})   # a portfolio: its drafters' tree steps
        if names:
            out += " [" + ", ".join(f"{n} {self.drafter.count(n)}" for n in names) + "]"
        joined = sum(m > 0 for m in self.merged)
        out += f", {joined} with lookup's nodes added" if joined else ""
        return out

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GenerateResult:
    tokens: list[int]
    text: str
    stats: GenerateStats
    prompt_tokens: list[int] = field(default_factory=list)
    # with generate(logprobs=k): per token {"token", "logprob", "top": [(id, logprob) x k]}, the log-softmax
    # of the target's raw logits at that position (before temperature and filters)
    logprobs: list[dict] | None = None
    # a chat reply (chat=True) as OpenAI's assistant message: content, reasoning_content (the thinking block),
    # tool_calls (with tools; arguments as JSON text)
    message: dict | None = None

    @property
    def tool_calls(self) -> list[dict]:
        return list((self.message or {}).get("tool_calls") or [])
