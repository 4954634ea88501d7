"""A GGUF file's metadata as a dict, read by the core's validating GGUF reader (the one the model loader uses),
so the project has one GGUF parser: the tokenizer, the chat template and `dflash27b models` read it here."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ._lib import DFlashError, last_error, load


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Every GGUF key -> value (arrays as lists, strings decoded), as the core's validating reader reads it."""
    ffi, lib = load()
    text = lib.dfl_gguf_metadata_json(os.fsencode(path))
    if text == ffi.NULL:
        raise DFlashError(last_error())
    try:
        return json.loads(ffi.string(text))
    finally:
        lib.dfl_string_free(text)
