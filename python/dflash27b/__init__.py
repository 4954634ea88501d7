"""dflash27b: speculative decoding (DFlash drafts, DDTree verification) for qwen35 GGUF models.

The heavy lifting happens in libdflash27b (C++), reached through cffi; this
package holds the Decoder, the CLI and the model tools.

The names below load on first use (PEP 562): `import dflash27b` is light, so the `dflash27b` command
(_entry.py) can catch a Ctrl-C that arrives while numpy and the library load.
"""
__version__ = "0.1.0"

_LAZY = {"DFlashError": "_lib", "Decoder": "decoder", "GenParams": "params", "GenerateResult": "results",
         "GenerateStats": "results"}

__all__ = ["Decoder", "DFlashError", "GenParams", "GenerateResult", "GenerateStats", "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dflash27b' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
