"""Train a multi-token-prediction (MTP) head for a qwen35 target GGUF and write it into a copy of the file as
llama.cpp's converter writes one (qwen35.nextn_predict_layers = 1, block_count + 1, blk.N.* for the head's
full-attention layer and blk.N.nextn.{eh_proj, enorm, hnorm, shared_head_norm}), on CPU.

The head (vLLM's qwen3_5_mtp / llama.cpp's graph_mtp math): row p reads the embedding of token p and the
trunk's last hidden state at p - 1 after output_norm; u = eh_proj . [rms(e) * enorm | rms(h) * hnorm]; one
gated full-attention decoder layer (causal, its own positions, partial NeoX RoPE, q/k norms, sigmoid gate)
+ SwiGLU; rms(.) * shared_head_norm; the trunk's frozen output head; trained to give token p + 1.
Data: the target's own greedy continuations (decoded by dflash27b) of windows of its training files, with
the trunk's last-layer residual captured for every position; labels are the target's own tokens, which is
what decides acceptance.  The layer starts as a copy of the trunk's last attention layer, eh_proj as the
identity on the hidden half.

  python models/train/train_mtp.py TARGET.gguf OUT.gguf [--n-seqs 1024] [--steps 1500] ...

Seeded and deterministic on one machine (torch CPU).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distill_draft import stdlib_prompts, target_tables  # noqa: E402

from dflash27b import Decoder  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, w: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(w.clone())
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MtpHead(nn.Module):
    """The head's trainable part; tensors named as the GGUF stores them (blk.N. / blk.N.nextn. prefixes)."""

    def __init__(self, meta: dict, w: dict[str, torch.Tensor], last_attn: int):
        super().__init__()
        a = "qwen35."
        self.H = meta[a + "embedding_length"]
        self.nh, self.nkv = meta[a + "attention.head_count"], meta[a + "attention.head_count_kv"]
        self.hd, self.nrot = meta[a + "attention.key_length"], meta[a + "rope.dimension_count"]
        self.base, self.eps = meta[a + "rope.freq_base"], meta[a + "attention.layer_norm_rms_epsilon"]
        p = f"blk.{last_attn}."
        H = self.H
        self.output_norm = w["output_norm.weight"]  # frozen: the trunk's
        self.enorm = RMSNorm(torch.ones(H), self.eps)
        self.hnorm = RMSNorm(torch.ones(H), self.eps)
        eh = torch.zeros(H, 2 * H)
        eh[:, H:] = torch.eye(H)
        eh[:, :H] = 0.02 * torch.randn(H, H)
        self.eh_proj = nn.Parameter(eh)
        self.attn_norm = RMSNorm(w[p + "attn_norm.weight"], self.eps)
        self.post_norm = RMSNorm(w[p + "post_attention_norm.weight"], self.eps)
        self.q_norm = RMSNorm(w[p + "attn_q_norm.weight"], self.eps)
        self.k_norm = RMSNorm(w[p + "attn_k_norm.weight"], self.eps)
        self.head_norm = RMSNorm(w["output_norm.weight"], self.eps)
        for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            setattr(self, n, nn.Parameter(w[p + n + ".weight"].clone()))

    def rope(self, x, pos):  # x [B, T, heads, hd]: NeoX pairs on the first nrot dims
        half = self.nrot // 2
        inv = self.base ** (-torch.arange(half, dtype=torch.float64) * 2.0 / self.nrot)
        th = (pos[:, None].double() * inv[None]).float()
        c, s = torch.cos(th)[None, :, None], torch.sin(th)[None, :, None]
        a, b = x[..., :half], x[..., half:self.nrot]
        return torch.cat([a * c - b * s, a * s + b * c, x[..., self.nrot:]], -1)

    def forward(self, e, h_prev, head):
        """e [B, T, H] embeddings of tokens p, h_prev [B, T, H] trunk residual at p - 1 (zeros at 0) ->
        logits [B, T, V] for tokens p + 1."""
        B, T, H = e.shape
        hp = h_prev * torch.rsqrt(h_prev.pow(2).mean(-1, keepdim=True) + self.eps) * self.output_norm
        x = torch.cat([self.enorm(e), self.hnorm(hp)], -1) @ self.eh_proj.T
        hn = self.attn_norm(x)
        qg = (hn @ self.attn_q.T).view(B, T, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:]
        k = (hn @ self.attn_k.T).view(B, T, self.nkv, self.hd)
        v = (hn @ self.attn_v.T).view(B, T, self.nkv, self.hd)
        pos = torch.arange(T)
        q = self.rope(self.q_norm(q), pos)
        k = self.rope(self.k_norm(k), pos)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2) * torch.sigmoid(gate)
        x = x + o.reshape(B, T, -1) @ self.attn_output.T
        h2 = self.post_norm(x)
        x = x + (F.silu(h2 @ self.ffn_gate.T) * (h2 @ self.ffn_up.T)) @ self.ffn_down.T
        return self.head_norm(x) @ head.T

    def tensors(self, n: int) -> dict[str, np.ndarray]:
        p, q = f"blk.{n}.", f"blk.{n}.nextn."
        t = {p + "attn_norm.weight": self.attn_norm.weight, p + "post_attention_norm.weight": self.post_norm.weight,
             p + "attn_q_norm.weight": self.q_norm.weight, p + "attn_k_norm.weight": self.k_norm.weight,
             q + "eh_proj.weight": self.eh_proj, q + "enorm.weight": self.enorm.weight,
             q + "hnorm.weight": self.hnorm.weight, q + "shared_head_norm.weight": self.head_norm.weight}
        for nm in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            t[p + nm + ".weight"] = getattr(self, nm)
        return {k: v.detach().float().numpy() for k, v in t.items()}


