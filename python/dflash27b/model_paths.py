"""Model names the way users store them: a file, a directory, or a Hugging Face repo id with an optional
quant (`unsloth/Qwen3.5-27B-GGUF:Q4_K_M`, `z-lab/Qwen3.5-27B-DFlash`), looked up in the local Hugging
Face cache (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`) and in a models directory
(`DFLASH27B_MODELS`).  Nothing is ever downloaded.  `scan()` lists what is there for `dflash27b models`.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ._lib import DFlashError
from .gguf_meta import read_gguf_metadata

_REPO_ID = re.compile(r"^(?P<owner>[A-Za-z0-9][\w.-]*)/(?P<name>[\w.-]+)(?::(?P<quant>[\w.-]+))?$")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def hf_hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def models_dir() -> Path | None:
    d = os.environ.get("DFLASH27B_MODELS")
    return Path(d).expanduser() if d else None


def _quant_re(quant: str) -> re.Pattern:
    # Q4_K must not match Q4_K_M; UD-Q4_K_XL may match Q4_K_XL
    return re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)


def _ggufs(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.gguf") if "mmproj" not in p.name.lower() and p.is_file())


def _hf_snapshots() -> dict[str, Path]:
    """Model repo id -> the snapshot its refs/main points at (else its newest revision), as huggingface_hub's
    cache scan reads the cache (repos it finds corrupt are left out)."""
    hub = hf_hub_cache()
    if not hub.is_dir():
        return {}
    from huggingface_hub import scan_cache_dir
    try:
        info = scan_cache_dir(hub)
    except Exception:  # noqa: BLE001  not a cache at all: nothing in it
        return {}
    out = {}
    for r in info.repos:
        if r.repo_type != "model" or not r.revisions:
            continue
        main = [v for v in r.revisions if "main" in v.refs]
        rev = main[0] if main else max(r.revisions, key=lambda v: v.last_modified)
        out[r.repo_id] = Path(rev.snapshot_path)
    return out


def _pick_gguf(d: Path, quant: str | None, what: str) -> tuple[Path | None, str]:
    files = _ggufs(d)
    if quant:
        files = [f for f in files if _quant_re(quant).search(f.name)]
    if not files:
        have = ", ".join(f.name for f in _ggufs(d)) or "no .gguf files"
        return None, f"{what}: nothing matching {quant!r} (has: {have})" if quant else f"{what}: no .gguf files"
    firsts = [f for f in files if not _SHARD.search(f.name) or _SHARD.search(f.name).group(1) == "00001"]
    if len(firsts) > 1:
        raise DFlashError(f"{what} holds several GGUF files; name one with :QUANT or a path: "
                          + ", ".join(str(f.relative_to(d)) for f in firsts))
    f = firsts[0]
    if _SHARD.search(f.name):
        raise DFlashError(f"{f} is a split GGUF ({_SHARD.search(f.name).group(2)} parts), which dflash27b does not "
                          "read; merge it first: llama-gguf-split --merge FIRST_PART OUT.gguf")
    return f, ""


def _is_drafter(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").exists()


def _candidates(owner: str, name: str) -> list[tuple[Path, str]]:
    """Directories a repo id may live in, each with the label used in messages."""
    out: list[tuple[Path, str]] = []
    repo = hf_hub_cache() / f"models--{owner}--{name}"
    if repo.is_dir():
        snap = _hf_snapshots().get(f"{owner}/{name}")
        out.append((snap, f"Hugging Face cache {repo}") if snap else (repo, f"{repo} has no snapshot"))
    md = models_dir()
    if md is not None:
        for d in (md / owner / name, md / name):
            if d.is_dir():
                out.append((d, f"models directory {d}"))
    return out


def _looked(owner: str, name: str) -> str:
    md = models_dir()
    where = [f"{hf_hub_cache() / f'models--{owner}--{name}'} (Hugging Face cache; set HF_HUB_CACHE or HF_HOME "
             "to look elsewhere)"]
    where += ([f"{md / owner / name}", f"{md / name}"] if md is not None
              else ["no models directory (DFLASH27B_MODELS is not set)"])
    return "; ".join(where)


def resolve_target(spec: str | os.PathLike) -> Path:
    """A target GGUF file from a path, a directory holding one, or `owner/name[:QUANT]`."""
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.is_file():
        return p
    if p.is_dir():
        f, why = _pick_gguf(p, None, str(p))
        if f is None:
            raise DFlashError(f"{why}")
        return f
    if p.exists():   # a FIFO, a socket, a device: something a model is never read from
        raise DFlashError(f"{s}: not a regular file (a model is a GGUF file, or a directory holding one)")
    m = _REPO_ID.match(s)
    if m is None:
        raise DFlashError(f"{s}: no such file or directory (and not a Hugging Face repo id like "
                          "owner/name:QUANT)")
    owner, name, quant = m["owner"], m["name"], m["quant"]
    notes = []
    for d, label in _candidates(owner, name):
        if not d.is_dir() or "no snapshot" in label:
            notes.append(label)
            continue
        f, why = _pick_gguf(d, quant, label)
        if f is not None:
            return f
        notes.append(why)
    raise DFlashError(f"cannot find target {s!r}: no such file or directory here, and as a repo id (nothing "
                      f"is downloaded) looked in {_looked(owner, name)}"
                      + (f"; {'; '.join(notes)}" if notes else ""))


def _refuse_gguf_draft(p: Path) -> None:
    """A GGUF given as the drafter: say what it is and what is supported instead of a missing-config error."""
    try:
        with open(p, "rb") as f:
            if f.read(4) != b"GGUF":
                return
        arch = str(read_gguf_metadata(p).get("general.architecture", "?"))   # (a damaged GGUF: its reader's error)
    except OSError:
        return
    if "dflash" in arch.lower():
        raise DFlashError(f"{p}: a DFlash drafter stored as GGUF (architecture '{arch}') is not supported: its tensor "
                          "layout differs between converters (llama.cpp, Luce) and is not pinned down publicly; use "
                          "the drafter as z-lab publishes it, a directory with config.json + model.safetensors "
                          "(--draft-type q8_0 quantises it at load)")
    if arch != "qwen35":
        raise DFlashError(f"{p}: a GGUF model of architecture '{arch}' cannot draft: -md takes a qwen35 GGUF of the "
                          "target's vocabulary (a draft model) or a DFlash drafter directory (config.json + "
                          "model.safetensors)")


def resolve_draft(spec: str | os.PathLike) -> Path:
    """A drafter directory (config.json + model.safetensors) from a path or `owner/name`."""
    s = os.fspath(spec)
    p = Path(s).expanduser()
    if p.exists():
        if p.is_file() and p.name in ("config.json", "model.safetensors"):
            p = p.parent
        if p.is_file():
            _refuse_gguf_draft(p)
        return p  # the loader names what is missing or wrong
    m = _REPO_ID.match(s)
    if m is None or m["quant"]:
        raise DFlashError(f"{s}: no such file or directory (and not a Hugging Face repo id like owner/name)")
    notes = []
    for d, label in _candidates(m["owner"], m["name"]):
        if d.is_dir() and _is_drafter(d):
            return d
        notes.append(f"{label}: no config.json + model.safetensors")
    raise DFlashError(f"cannot find drafter {s!r}: no such file or directory here, and as a repo id (nothing "
                      "is downloaded) looked in "
                      f"{_looked(m['owner'], m['name'])}" + (f"; {'; '.join(notes)}" if notes else ""))


# -- listing ------------------------------------------------------------------------------------------------
@dataclass
class TargetEntry:
    path: Path
    name: str
    size: int
    arch: str = "?"
    quant: str = "?"
    n_layer: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    mtp: int = 0                    # MTP head layers (qwen35.nextn_predict_layers): `-md mtp` drafts with it
    drafters: list[str] = field(default_factory=list)


@dataclass
class DraftEntry:
    path: Path
    name: str
    size: int
    hidden: int = 0
    target_layers: int = 0          # the config's num_target_layers (0: absent)
    target_layer_ids: list[int] = field(default_factory=list)
    vocab: int = 0
    mask_token_id: int = -1
    block_size: int = 0
    rope: str = ""                  # "default", "linear x8", "yarn x4" ...
    sliding: str = ""               # "3/5 layers, window 2048", "" when none slides
    error: str = ""                 # the config reader's refusal, when it refuses the file
    generation: int = 1             # 2: DFlash2


def _gguf_facts(path: Path) -> dict:
    from gguf import LlamaFileType  # the names of llama.cpp's file types, nothing read with it

    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture") or "?"
    ft = meta.get("general.file_type")
    try:
        quant = LlamaFileType(ft).name.replace("MOSTLY_", "") if ft is not None else "?"
    except ValueError:
        quant = str(ft)
    mtp = int(meta.get(f"{arch}.nextn_predict_layers") or 0)
    return {"arch": arch, "quant": quant, "n_layer": int(meta.get(f"{arch}.block_count") or 0) - mtp,
            "n_embd": int(meta.get(f"{arch}.embedding_length") or 0),
            "n_vocab": len(meta.get("tokenizer.ggml.tokens") or ()), "mtp": mtp}


def _draft_facts(d: Path) -> dict | None:
    """What the core's config reader (the one loading uses) makes of a DFlash config.json; None when the
    file is not a DFlash drafter's, {"error": why} when the reader refuses it."""
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, ValueError):
        return None
    archs = cfg.get("architectures") if isinstance(cfg, dict) else None
    if not isinstance(archs, list) or not {"DFlashDraftModel", "DFlash2DraftModel"} & set(map(str, archs)):
        return None
    from ._handles import draft_config_info
    try:
        i = draft_config_info(d)
    except DFlashError as e:
        return {"error": str(e)}
    rope = i["rope_type"] + (f" x{i['rope_factor']:g}" if i["rope_type"] != "default" else "")
    sliding = (f"{i['n_sliding_layers']}/{i['n_layer']} layers, "
               + (f"window {i['sliding_window']}" if i["sliding_window"] else "causal, no window")
               if i["n_sliding_layers"] else "")
    return {"hidden": i["hidden"], "target_layers": i["num_target_layers"],
            "target_layer_ids": i["target_layer_ids"], "vocab": i["n_vocab"], "mask_token_id": i["mask_token_id"],
            "block_size": i["block_size"], "rope": rope, "sliding": sliding, "generation": i["generation"]}


