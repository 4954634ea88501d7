"""Shared fixtures: tiny models built once per session.

`tiny_hf_dir` is a transformers Qwen3.5 checkpoint (the oracle) and
`tiny_f32_gguf` its conversion by the project's converter; `synth_gguf(ftype)`
writes a synthetic tiny qwen35 file of any type mix (same recipe as the
converter's model, quantised by the project's tools).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _have_cuda_device() -> bool:
    # tests/test_cuda_emulated.py runs the `cuda` tests against the emulator build of the backend
    if os.environ.get("DFLASH27B_TEST_EMULATED_CUDA") == "1":
        return True
    try:
        import ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_int(0)
        return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(n)) == 0 and n.value > 0
    except OSError:
        return False


def pytest_collection_modifyitems(config, items):
    if not _have_cuda_device():
        skip = pytest.mark.skip(reason="no CUDA device on this machine")
        for it in items:
            if "cuda" in it.keywords:
                it.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_hf import make_tiny_hf
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_hf"), seed=0)


@pytest.fixture(scope="session")
def tiny_f32_gguf(tiny_hf_dir, tmp_path_factory):
    from dflash27b.tools.convert import convert_hf_to_gguf
    out = tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf"
    convert_hf_to_gguf(tiny_hf_dir, out, "f32")
    return out


@pytest.fixture(scope="session")
def synth_gguf(tmp_path_factory):
    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("synth")

    def make(ftype: str = "q4_k_m") -> Path:
        if ftype not in cache:
            from dflash27b.tools.synth import write_synthetic
            cache[ftype] = write_synthetic(root / f"tiny-{ftype}.gguf", "tiny", ftype, seed=0)
        return cache[ftype]

    return make


@pytest.fixture(scope="session")
def ar_tokens(tiny_f32_gguf):
    """ar_tokens(prompt, kv, n): the tiny target's greedy AR continuation (cached per session)."""
    from dflash27b import Decoder
    cache: dict = {}

    def get(prompt, kv: str, n: int = 256) -> list[int]:
        key = (tuple(prompt), kv, n)
        if key not in cache:
            with Decoder(tiny_f32_gguf, kv_type=kv, ctx=1024, threads=2) as d:
                cache[key] = d.generate(list(prompt), n, ignore_eos=True, mode="ar").tokens
        return cache[key]

    return get


@pytest.fixture(scope="session")
def pair():
    """(target GGUF, drafter dir) of the bundled tiny pair (skips where the install has none)."""
    from dflash27b.decoder import bundled_pair
    p = bundled_pair()
    if p is None:
        pytest.skip("no bundled pair in this install")
    return p
