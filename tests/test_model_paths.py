"""Model names: paths, directories and Hugging Face repo ids resolved from a fake HF cache laid out as
huggingface_hub lays it out (blobs/, refs/main, snapshots/<commit>/ with symlinks into blobs)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash27b import Decoder
from dflash27b._lib import DFlashError
from dflash27b.model_paths import resolve_draft, resolve_target, scan

DISTILLED = Path(__file__).resolve().parent / "fixtures" / "tiny_draft_distilled"


def _hub_repo(hub: Path, repo_id: str, files: dict[str, Path], commit: str = "a" * 40) -> Path:
    """Lay out a cached repo: each file stored once as a blob named by its hash, linked from the snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snap = repo / "snapshots" / commit
    for rel, src in files.items():
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        dst = snap / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, dst.parent), dst)
    return snap


@pytest.fixture()
def fake_hub(tmp_path, monkeypatch, synth_gguf):
    hub = tmp_path / "hf" / "hub"
    q4, q8 = synth_gguf("q4_k_m"), synth_gguf("q8_0")
    gguf_snap = _hub_repo(hub, "unsloth/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": q4, "Tiny-Q8_0.gguf": q8,
                                                       "mmproj-F16.gguf": q8})
    # an older snapshot that refs/main does not point at must be ignored
    _hub_repo(hub, "unsloth/Tiny-GGUF", {"Tiny-Q4_K_M.gguf": q8}, commit="b" * 40)
    (hub / "models--unsloth--Tiny-GGUF" / "refs" / "main").write_text("a" * 40)
    draft_snap = _hub_repo(hub, "z-lab/Tiny-DFlash", {"config.json": DISTILLED / "config.json",
                                                     "model.safetensors": DISTILLED / "model.safetensors"})
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("DFLASH27B_MODELS", raising=False)
    return {"hub": hub, "gguf": gguf_snap, "draft": draft_snap, "q4": q4, "q8": q8}


def test_repo_id_with_quant(fake_hub):
    assert resolve_target("unsloth/Tiny-GGUF:Q4_K_M") == fake_hub["gguf"] / "Tiny-Q4_K_M.gguf"
    assert resolve_target("unsloth/Tiny-GGUF:q8_0") == fake_hub["gguf"] / "Tiny-Q8_0.gguf"
    assert resolve_target("unsloth/Tiny-GGUF:Q4_K_M").read_bytes() == fake_hub["q4"].read_bytes()
    assert resolve_draft("z-lab/Tiny-DFlash") == fake_hub["draft"]


def test_hf_hub_cache_env_wins(fake_hub, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_hub["hub"]))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    assert resolve_target("unsloth/Tiny-GGUF:Q8_0").name == "Tiny-Q8_0.gguf"


def test_ambiguous_and_missing_quant_are_clear(fake_hub):
    with pytest.raises(DFlashError, match="several GGUF files.*Tiny-Q4_K_M.gguf.*Tiny-Q8_0.gguf"):
        resolve_target("unsloth/Tiny-GGUF")
    with pytest.raises(DFlashError, match=r"nothing matching 'Q4_K'.*has: .*Tiny-Q4_K_M.gguf"):
        resolve_target("unsloth/Tiny-GGUF:Q4_K")  # Q4_K must not pick Q4_K_M
    with pytest.raises(DFlashError) as e:
        resolve_target("nobody/Missing-GGUF:Q4_K_M")
    msg = str(e.value)
    assert "models--nobody--Missing-GGUF" in msg and "DFLASH27B_MODELS is not set" in msg
    assert "nothing is downloaded" in msg
    with pytest.raises(DFlashError, match="cannot find drafter 'nobody/x'"):
        resolve_draft("nobody/x")


def test_models_dir(fake_hub, monkeypatch, tmp_path):
    md = tmp_path / "models"
    (md / "me" / "Mine").mkdir(parents=True)
    shutil.copy(fake_hub["q8"], md / "me" / "Mine" / "mine-Q8_0.gguf")
    monkeypatch.setenv("DFLASH27B_MODELS", str(md))
    assert resolve_target("me/Mine") == md / "me" / "Mine" / "mine-Q8_0.gguf"
    assert resolve_target(md / "me" / "Mine") == md / "me" / "Mine" / "mine-Q8_0.gguf"  # a directory path


def test_split_gguf_is_refused(fake_hub, monkeypatch, tmp_path):
    d = tmp_path / "split"
    d.mkdir()
    shutil.copy(fake_hub["q8"], d / "Big-Q8_0-00001-of-00002.gguf")
    shutil.copy(fake_hub["q8"], d / "Big-Q8_0-00002-of-00002.gguf")
    with pytest.raises(DFlashError, match="split GGUF.*llama-gguf-split --merge"):
        resolve_target(d)


