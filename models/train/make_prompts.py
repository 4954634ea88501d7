"""Write the held-out code prompts of the bundled pair: `models/heldout_prompts.jsonl`.

Ten prompts, each a function header (with up to six lines of the code above it) from a different
standard-library file that the target never trained on (train_target.split_files' held-out twentieth).
Deterministic: sorted files, the first `def` line after the file's first 40 lines.

  python models/train/make_prompts.py [OUT.jsonl]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_target import split_files, stdlib_files  # noqa: E402


def heldout_prompts(n: int = 10) -> list[dict]:
    _, held = split_files(stdlib_files())
    out = []
    for f in held:
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        for i in range(40, len(lines)):
            s = lines[i].lstrip()
            if s.startswith("def ") and s.rstrip().endswith(":"):
                ctx = lines[max(0, i - 6):i + 1]
                out.append({"task_id": f"stdlib-heldout/{f.name}:{i + 1}", "prompt": "\n".join(ctx) + "\n"})
                break
        if len(out) == n:
            break
    return out


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "heldout_prompts.jsonl"
    rows = heldout_prompts()
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
