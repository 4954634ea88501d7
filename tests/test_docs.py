"""The README fits a screen and opens with the two commands; every relative link in it and in docs/ resolves."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_one_screen_with_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 120 and max(map(len, lines)) <= 200
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert blocks[0].strip() == 'pip install . && dflash27b generate "def fibonacci(n):" -n 64 --compare'
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1].strip() in ci, "the README's test command is what CI runs"


def test_relative_links_resolve():
    missing = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(md.read_text()):
            if "://" in target:
                continue
            if not (md.parent / target).resolve().exists():
                missing.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not missing, missing