def test_decoder_and_cli_take_repo_ids(fake_hub, tiny_f32_gguf, tmp_path, monkeypatch):
    hub = tmp_path / "hub2"
    snap = _hub_repo(hub, "me/TinyReal-GGUF", {"TinyReal-F32.gguf": tiny_f32_gguf})
    _hub_repo(hub, "z-lab/Tiny-DFlash", {"config.json": DISTILLED / "config.json",
                                         "model.safetensors": DISTILLED / "model.safetensors"})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    with Decoder("me/TinyReal-GGUF:F32", "z-lab/Tiny-DFlash", threads=1, ctx=128) as d:
        assert d.target == str(snap / "TinyReal-F32.gguf") and d.default_mode == "auto"
        want = d.generate([1, 2, 3], 8).tokens
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "-m", "me/TinyReal-GGUF:F32", "-md",
                        "z-lab/Tiny-DFlash", "--prompt-ids", "1,2,3", "-n", "8", "--json", "-t", "1"],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_CACHE": str(hub)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] == want
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "generate", "-m", "me/Nope:Q4_K_M", "x"],
                       capture_output=True, text=True, env={**os.environ, "HF_HUB_CACHE": str(hub)})
    assert r.returncode == 1 and "cannot find target 'me/Nope:Q4_K_M'" in r.stderr and "Traceback" not in r.stderr


def test_models_listing_matches_drafters(fake_hub, tiny_f32_gguf, monkeypatch, tmp_path):
    md = tmp_path / "models"
    md.mkdir()
    shutil.copy(tiny_f32_gguf, md / "tiny-F32.gguf")
    monkeypatch.setenv("DFLASH27B_MODELS", str(md))
    targets, drafts = scan()
    by_name = {t.name: t for t in targets}
    assert {"unsloth/Tiny-GGUF:Tiny-Q4_K_M.gguf", "unsloth/Tiny-GGUF:Tiny-Q8_0.gguf",
            str(md / "tiny-F32.gguf")} == set(by_name)  # mmproj skipped, old snapshot ignored
    assert by_name["unsloth/Tiny-GGUF:Tiny-Q4_K_M.gguf"].quant == "Q4_K_M"
    assert [d.name for d in drafts] == ["z-lab/Tiny-DFlash"]
    # the distilled drafter was made for the converted tiny target, not for the synthetic one
    assert by_name[str(md / "tiny-F32.gguf")].drafters == ["z-lab/Tiny-DFlash"]
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "models", "--json"], capture_output=True, text=True,
                       env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "DFLASH27B_MODELS": str(md)})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["targets"]) == 3 and out["drafters"][0]["block_size"] == 16
    r = subprocess.run([sys.executable, "-m", "dflash27b.cli", "models"], capture_output=True, text=True,
                       env={**os.environ, "HF_HOME": str(tmp_path / "hf"), "DFLASH27B_MODELS": str(md),
                            "COLUMNS": "200"})
    assert r.returncode == 0 and "z-lab/Tiny-DFlash" in r.stdout and "Q4_K_M" in r.stdout


def test_gguf_drafters_are_refused_naming_what_is_supported(tmp_path, synth_gguf):
    """A GGUF given as -md that cannot draft: a DFlash GGUF (llama.cpp / Luce conversions, layout not pinned
    down) or another architecture, each refused with one line saying what -md takes."""
    import gguf as g

    from dflash27b import Decoder, DFlashError
    from dflash27b.model_paths import resolve_draft

    dflash = tmp_path / "drafter-q8_0.gguf"
    w = g.GGUFWriter(str(dflash), "dflash")
    w.add_uint32("dflash.block_size", 16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(DFlashError, match=r"DFlash drafter stored as GGUF \(architecture 'dflash'\) is not "
                                          r"supported.*config\.json \+ model\.safetensors"):
        resolve_draft(dflash)
    other = tmp_path / "llama.gguf"
    w = g.GGUFWriter(str(other), "llama")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(DFlashError, match=r"architecture 'llama' cannot draft: -md takes a qwen35 GGUF"):
        Decoder(synth_gguf("q4_k_m"), other, device="cpu", threads=1)


def test_a_dflash2_drafter_matches_its_target_in_the_listing(monkeypatch, tmp_path):
    """The bundled pair (a DFlash2 drafter) under DFLASH27B_MODELS: listed as matching, as it drafts (the listing
    had still said DFlash2 drafters could not draft)."""
    from dflash27b.decoder import bundled_pair
    target, draft = bundled_pair()
    md = tmp_path / "models"
    md.mkdir()
    shutil.copy(target, md / "tiny-target.gguf")
    shutil.copytree(draft, md / "tiny-draft2")
    monkeypatch.setenv("DFLASH27B_MODELS", str(md))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    targets, drafts = scan()
    assert [d.generation for d in drafts] == [2]
    assert [t.drafters for t in targets] == [[drafts[0].name]]