def write_with_head(src: str, dst: str, head: dict[str, np.ndarray]) -> None:
    """src's metadata and tensors, plus the head as llama.cpp's converter lays one out (matrices F16 as the
    trunk's, vectors F32)."""
    from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter
    r = GGUFReader(src)
    n = int(r.fields["qwen35.block_count"].contents())
    if "qwen35.nextn_predict_layers" in r.fields:
        raise SystemExit(f"{src} already has an MTP head")
    w = GGUFWriter(dst, arch="qwen35")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = f.contents()
        if name == "qwen35.block_count":
            val = n + 1
        if name == "qwen35.attention.recurrent_layers":
            val = list(val) + [False]
        t = f.types[0]
        w.add_key_value(name, val, t, sub_type=f.types[-1] if t == VT.ARRAY else None)
    w.add_uint32("qwen35.nextn_predict_layers", 1)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())), raw_dtype=t.tensor_type)
    for name, a in head.items():
        w.add_tensor(name, a.astype(np.float16) if a.ndim == 2 else a.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--n-seqs", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(a.seed)
    from gguf import GGUFReader
    from gguf.quants import dequantize
    r = GGUFReader(a.target)
    meta = {k: f.contents() for k, f in r.fields.items() if k.startswith("qwen35.")}
    w = {t.name: torch.from_numpy(dequantize(np.asarray(t.data), t.tensor_type).reshape(
        tuple(int(v) for v in reversed(t.shape))).astype(np.float32)) for t in r.tensors}
    n_layer = meta["qwen35.block_count"]
    rec = meta["qwen35.attention.recurrent_layers"]
    last_attn = max(i for i in range(n_layer) if not rec[i])
    emb_np, head_np = target_tables(a.target)
    emb, head = torch.from_numpy(emb_np), torch.from_numpy(head_np)

    t0 = time.time()
    toks, hid = [], []
    with Decoder(a.target, kv_type="f32", ctx=4096, threads=a.threads, warm_up=False) as dec:
        prompts = stdlib_prompts(dec, a.n_seqs, a.prompt_len, rng)
        for i, p in enumerate(prompts):
            if i % 128 == 0:
                print(f"data: {i}/{len(prompts)} sequences, {time.time() - t0:.0f} s", flush=True)
            seq = list(p) + dec.generate(p, a.gen, ignore_eos=True, mode="ar", cache=False).tokens
            toks.append(np.array(seq, np.int64))
            hid.append(dec.hidden_states(seq, [n_layer - 1])[:, 0])
    print(f"data: {len(toks)} sequences in {time.time() - t0:.0f} s", flush=True)
    net = MtpHead(meta, w, last_attn)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.05)
    P = a.prompt_len
    losses = []
    for step in range(a.steps):
        rows = rng.integers(0, len(toks), a.batch)
        tk = torch.from_numpy(np.stack([toks[r] for r in rows]))             # [B, T]
        hs = torch.from_numpy(np.stack([hid[r] for r in rows]))              # [B, T, H]
        h_prev = torch.cat([torch.zeros_like(hs[:, :1]), hs[:, :-1]], 1)
        logits = net(emb[tk[:, :-1]], h_prev[:, :-1], head)                 # row p predicts token p + 1
        lab = tk[:, 1:].clone()
        lab[:, :P - 1] = -100                                                # learn the target's own tokens
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step} loss {np.mean(losses[-100:]):.3f} ({time.time() - t0:.0f} s)", flush=True)
    write_with_head(a.target, a.out, net.tensors(n_layer))
    Path(a.out).with_suffix(".train_log.json").write_text(json.dumps(
        {"args": vars(a), "losses_every_10": losses[::10], "seconds": time.time() - t0}) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
