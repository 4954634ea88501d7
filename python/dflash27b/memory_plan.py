"""The device memory plan, by part, computed from the files alone (no GPU needed).

One computation serves `dflash27b plan`, the plan `generate` / `serve` print before a CUDA context uploads
anything, and the check that refuses a plan the GPU cannot hold.  The target's parts come from the core
(`dfl_context_memory_plan`: weights, KV cache, recurrent state, tree state for the verify nodes, workspace);
the drafter's from its config and weights (its BF16 weights, the feature ring of captured target features,
its own K/V cache); plus a reserve for the CUDA context itself (driver, kernels, cuBLAS-free runtime).

Tree state is the per-node update a verify keeps for commit (conv input, keys, delta, decay per delta-net
layer) plus one layer's node states in scratch: for the 27B, ~3.4 MiB per node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import _handles
from ._lib import TYPE_IDS

# What the CUDA runtime itself holds on the device (context, module images, stream): an allowance, not a
# measurement of this build; the GPU record (bench/gpu_bench.sh) compares the device's use with the plan.
CUDA_CONTEXT_RESERVE = 512 << 20
PARTS = ("weights", "drafter", "kv", "recurrent", "tree_state", "feature_ring", "draft_kv", "workspace",
         "cuda_context")
PART_NAMES = {"weights": "weights", "drafter": "drafter weights", "kv": "KV cache", "recurrent": "recurrent state",
              "tree_state": "tree state", "feature_ring": "feature ring", "draft_kv": "draft KV",
              "workspace": "workspace", "cuda_context": "CUDA context"}
KV_BY_SIZE = ("f16", "q8_0", "q4_0")  # --fit tries these, largest first


@dataclass
class Plan:
    parts: dict[str, int]
    options: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def as_dict(self) -> dict:
        """The flat dict Decoder.memory_plan has always been: every part plus total."""
        return {**self.parts, "total": self.total}


def drafter_weight_bytes(info: dict, draft_type: str | None) -> int:
    """The drafter's weights in memory: as stored (the loaded info's weight_bytes), or with the matrices
    converted at load (bf16: 2 bytes a value; q8_0: 34 bytes per 32), the norm vectors as stored."""
    stored = int(info["weight_bytes"])
    if draft_type is None or not stored:
        return stored
    H, L, F, D = info["hidden"], info["n_layer"], info["n_ff"], info["head_dim"]
    Q, KV = info["n_head"] * D, info["n_head_kv"] * D
    mats = H * H * info["n_target_layers"] + L * (2 * Q * H + 2 * KV * H + 3 * F * H)
    vecs = 2 * H + L * (2 * H + 2 * D)
    if info.get("generation") == 2:  # DFlash2: per layer two conv projections and base kernels; the selector
        K, G = info["conv_kernel_size"], H // info["conv_group_size"]
        R, V = info["selector_rank"], info["n_vocab"]
        mats += L * 2 * (2 * K * G * H) + R * H + 2 * V * R   # ... its projection and its two codebooks
        vecs += L * 2 * (2 * K * H)
    elem = stored / (mats + vecs)  # one dtype in the file
    per_mat = {"bf16": 2.0, "q8_0": 34 / 32}[draft_type]
    return int(round(mats * per_mat + vecs * elem))


def drafter_parts(info: dict, ring: int, draft_type: str | None = None) -> dict[str, int]:
    """The drafter's weights, its feature ring (f32 rows of the captured target layers) and its K/V cache
    (ring + one block of f32 rows per drafter layer).  info: a loaded drafter's (weights as held) or a
    config's with the stored weight bytes and the type to convert to."""
    return {"drafter": drafter_weight_bytes(info, draft_type),
            "feature_ring": ring * info["n_target_layers"] * info["hidden"] * 4,
            "draft_kv": info["n_layer"] * 2 * (ring + info["block_size"]) * info["n_head_kv"] * info["head_dim"] * 4}


# A draft model keeps one delta-net snapshot per drafted position: planned for blocks of up to 16 drafts.
DRAFT_MODEL_SNAPSHOTS = 16


