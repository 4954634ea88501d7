"""dflash27b: speculative decoding (DFlash drafts, DDTree verification) for qwen35 GGUF models.

The heavy lifting happens in libdflash27b (C++), reached through cffi; this
package holds the Decoder, the CLI and the model tools.
"""
__version__ = "0.1.0"

from ._lib import DFlashError  # noqa: E402
from .decoder import Decoder  # noqa: E402
from .params import GenParams  # noqa: E402
from .results import GenerateResult, GenerateStats  # noqa: E402

__all__ = ["Decoder", "DFlashError", "GenParams", "GenerateResult", "GenerateStats", "__version__"]