def _roots() -> list[tuple[Path, str]]:
    """(directory, display name) of every model location: HF cache snapshots and the models directory."""
    out = []
    out += [(snap, repo) for repo, snap in sorted(_hf_snapshots().items())]
    md = models_dir()
    if md is not None and md.is_dir():
        out.append((md, ""))
    return out


def drafter_matches(t: TargetEntry, d: DraftEntry) -> bool:
    """The loader's pair checks (hidden size, vocabulary, mask token, captured layers inside the target),
    plus the target depth the drafter was made for when its config names one."""
    return (t.arch == "qwen35" and not d.error and d.hidden == t.n_embd and d.vocab == t.n_vocab
            and 0 <= d.mask_token_id < t.n_vocab and bool(d.target_layer_ids)
            and all(0 <= i < t.n_layer for i in d.target_layer_ids)
            and d.target_layers in (0, t.n_layer))


def scan() -> tuple[list[TargetEntry], list[DraftEntry]]:
    targets: list[TargetEntry] = []
    drafts: list[DraftEntry] = []
    for root, repo in _roots():
        for f in _ggufs(root):
            rel = str(f.relative_to(root))
            name = f"{repo}:{rel}" if repo else str(f)
            e = TargetEntry(f, name, f.stat().st_size)
            try:
                for k, v in _gguf_facts(f).items():
                    setattr(e, k, v)
            except Exception:  # not a readable GGUF: list it with what is known
                e.arch = "unreadable"
            targets.append(e)
        for cfg in sorted(root.rglob("config.json")):
            d = cfg.parent
            facts = _draft_facts(d) if _is_drafter(d) else None
            if facts is None:
                continue
            rel = str(d.relative_to(root))
            name = (repo if rel == "." else f"{repo}/{rel}") if repo else str(d)
            drafts.append(DraftEntry(d, name, (d / "model.safetensors").stat().st_size, **facts))
    for t in targets:
        t.drafters = [d.name for d in drafts if drafter_matches(t, d)]
    return targets, drafts