def draft_model_parts(draft_model: _handles.Model, *, ctx: int, kv_type: str, batch: int, device: str,
                      state_type: str = "f32") -> dict[str, int]:
    """A draft model's weights, and its own context: KV cache, delta-net state and its snapshots, workspace."""
    dp = _handles.memory_plan(draft_model, ctx, batch, TYPE_IDS[kv_type], 1 if device == "cuda" else 0, 0,
                              TYPE_IDS[state_type])
    return {"drafter": dp["weights"],
            "draft_kv": dp["kv"] + dp["recurrent"] * (1 + DRAFT_MODEL_SNAPSHOTS) + dp["workspace"]}


def plan_for(model: _handles.Model, draft_info: dict | None, *, ctx: int, kv_type: str, nodes: int,
             feature_ring: int, batch: int, device: str, draft_type: str | None = None,
             state_type: str = "f32", draft_model: _handles.Model | None = None, slots: int = 1) -> Plan:
    """The plan for a loaded (mapped) target and an optional DFlash drafter's info (draft_type: the conversion
    still to apply to the info's stored weights; None when the info is of the drafter as loaded) or draft
    model (a qwen35 GGUF: its weights and its own context of the same length and KV type).  slots: contexts
    of `ctx` each (serve --parallel): everything but the weights is held once per slot."""
    core = _handles.memory_plan(model, ctx, batch, TYPE_IDS[kv_type], 1 if device == "cuda" else 0, nodes,
                                TYPE_IDS[state_type])
    parts = dict.fromkeys(PARTS, 0)
    for k in ("weights", "kv", "recurrent", "tree_state", "workspace"):
        parts[k] = core[k]
    if draft_info is not None:
        parts.update(drafter_parts(draft_info, feature_ring, draft_type))
    if draft_model is not None:
        parts.update(draft_model_parts(draft_model, ctx=ctx, kv_type=kv_type, batch=batch, device=device,
                                       state_type=state_type))
    for k in ("kv", "recurrent", "tree_state", "feature_ring", "draft_kv", "workspace"):
        parts[k] *= slots
    if device == "cuda":
        parts["cuda_context"] = CUDA_CONTEXT_RESERVE
    opts = {"ctx": ctx, "slots": slots, "kv_type": kv_type, "verify_nodes": nodes, "feature_ring": feature_ring if draft_info else 0,
            "batch": batch, "device": device,
            "draft_type": (draft_type or "stored") if draft_info else "model" if draft_model is not None else None,
            "state_type": state_type}
    return Plan(parts, opts)


def fit(model: _handles.Model, draft_info: dict | None, vram: int, *, max_ctx: int, nodes: int, feature_ring: int,
        batch: int, draft_type: str | None = None, state_type: str = "f32", min_ctx: int = 4096,
        draft_model: _handles.Model | None = None) -> Plan | None:
    """The largest context (powers of two from max_ctx down to min_ctx, max_ctx itself first) and, for it, the
    largest KV type whose plan fits in vram bytes (a draft model's context at the same length and type
    counted); None when nothing does."""
    ctxs = [max_ctx]
    c = 1 << (max_ctx.bit_length() - 1)
    while c >= min_ctx:
        if c < max_ctx:
            ctxs.append(c)
        c >>= 1
    for ctx in ctxs:
        for kv in KV_BY_SIZE:
            p = plan_for(model, draft_info, ctx=ctx, kv_type=kv, nodes=nodes, feature_ring=feature_ring, batch=batch,
                         device="cuda", draft_type=draft_type, state_type=state_type, draft_model=draft_model)
            if p.total <= vram:
                return p
    return None


def format_plan(plan: dict, device: str, vram: int | None = None) -> str:
    """One line per part (parts that are zero are left out), then the total and, given vram, the verdict."""
    mib = lambda b: f"{b / 2**20:10.1f} MiB"  # noqa: E731
    lines = [f"memory plan ({device}):"]
    lines += [f"  {PART_NAMES[k]:<17}{mib(plan[k])}" for k in PARTS if plan.get(k)]
    lines.append(f"  {'total':<17}{mib(plan['total'])}  ({plan['total'] / 2**30:.2f} GiB)")
    if vram is not None:
        verdict = "fits" if plan["total"] <= vram else "does NOT fit"
        lines.append(f"  {verdict} in {vram / 2**30:.2f} GiB ({(vram - plan['total']) / 2**20:+.1f} MiB to spare)")
    return "\n".join(lines)
