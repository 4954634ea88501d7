"""Train the bundled tiny qwen35 target on Python standard-library sources, on CPU.

A transformers `Qwen3_5ForCausalLM` (the real architecture: Gated DeltaNet layers with a gated full-attention
layer every 4th) with a byte-level BPE vocabulary trained on stdlib sources, trained on every non-test
stdlib `.py` file except a held-out twentieth (used for validation and for the held-out prompts), then
converted to GGUF by the project's converter.  Seeded; writes into OUT:

  hf/            the checkpoint (float32) + tokenizer files
  target.gguf    the converted model (--outtype, default q8_0)
  loss.png       training / validation loss curves (when matplotlib is installed)
  train_log.json arguments, losses, held-out file list

  python models/train/train_target.py OUT [--steps 1500] [--hidden 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from dflash27b.tools.convert import convert_hf_to_gguf
from dflash27b.tools.hf_files import write_tokenizer_files

SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if SKIP_PARTS & set(rel.parts) or rel.name.startswith("test_"):
            continue
        out.append(f)
    return out


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Every 20th file (sorted order) is held out."""
    return [f for i, f in enumerate(files) if i % 20 != 7], [f for i, f in enumerate(files) if i % 20 == 7]


def encode_files(tok, files: list[Path], eot: int) -> np.ndarray:
    ids: list[int] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids += tok.encode(text).ids + [eot]
    return np.array(ids, np.int64)


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup))) * 0.9 + peak * 0.05


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--outtype", default="q8_0", choices=["f32", "f16", "bf16", "q8_0"])
    a = ap.parse_args(argv)

    from tokenizers import Tokenizer
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(a.seed)
    out = Path(a.out)
    hf = out / "hf"
    hf.mkdir(parents=True, exist_ok=True)

    write_tokenizer_files(hf, a.vocab)
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    train_files, held_files = split_files(stdlib_files())
    t0 = time.time()
    train, held = encode_files(tok, train_files, eot), encode_files(tok, held_files, eot)
    print(f"data: {len(train_files)} files / {len(train)} tokens train, {len(held_files)} files / {len(held)} "
          f"tokens held out ({time.time() - t0:.0f} s)", flush=True)

    cfg = Qwen3_5TextConfig(
        num_hidden_layers=a.layers, hidden_size=a.hidden, intermediate_size=a.ffn, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, vocab_size=a.vocab,
        max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=im_end,
        pad_token_id=eot, rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                               mrope_section=[3, 3, 2], mrope_interleaved=True))
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    def windows(data: np.ndarray, n: int, r: np.random.Generator) -> torch.Tensor:
        starts = r.integers(0, len(data) - a.seq - 1, n)
        return torch.from_numpy(np.stack([data[s:s + a.seq + 1] for s in starts]))

    val_batch = windows(held, 32, np.random.default_rng(1234))
    log = {"args": vars(a), "train": [], "val": [], "held_out_files": [str(f.name) for f in held_files]}
    t0 = time.time()
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, a.steps, a.lr, a.warmup)
        x = windows(train, a.batch, rng)
        model.train()
        loss = torch.nn.functional.cross_entropy(model(input_ids=x[:, :-1]).logits.reshape(-1, a.vocab),
                                                 x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        log["train"].append((step, loss.item()))
        if step % a.eval_every == 0 or step == a.steps - 1:
            model.eval()
            with torch.no_grad():
                vl = torch.nn.functional.cross_entropy(
                    model(input_ids=val_batch[:, :-1]).logits.reshape(-1, a.vocab), val_batch[:, 1:].reshape(-1))
            log["val"].append((step, vl.item()))
            print(f"step {step:5d} train {np.mean([v for _, v in log['train'][-a.eval_every:]]):.3f} "
                  f"val {vl.item():.3f}  ({time.time() - t0:.0f} s)", flush=True)

    model.eval()
    model.save_pretrained(hf)
    (out / "train_log.json").write_text(json.dumps(log) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        s, v = zip(*log["train"])
        k = max(1, len(v) // 100)
        smooth = np.convolve(v, np.ones(k) / k, mode="valid")
        plt.figure(figsize=(6, 3.5))
        plt.plot(s[k - 1:], smooth, label="train (moving mean)")
        plt.plot(*zip(*log["val"]), "o-", label="held-out stdlib files")
        plt.xlabel("step")
        plt.ylabel("cross-entropy (nats/token)")
        plt.title(f"tiny qwen35 target, {n_params / 1e6:.1f} M params")
        plt.legend()
        plt.tight_layout()
        plt.savefig(out / "loss.png", dpi=110)
    except ImportError:
        print("matplotlib not installed: no loss.png", flush=True)
    convert_hf_to_gguf(hf, out / "target.gguf", a.outtype)
    print(f"wrote {out / 'target.gguf'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
