"""The code's layers point one way: a file includes or imports only its own layer or lower ones.

C++ (csrc/), lowest first:
  util -> quant -> gguf, safetensors -> model (descriptions and loaders) -> backend (backend.h, cpu/, cuda/)
  -> runtime (context, forward, drafter) -> spec (generator, proposers, sampler, trees) -> api
Python (python/dflash27b): no import circles between the package's modules (imports anywhere in a module
count, inside functions too: a circle there is still a module that cannot be understood without the other;
only `if TYPE_CHECKING:` imports, which never run, are left out).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
LAYERS = [("util",), ("quant",), ("gguf", "safetensors"), ("model",), ("backend",), ("runtime",), ("spec",),
          ("api",)]
RANK = {d: i for i, ds in enumerate(LAYERS) for d in ds}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _cxx_files():
    return [p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")]


def test_every_csrc_folder_has_a_layer():
    top = {p.relative_to(CSRC).parts[0] for p in _cxx_files()}
    assert top <= set(RANK), f"folders without a layer: {sorted(top - set(RANK))}"


def test_csrc_includes_point_down():
    bad = []
    for f in _cxx_files():
        own = f.relative_to(CSRC).parts[0]
        for inc in INCLUDE.findall(f.read_text(errors="replace")):
            head = inc.split("/", 1)[0]
            if "/" not in inc or head not in RANK:
                continue  # a header beside the file (cuda's own), the public header, a shim
            if RANK[head] > RANK[own]:
                bad.append(f"{f.relative_to(ROOT)} ({own}) includes {inc} ({head})")
    assert not bad, "includes from a lower layer to a higher one:\n" + "\n".join(bad)


def _imports(path: Path, package: str) -> set[str]:
    """The package's modules `path` imports (relative and absolute forms)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # imports for type annotations only (`if TYPE_CHECKING:`) never run: skip them
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            node.body = []
    out: set[str] = set()
    mod_parts = [package, *path.relative_to(ROOT / "python" / package).with_suffix("").parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod_parts[:-node.level] if path.name != "__init__.py" else mod_parts[:len(mod_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] != package:
                continue
            out.add(name)
            for a in node.names:  # `from . import x` / `from .tools import convert`
                out.add(f"{name}.{a.name}")
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == package)
    return out


def test_python_modules_import_no_circle():
    package = "dflash27b"
    base = ROOT / "python" / package
    modules = {}
    for p in base.rglob("*.py"):
        parts = [package, *p.relative_to(base).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = p
    graph = {m: {i for i in _imports(p, package) if i in modules and i != m and i != package}
             for m, p in modules.items()}
    # Tarjan's strongly connected components: any with two or more modules is a circle
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"
