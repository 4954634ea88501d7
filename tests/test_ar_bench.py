"""`bench/ar.py` on the tiny model: a complete record (prefill, decode, the whole verify-cost curve,
no peer), every time positive and every ratio the quotient of its times (a verify size over the AR steps timed beside it); bad numbers would show here
before they reach bench/RESULTS.md. Speed itself is measured by the script, never asserted."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dflash27b

ROOT = Path(__file__).resolve().parent.parent


def test_ar_bench_writes_the_verify_curve(tiny_f32_gguf, tmp_path):
    out = tmp_path / "ar.json"
    # the package this test imported (in CI the installed one, with its library), not the source tree's
    pkg_root = Path(dflash27b.__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg_root), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "ar.py"), "--model", str(tiny_f32_gguf), "--threads", "1",
                        "--prefill", "40", "--decode", "6", "--reps", "1", "--no-peer", "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "verify cost after 40 tokens" in r.stdout
    rec = json.loads(out.read_text())
    assert rec["threads"] == 1 and rec["prefill_tokens"] == 40 and rec["llama_cpp"] is None
    assert rec["dflash27b"]["prefill_tok_s"] > 0 and rec["dflash27b"]["decode_tok_s"] > 0
    curve = rec["verify_curve"]
    assert curve["context"] == 40 and curve["ar_step_ms"] > 0
    assert [v["n"] for v in curve["verify"]] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
    for v in curve["verify"]:
        assert v["ms"] > 0 and v["ar_ms"] > 0
        assert abs(v["ar_steps"] - v["ms"] / v["ar_ms"]) < 1e-9 * v["ar_steps"] + 1e-12


def test_cpu_name_names_the_microarchitecture(tmp_path):
    """A VM's model name alone ("AMD EPYC") spans Zen 1 to Zen 4; records carry family, model and SIMD flags."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from ar import cpu_name
    finally:
        sys.path.pop(0)
    info = tmp_path / "cpuinfo"
    block = ("processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
             "model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma f16c bmi2\n\n")
    info.write_text(block.format(i=0) + block.format(i=1))
    assert cpu_name(str(info)) == "AMD EPYC (family 25, model 1; avx2 fma f16c)"
    info.write_text("processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9654\n"
                    "flags\t\t: avx2 fma avx512f avx512_vnni\n\n")
    assert cpu_name(str(info)) == "AMD EPYC 9654 (family 25, model 17; avx2 fma avx512f avx512_vnni)"
    assert cpu_name(str(tmp_path / "missing"))  # no /proc/cpuinfo: still a name
