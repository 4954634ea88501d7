"""Distil a DFlash drafter (z-lab format) on a qwen35 target GGUF, on CPU.

Data: the target's own greedy continuations (decoded by dflash27b) of prompts, with the target features
the drafter reads (residual stream after each target_layer_id) captured for every position.  Training: for
an anchor position s, the drafter sees the features of positions < s and the block [x_s, mask x (B-1)]
and learns the target's tokens x_{s+1} .. x_{s+B-1} (cross-entropy through the target's frozen lm_head,
earlier block positions weighted more, as they decide acceptance).  The output directory holds
config.json + model.safetensors exactly as z-lab publishes drafters.

  python models/train/distill_draft.py TARGET.gguf OUT_DIR [--prompts random|FILE.txt] [--steps N] ...

Seeded and deterministic on one machine (torch CPU, one thread for data order).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dflash_torch import DraftNet, GroupedConv, selector_loss  # noqa: E402

from dflash27b import Decoder  # noqa: E402
from dflash27b.tools.draft_format import draft_config  # noqa: E402


def target_tables(gguf_path: str) -> tuple[np.ndarray, np.ndarray]:
    """(token embedding [V, H], lm_head [V, H]) of the target as f32, via gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(gguf_path)
    t = {x.name: x for x in r.tensors}

    def f32(name):
        x = t[name]
        return dequantize(x.data, x.tensor_type).reshape(int(x.shape[1]), int(x.shape[0])).astype(np.float32)

    emb = f32("token_embd.weight")
    head = f32("output.weight") if "output.weight" in t else emb
    return emb, head


def make_data(dec: Decoder, prompts: list[list[int]], gen: int, ids: list[int]):
    toks, feats = [], []
    t0 = time.time()
    for i, p in enumerate(prompts):
        if i % 16 == 0:
            print(f"data: {i}/{len(prompts)} sequences, {time.time() - t0:.0f} s", flush=True)
        out = dec.generate(p, gen, ignore_eos=True, mode="ar").tokens
        seq = list(p) + out
        h = dec.hidden_states(seq, ids)  # [T, n_ids, H]
        toks.append(np.array(seq, np.int64))
        feats.append(h.reshape(len(seq), -1))
    return toks, feats


