"""The raw binding: cffi (ABI mode) over libdflash27b's C header.

The cdef is the installed header itself with preprocessor lines removed, so
the binding cannot drift from the C ABI.  The library is loaded once, lazily.
`check(rc)` turns a DFL_ERROR status into a Python exception carrying the
core's one-line message.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent
_ffi = None
_lib = None


class DFlashError(RuntimeError):
    """An error reported by the core (bad file, bad argument, context full, ...)."""


def _header_path(name: str = "dflash27b.h") -> Path:
    for cand in (_HERE / "include" / name, _HERE.parent.parent / "include" / name):
        if cand.is_file():
            return cand
    raise DFlashError(f"{name} not found next to the package; reinstall dflash27b")


def _library_path() -> Path:
    env = os.environ.get("DFLASH27B_LIB")
    cands = [Path(env)] if env else []
    cands += [_HERE / "libdflash27b.so", _HERE.parent.parent / "build" / "dev" / "libdflash27b.so"]
    for cand in cands:
        if cand.is_file():
            return cand
    raise DFlashError("libdflash27b.so not found; install the package with `pip install .`")


def _cdef_from_header(text: str) -> str:
    """The header minus comments, preprocessor lines and `#ifdef __cplusplus` blocks."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))


def load():
    """Returns (ffi, lib), loading the shared library on first use."""
    global _ffi, _lib
    if _lib is None:
        ffi = cffi.FFI()
        # the public ABI, then the tool entry points the tests and benchmarks call
        ffi.cdef(_cdef_from_header(_header_path().read_text()))
        ffi.cdef(_cdef_from_header(_header_path("dflash27b_dev.h").read_text()))
        ffi.cdef("#define DFL_OK 0\n#define DFL_ERROR -1")
        _lib = ffi.dlopen(str(_library_path()))
        _ffi = ffi
    return _ffi, _lib


def version_line() -> str:
    """`dflash27b VERSION (the core's build: SIMD, CUDA archs)`, as --version, bench records and /props say it."""
    from . import __version__
    try:
        ffi, lib = load()
        build = ffi.string(lib.dfl_build_info()).decode()
    except DFlashError as e:  # library missing: still answer
        build = f"core not loadable: {e}"
    return f"dflash27b {__version__} ({build})"


def last_error() -> str:
    ffi, lib = load()
    return ffi.string(lib.dfl_last_error()).decode("utf-8", "replace")


def check(rc: int) -> int:
    if rc < 0:
        raise DFlashError(last_error())
    return rc


TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14, "bf16": 30}
