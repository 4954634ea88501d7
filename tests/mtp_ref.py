"""Test helper (not a test): an MTP head and its chain decode in PyTorch, from a transformers checkpoint.

The trunk is transformers' Qwen3_5ForCausalLM.  The head (vLLM's qwen3_5_mtp math) is built from the
checkpoint's `mtp.*` tensors with transformers' own modules: row p fuses the embedding of token p with the
trunk's last hidden state (after its final norm) at p - 1 — Gemma-style (1 + w) norms, [embedding | hidden]
into mtp.fc — and runs a one-layer Qwen3_5ForCausalLM holding mtp.layers.0 / mtp.norm and the trunk's
lm_head.  A draft's depth d > 1 reads, in place of the trunk's hidden state, the head's own output at the
previous depth (after mtp.norm).

`chain_reference` is the decode loop written out plainly (no cache: every forward recomputes from token 0):
the target's greedy token, then per step a chain of block - 1 head drafts from the root, one target
forward over root + drafts, the longest agreeing prefix plus the target's bonus token.  Its per-step
accept lengths are what the engine's chain mode must report step for step.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class TorchMtp:
    def __init__(self, hf_dir: str | Path):
        import torch
        from safetensors.numpy import load_file
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        d = Path(hf_dir)
        self.cfg = json.loads((d / "config.json").read_text())
        st = load_file(str(d / "model.safetensors"))
        self.st = {k: torch.from_numpy(v) for k, v in st.items()}
        self.trunk = Qwen3_5ForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        one = dict({k: v for k, v in self.cfg.items() if k not in ("architectures", "transformers_version")},
                   num_hidden_layers=1, layer_types=["full_attention"])
        one.pop("mtp_num_hidden_layers", None)
        self.head = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**one)).to(torch.float32).eval()
        sd = {"model.norm.weight": st["mtp.norm.weight"], "lm_head.weight": st["lm_head.weight"],
              "model.embed_tokens.weight": st["model.embed_tokens.weight"]}
        sd.update({"model.layers.0." + k[len("mtp.layers.0."):]: v for k, v in st.items()
                   if k.startswith("mtp.layers.0.")})
        got = self.head.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=False)
        assert not got.unexpected_keys and all("rotary" in k for k in got.missing_keys), got

    def _norm(self, x, w):  # Qwen3.5's RMSNorm: (1 + w)
        import torch
        eps = self.cfg["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + self.st[w])

    def trunk_hidden(self, ids: list[int]):
        """The trunk's last hidden state (after its final norm) [n, H] and logits [n, V]."""
        import torch
        with torch.no_grad():
            out = self.trunk(input_ids=torch.tensor([ids]), output_hidden_states=True)
            return out.hidden_states[-1][0], out.logits[0]

    def head_forward(self, tokens: list[int], hprev):
        """Rows p = (token p, hprev[p]): logits [n, V] and the head's output after mtp.norm [n, H]."""
        import torch
        with torch.no_grad():
            e = self.trunk.model.embed_tokens(torch.tensor([tokens]))[0]
            u = torch.cat([self._norm(e, "mtp.pre_fc_norm_embedding.weight"),
                           self._norm(hprev, "mtp.pre_fc_norm_hidden.weight")], -1) @ self.st["mtp.fc.weight"].T
            out = self.head(inputs_embeds=u[None], output_hidden_states=True)
            return out.logits[0], out.hidden_states[-1][0]

    def logits(self, ids: list[int]) -> np.ndarray:
        """The head's logits at every position of ids (row p: token p and the trunk's hidden at p - 1)."""
        import torch
        h, _ = self.trunk_hidden(ids)
        return self.head_forward(ids, torch.cat([torch.zeros_like(h[:1]), h[:-1]]))[0].numpy()

    def chain_reference(self, prompt: list[int], n_new: int, block: int) -> tuple[list[int], list[int]]:
        """Greedy chain decoding with the head: (the tokens, each step's accept length incl. the bonus)."""
        import torch
        seq = list(prompt)
        _, logits = self.trunk_hidden(seq)
        pending = int(logits[-1].argmax())
        out, steps = [pending], []
        while len(out) < n_new:
            s = len(seq)
            L = min(block - 1, n_new - len(out))
            h, _ = self.trunk_hidden(seq)
            toks = seq + [pending]
            hprev = torch.cat([torch.zeros_like(h[:1]), h])          # row p reads the trunk at p - 1
            drafts = []
            for _ in range(L):
                lg, g = self.head_forward(toks, hprev)
                drafts.append(int(lg[-1].argmax()))
                toks = toks + [drafts[-1]]
                hprev = torch.cat([hprev, g[-1:]])                   # the next depth reads the head's own output
            _, tl = self.trunk_hidden(seq + [pending] + drafts)
            choice = tl[s:].argmax(-1).tolist()                      # the target's token after root, d1, ...
            a = 0
            while a < L and drafts[a] == choice[a]:
                a += 1
            new = drafts[:a] + [choice[a]]
            take = min(len(new), n_new - len(out))
            steps.append(take)
            out += new[:take]
            seq += [pending] + drafts[:a]
            pending = choice[a]
        return out[:n_new], steps
