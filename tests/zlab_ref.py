"""z-lab's `dflash` package as the oracle: its drafter forward and its decode loop on an exact target.

`zlab_draft_logits` runs z-lab's DFlashDraftModel (transformers' own Qwen3 config and rotary embedding)
on given features and blocks; `ExactTarget` wraps the HF target so z-lab's stock loop sees the true
reference (see tests/test_zlab_generate.py); `zlab_loop_on_cpu` patches the loop's CUDA-only pieces.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import dflash.model as zl


def zlab_draft_logits(draft_dir, target_hf, calls):
    """calls: [(features [C, F], block ids [B], first position of the features)] -> logits per call."""
    model = zl.DFlashDraftModel.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
    cache = zl._make_cache(model.config)
    head = zl._output_head(target_hf)
    out = []
    with torch.inference_mode():
        for feats, block, p0 in calls:
            f = torch.from_numpy(feats)[None]
            b = torch.tensor(block)[None]
            start = p0 + f.shape[1]
            pos = torch.arange(p0, start + len(block))[None]
            h = model(target_hidden=f, noise_embedding=zl._raw_input_embeddings(target_hf, b), position_ids=pos,
                      past_key_values=cache, use_cache=True)
            zl._crop_to(cache, start)
            out.append(model.compute_logits(h[:, 1:], head)[0].numpy())
    return out


class ExactTarget(torch.nn.Module):
    """The HF target, recomputing the committed prefix without a cache on every call."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf
        self.config = hf.config
        self.lm_head = hf.lm_head
        self.hist = None

    @property
    def device(self):
        return self.hf.device

    def get_input_embeddings(self):
        return self.hf.get_input_embeddings()

    def forward(self, input_ids, position_ids, past_key_values=None, use_cache=False, logits_to_keep=0,
                output_hidden_states=False, **_):
        p0 = int(position_ids[0, 0])  # tokens before p0 are committed; anything after was rejected
        prev = self.hist[:, :p0] if self.hist is not None and p0 > 0 else input_ids[:, :0]
        self.hist = torch.cat([prev, input_ids], 1)
        out = self.hf(self.hist, use_cache=False, output_hidden_states=output_hidden_states)
        n = input_ids.shape[1]
        keep = logits_to_keep if logits_to_keep else n
        hs = tuple(h[:, -n:] for h in out.hidden_states) if output_hidden_states else None
        return SimpleNamespace(logits=out.logits[:, -keep:], hidden_states=hs)


def zlab_loop_on_cpu(monkeypatch):
    """z-lab's loop times steps with CUDA syncs and crops the target cache, which ExactTarget never fills."""
    import time
    monkeypatch.setattr(zl, "_cuda_time", time.perf_counter)
    crop = zl._crop_to
    monkeypatch.setattr(zl, "_crop_to", lambda cache, n: crop(cache, n) if cache.get_seq_length() else None)