def stdlib_prompts(dec: Decoder, n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    """`n` prompts of `length` tokens, each starting at a random line of a random training file of the
    target (train_target.split_files: held-out files are never used)."""
    from train_target import split_files, stdlib_files
    files, _ = split_files(stdlib_files())
    out = []
    while len(out) < n:
        f = files[int(rng.integers(0, len(files)))]
        try:
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < 8:
            continue
        start = int(rng.integers(0, len(lines) - 4))
        ids = dec.tokenize("".join(lines[start:start + 60]), parse_special=False)
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def evaluate(target: str, draft: Path, prompts_file: str, n_new: int = 128) -> dict:
    """Mean accept length (z-lab's: tokens per step incl. the bonus) on held-out prompts, greedy."""
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    res = {}
    with Decoder(target, draft, kv_type="f32", ctx=2048) as d:
        for name, kw in (("chain-16", dict(mode="chain", block_size=16)), ("ddtree-22", dict(mode="ddtree", budget=22))):
            acc = []
            for r in rows:
                acc += d.generate(r["prompt"], n_new, ignore_eos=True, **kw).stats.accept_lengths
            res[name] = sum(acc) / len(acc)
    return res


def plot_loss(losses: list[float], out: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no loss.png", flush=True)
        return
    k = max(1, len(losses) // 100)
    smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
    plt.figure(figsize=(6, 3.5))
    plt.plot(range(k - 1, len(losses)), smooth)
    plt.xlabel("step")
    plt.ylabel("weighted block cross-entropy (nats)")
    plt.title(title)
    plt.tight_layout()
    plt.savefig(out, dpi=110)
    plt.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--prompts", default="random",
                    help="'random' token prompts, 'stdlib' (windows of the target's training files, from line "
                         "starts), or a text file (one per line)")
    ap.add_argument("--eval", default=None, help="JSONL of held-out prompts: report chain/ddtree acceptance at the end")
    ap.add_argument("--n-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--mask-token-id", type=int, default=-1,
                    help="the block's mask token (default: the last id; pick a token the target never sees, "
                         "e.g. <|im_start|> for a code-only target)")
    ap.add_argument("--target-layer-ids", default="1,3,5,6")
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["bf16", "f32"], default="bf16")
    ap.add_argument("--generation", type=int, choices=[1, 2], default=1,
                    help="2: a DFlash2 drafter (grouped convolutions + candidate selector, trained jointly)")
    ap.add_argument("--selector-rank", type=int, default=64)
    ap.add_argument("--selector-top-k", type=int, default=16)
    ap.add_argument("--conv-kernel-size", type=int, default=2)
    ap.add_argument("--conv-group-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = [int(x) for x in a.target_layer_ids.split(",")]

    with Decoder(a.target, kv_type="f32", ctx=4096, threads=a.threads) as dec:
        info = dec.info
        V, H = info["n_vocab"], info["n_embd"]
        if a.prompts == "random":
            prompts = [rng.integers(0, V - 1, a.prompt_len).tolist() for _ in range(a.n_seqs)]
        elif a.prompts == "stdlib":
            prompts = stdlib_prompts(dec, a.n_seqs, a.prompt_len, rng)
        else:
            lines = [ln for ln in Path(a.prompts).read_text().splitlines() if ln.strip()]
            prompts = [dec.tokenize(lines[i % len(lines)])[: a.prompt_len] for i in range(a.n_seqs)]
        t0 = time.time()
        toks, feats = make_data(dec, prompts, a.gen, ids)
        print(f"data: {len(toks)} sequences x {a.gen} generated tokens in {time.time() - t0:.0f} s", flush=True)

    mask_id = a.mask_token_id if a.mask_token_id >= 0 else V - 1
    cfg = draft_config(target_hidden=H, target_layers=info["n_layer"], vocab=V, n_layers=a.layers,
                       block_size=a.block, mask_token_id=mask_id, n_head=a.heads, n_head_kv=a.kv_heads,
                       head_dim=a.head_dim, ffn=a.ffn, target_layer_ids=ids,
                       dtype="bfloat16" if a.dtype == "bf16" else "float32")
    if a.generation == 2:
        cfg["architectures"] = ["DFlash2DraftModel"]
        cfg["auto_map"] = {"AutoModel": "dflash.DFlash2DraftModel"}
        cfg["dflash_config"].update({"conv_kernel_size": a.conv_kernel_size, "conv_group_size": a.conv_group_size,
                                     "selector_rank": a.selector_rank, "selector_top_k": a.selector_top_k})
    emb_np, head_np = target_tables(a.target)
    emb, head = torch.from_numpy(emb_np), torch.from_numpy(head_np)
    net = DraftNet(cfg)
    for p in net.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    for m in net.modules():  # the convolutions start as the identity
        if isinstance(m, GroupedConv):
            torch.nn.init.zeros_(m.kernel_projection.weight)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.05)
    B = a.block
    T = len(toks[0])
    lo = [len(p) for p in prompts]
    weights = torch.exp(-torch.arange(B - 1).float() / 6.0)
    losses = []
    for step in range(a.steps):
        s = int(rng.integers(max(lo), T - B + 1))  # anchors whose block targets are all target-generated
        rows = rng.integers(0, len(toks), a.batch)
        f = torch.from_numpy(np.stack([feats[r][:s] for r in rows]))
        tk = torch.from_numpy(np.stack([toks[r][s:s + B] for r in rows]))
        block = tk.clone()
        block[:, 1:] = mask_id
        h = net(f, emb[block], torch.arange(0, s + B))
        logits = h[:, 1:] @ head.T
        ce = F.cross_entropy(logits.reshape(-1, V), tk[:, 1:].reshape(-1), reduction="none").view(a.batch, B - 1)
        loss = (ce * weights).sum(1).mean() / weights.sum()
        if a.generation == 2:
            sel, cover = selector_loss(net, h, logits, tk, a.selector_top_k)
            loss = loss + sel
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == a.steps - 1:
            extra = f" (selector {sel.item():.4f}, true token a candidate in {cover:.0%} of rows)" if a.generation == 2 else ""
            print(f"step {step:5d} loss {np.mean(losses[-100:]):.4f}{extra}", flush=True)

    from safetensors.torch import save_file
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    sd = {k: v.detach().to(dt).contiguous() for k, v in net.state_dict().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    log = {"args": vars(a), "loss_every_10_steps": [round(v, 4) for v in losses[::10]]}
    kind = "DFlash2" if a.generation == 2 else "DFlash"
    plot_loss(losses, out / "loss.png", f"{kind} drafter distillation ({a.layers} layer(s), block {a.block})")
    if a.eval:
        log["eval"] = evaluate(a.target, out, a.eval)
        print(f"held-out mean accept: {log['eval']}", flush=True)
    (out / "train_log.json").write_text(json.dumps(log) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
