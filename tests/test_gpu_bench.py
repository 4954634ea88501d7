"""The GPU record's tooling, on the CPU: everything bench/gpu_bench.sh needs that does not need the GPU.

GPU time is short and the machine is bare and offline, so the script must work the first time there:
  * the carried wheels cover every runtime dependency the GPU image lacks, one pinned version each, and
    bench/gpu_prepare.sh --check says what is missing;
  * gpu_bench.sh's arguments (parts, options, errors) and its step list (--dry-run);
  * the parsers of what the GPU run produces: pytest's JUnit XML, the backend op log, compute-sanitizer
    summaries, llama-bench's JSON;
  * every measuring part of bench/gpu_bench.py runs end to end on the CPU with the bundled pair, and the
    record it assembles has exactly the keys the issue names, with numbers in them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import dflash27b

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "gpu_bench"
_spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu_bench.py")
gb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gb)

RECORD_KEYS = {
    "device": None, "commit": None, "date": None,
    "tests": {"passed", "failed"},
    "sanitizer": {"memcheck_errors", "racecheck_hazards"},
    "exact": {"cuda_ar_eq_cpu_ar", "chain_eq_ar", "ddtree_eq_ar", "sampled_ddtree_eq_ar"},
    "ar": {"decode_tok_s", "prefill_512_tok_s", "prefill_8192_tok_s"},
    "llamacpp": {"decode_tok_s", "prefill_512_tok_s", "prefill_8192_tok_s", "build"},
    "steps": {"ar_ms", "verify_ms", "draft_ms", "ddtree22_step_ms", "commit_ms"},
    "oracle": {"accept_length", "tok_s", "speedup"},
    "memory": {"plan_bytes", "peak_bytes"},
    "copy_gb_s": None,
}


def _wheels() -> list[str]:
    return [ln.strip() for ln in (ROOT / "bench" / "gpu_wheels.txt").read_text().splitlines()
            if ln.strip() and not ln.lstrip().startswith("#")]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_wheels_cover_the_runtime_dependencies():
    wheels = _wheels()
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][A-Za-z0-9.]*", w) for w in wheels), wheels
    names = [_norm(w.split("==")[0]) for w in wheels]
    assert len(names) == len(set(names)), "one version per wheel: pip refuses two"
    image_line = next(ln for ln in (ROOT / "bench" / "gpu_wheels.txt").read_text().splitlines()
                      if ln.startswith("# image:"))
    on_image = {_norm(n) for n in image_line.split(":", 1)[1].split()}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name = _norm(re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0])
        assert name in names or name in on_image, f"{dep}: neither carried nor on the GPU image"
    assert "pycparser" in names  # cffi's own requirement, not on the image


def test_prepare_check_names_what_is_missing(tmp_path):
    env = dict(os.environ, GPU_DIR=str(tmp_path / "gpu"))
    run = subprocess.run(["bash", "bench/gpu_prepare.sh", "--check"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 1
    assert "missing wheels: " + " ".join(_wheels()) in run.stdout and "llamacpp-src.tar.gz" in run.stdout
    whl = tmp_path / "gpu" / "whl"
    whl.mkdir(parents=True)
    for w in _wheels():
        name, ver = w.split("==")
        (whl / f"{name.replace('-', '_')}-{ver}-py3-none-any.whl").write_bytes(b"x")
    (tmp_path / "gpu" / "llamacpp-src.tar.gz").write_bytes(b"x")
    run = subprocess.run(["bash", "bench/gpu_prepare.sh", "--check"], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0 and "is complete" in run.stdout, run.stdout
    bad = subprocess.run(["bash", "bench/gpu_prepare.sh", "--bogus"], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument '--bogus'" in bad.stderr


def _sh(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", "bench/gpu_bench.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_gpu_bench_sh_arguments():
    h = _sh("--help")
    assert h.returncode == 0 and "part1" in h.stdout and "part2" in h.stdout and "set -uo" not in h.stdout
    for args, msg in ((), "name a part"), (("bogus",), "unknown argument 'bogus'"), \
            (("part1", "part2"), "one part at a time"), (("part1", "--arch", "x"), "--arch needs a number"), \
            (("first", "--budget", "20"), "--budget needs a number of seconds above 30"), \
            (("first", "--budget"), "--budget needs a number"):
        r = _sh(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_gpu_bench_sh_dry_run_lists_every_step():
    one = _sh("--dry-run", "part1")
    assert one.returncode == 0, one.stdout + one.stderr
    for s in ("build (sm_90)", "dfl_backend_ops", "pytest -m cuda", "gpu_bench.py exact --device cuda",
              "gpu_bench.py checks"):
        assert s in one.stdout, s
    two = _sh("--dry-run", "--arch", "90a", "--skip-llamacpp", "part2")
    assert two.returncode == 0, two.stdout + two.stderr
    for s in ("gpu_bench.py ours --device cuda --target build/synth-27b.gguf --draft build/synth-27b-draft",
              "gpu_bench.py record"):
        assert s in two.stdout, s
    three = _sh("--dry-run", "part3")
    assert three.returncode == 0, three.stdout + three.stderr
    for s in ("memcheck", "racecheck", "gpu_bench.py matmul", "gpu_bench.py matvec",
              "gpu_bench.py vram24 --target build/synth-27b.gguf",
              "gpu_bench.py draftmodel --target build/synth-27b.gguf --draft build/synth-0.8b.gguf",
              "gpu_bench.py prefix --target build/synth-27b.gguf", "gpu_bench.py record",
              "gpu_bench.py slots --target build/synth-27b.gguf --draft build/synth-27b-draft",
              "gpu_bench.py drafters --target build/synth-27b-mtp.gguf --draft build/synth-27b-draft"):
        assert s in three.stdout, s
    assert "llama-bench on the same file" not in two.stdout
    # the drafters part's 27B with an MTP head is written in the background (not in a dry run)
    assert "synth build/synth-27b-mtp.gguf --shape 27b \\\n        --ftype q4_k_m --mtp" in \
        (ROOT / "bench" / "gpu_bench.sh").read_text()
    skip = _sh("--dry-run", "--skip-sanitize", "part3")
    assert "racecheck" not in skip.stdout and "gpu_bench.py prefix" in skip.stdout


def test_gpu_bench_sh_first_fits_one_call():
    """`first` (a 15-minute device session: one call) runs part1, a short part2 and the record under a
    540 s budget by default; every step's limit is cut to what is left, and steps that no longer fit are
    skipped by name, not run past the call's end."""
    r = _sh("--dry-run", "first")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "budget 540s" in r.stdout
    # ours before llama-bench: llama.cpp's CUDA build (~5-6 min on 16 cores) would starve ours otherwise
    order = ["build (sm_90)", "dfl_backend_ops", "pytest -m cuda", "gpu_bench.py exact --device cuda",
             "gpu_bench.py ours --device cuda --target build/synth-27b.gguf --draft build/synth-27b-draft --repeats 1",
             "gpu_bench.py matvec",
             "gpu_bench.py llamacpp --bench build/llamacpp/bin/llama-bench --model build/synth-27b.gguf --reps 1",
             "gpu_bench.py record"]
    at = [r.stdout.index(s) for s in order]
    assert at == sorted(at), at
    assert "memcheck" not in r.stdout and "vram24" not in r.stdout  # part3 waits for a later session
    # a budget too small for anything: every step is skipped by name, the part fails, the record still runs
    tight = _sh("--dry-run", "--budget", "40", "first")
    assert tight.returncode == 1, tight.stdout + tight.stderr
    assert "build (sm_90): SKIPPED (the time budget is spent)" in tight.stdout
    assert "gpu_bench.py record" in tight.stdout


def _sourced(script: str, tmp_path: Path, path_dirs: tuple[Path, ...] = (), **env) -> subprocess.CompletedProcess:
    """Runs bash code after sourcing gpu_bench.sh (which then defines its functions and runs nothing)."""
    e = {k: v for k, v in os.environ.items() if k != "OUT"}
    e.update(env)
    e["PATH"] = os.pathsep.join([*map(str, path_dirs), e["PATH"]])
    # GPU: nothing carried (a prebuilt library in this checkout's .gpu must not stand in for the build here)
    return subprocess.run(["bash", "-c", f"source bench/gpu_bench.sh\nGPU={tmp_path / 'gpu'}\n{script}"], cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=60)


def _stub(folder: Path, name: str, body: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("#!/usr/bin/env bash\n" + body)
    (folder / name).chmod(0o755)


def test_a_step_that_is_a_shell_function_really_runs(tmp_path):
    """`run` puts each step under `timeout`, which runs programs, not shell functions: the build step
    (build_ours) exited 127 at once in the first version. Here the real build_ours runs through `run` with
    stub cmake and python3 on PATH, which record how they were called."""
    calls = tmp_path / "calls"
    stubs = tmp_path / "bin"
    _stub(stubs, "cmake", f'echo "cmake $*" >> {calls}; [ "$1" != --build ] || echo "[2/2] Linking libdflash27b.so"\n')
    _stub(stubs, "python3", f'echo "python3 $*" >> {calls}; echo "build info: stub"\n')
    r = _sourced('ARCH=90a; run 30 "build (sm_$ARCH)" build_ours; echo "rc=$? status=$status"', tmp_path, (stubs,))
    assert "rc=0 status=0" in r.stdout, r.stdout + r.stderr
    log = calls.read_text().splitlines()
    assert log[0].startswith("cmake -S . -B build/gpu") and "-DDFLASH27B_CUDA_ARCHITECTURES=90a" in log[0], log
    assert log[1].startswith("cmake --build build/gpu") and log[2].startswith("python3 -c"), log
    assert "Linking libdflash27b.so" in r.stdout  # the build log's tail reaches the console


def test_a_failing_build_names_its_errors_and_fails_the_part(tmp_path):
    stubs = tmp_path / "bin"
    _stub(stubs, "cmake", '[ "$1" != --build ] || { echo "cuda/x.cu(3): error: bad thing"; exit 1; }\n')
    r = _sourced('run 30 "build (sm_90)" build_ours; echo "rc=$? status=$status"', tmp_path, (stubs,))
    assert "rc=1 status=1" in r.stdout and "cuda/x.cu(3): error: bad thing" in r.stdout, r.stdout + r.stderr
    assert "build (sm_90): FAILED (exit 1)" in r.stdout


def _fake_checkout(tmp_path: Path) -> Path:
    """A checkout with gpu_bench.sh and a few sources: what source_hash digests, and a build/ of its own."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "bench" / "gpu_bench.sh").write_text((ROOT / "bench" / "gpu_bench.sh").read_text())
    for rel, text in {"CMakeLists.txt": "project(x)\n", "csrc/a.cu": "// a\n", "include/x.h": "// x\n",
                      "tests/cpp/t.cpp": "// t\n", "csrc/backend/cuda/emu/shim/cuda_runtime.h": "// shim\n",
                      "tests/cpp/emu_launch_checks.cpp": "// checks\n",
                      "csrc/backend/cuda/emu/memtrace.cpp": "// trace\n",
                      "tests/cpp/emu_memtrace_checks.cpp": "// trace checks\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


@pytest.mark.parametrize("case", ["current", "other sources", "no gpu visible", "bad library", "emulator only"])
def test_the_device_runs_the_library_built_here(tmp_path, case):
    """nvcc on backend.cu alone outran the build step's 300 s on an H200 host (2026-11-28): gpu_prepare.sh
    builds the sm_90 library here and gpu_bench.sh's build step uses it when the sources it runs on digest the
    same; otherwise, or when the library does not pass the device check, it builds as before. No GPU visible
    is not the library's fault: no rebuild then.  A change to what only the emulator compiles (its shim, its
    memory trace, their check programs) keeps the library current."""
    repo = _fake_checkout(tmp_path)
    calls = tmp_path / "calls"
    stubs = tmp_path / "bin"
    check_rc = {"no gpu visible": 2, "bad library": 1}.get(case, 0)
    _stub(stubs, "cmake", f'echo "cmake $*" >> {calls}\n')
    # the device check passes after a rebuild (a second check): only the first one fails as the case says
    _stub(stubs, "python3", f'echo "python3" >> {calls}; n=$(grep -c python3 {calls}); '
                            f'[ "$n" -gt 1 ] && exit 0; exit {check_rc}\n')
    gpu = tmp_path / "gpu"
    pre = gpu / "prebuilt-sm90"
    pre.mkdir(parents=True)
    import lzma
    (pre / "libdflash27b.so.xz").write_bytes(lzma.compress(b"prebuilt lib"))
    (pre / "dfl_backend_ops.xz").write_bytes(lzma.compress(b"prebuilt ops"))
    script = f"""source bench/gpu_bench.sh
GPU={gpu}
source_hash > {pre / 'source.sha256'}
{'echo changed >> csrc/a.cu' if case == 'other sources' else ''}
{'for f in csrc/backend/cuda/emu/shim/cuda_runtime.h tests/cpp/emu_launch_checks.cpp csrc/backend/cuda/emu/memtrace.cpp '
 'tests/cpp/emu_memtrace_checks.cpp; do echo changed >> $f; done' if case == 'emulator only' else ''}
mkdir -p build
run 30 "build (sm_90)" build_ours; echo "rc=$?"
"""
    e = dict(os.environ, PATH=os.pathsep.join([str(stubs), os.environ["PATH"]]))
    e.pop("OUT", None)
    r = subprocess.run(["bash", "-c", script], cwd=repo, env=e, capture_output=True, text=True, timeout=60)
    log = calls.read_text() if calls.exists() else ""
    out = r.stdout + r.stderr
    if case in ("current", "emulator only"):  # the emulator's own files are no part of an nvcc build
        assert "rc=0" in out and "prebuilt library for sm_90" in out and "cmake" not in log, out + log
        assert (repo / "build" / "gpu" / "libdflash27b.so").read_text() == "prebuilt lib"
    elif case == "other sources":
        assert "built from other sources" in out and "cmake --build build/gpu" in log and "rc=0" in out, out + log
    elif case == "no gpu visible":
        assert "rc=2" in out and "cmake" not in log, out + log
    else:
        assert "failed its check: building" in out and "cmake --build build/gpu" in log and "rc=0" in out, out + log
        assert not (repo / "build" / "gpu" / "libdflash27b.so").exists()  # the stub cmake built nothing


def test_a_step_past_its_limit_is_killed_and_named(tmp_path):
    import time
    t0 = time.monotonic()
    r = _sourced('slow() { sleep 30; echo never; }; run 1 "slow step" slow; echo "rc=$? status=$status"', tmp_path)
    assert time.monotonic() - t0 < 20
    assert "slow step: timed out after 1s" in r.stdout and "rc=124 status=1" in r.stdout, r.stdout + r.stderr
    assert "never" not in r.stdout


def test_logs_reach_out_while_the_call_runs(tmp_path):
    """The device tool returns what is under $OUT even when it kills the call at its limit: every step
    refreshes $OUT/gpu-logs.tar.gz with the logs and parts so far."""
    out = tmp_path / "out"
    out.mkdir()
    parts = ROOT / "build" / "gpu-parts"
    parts.mkdir(parents=True, exist_ok=True)
    marker = ROOT / "build" / "gpu_bench-selftest.log"
    marker.write_text("step log\n")
    try:
        r = _sourced('quick() { echo hi; }; run 10 "quick" quick', tmp_path, OUT=str(out))
        assert r.returncode == 0, r.stdout + r.stderr
        listing = subprocess.run(["tar", "-tzf", str(out / "gpu-logs.tar.gz")], capture_output=True, text=True)
        assert "gpu_bench-selftest.log" in listing.stdout and "gpu-parts/" in listing.stdout, listing.stdout
        assert not list(out.glob(".*tmp"))
    finally:
        marker.unlink()


def test_llamacpp_build_checks_the_toolkit_first(tmp_path):
    """No cuBLAS (the toolkit's or the nvidia-cublas wheel's): one line and exit 3 in seconds, nothing
    configured; the findings in toolkit.json. With cuBLAS but no libcuda stub, VMM is dropped."""
    bare = tmp_path / "cuda"
    (bare / "bin").mkdir(parents=True)
    env = dict(os.environ, CUDA_ROOT=str(bare), PYTHON="false")
    r = subprocess.run(["bash", "bench/gpu_llamacpp.sh", str(tmp_path / "src.tar.gz"), str(tmp_path / "b")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 3 and "no cuBLAS" in r.stdout, r.stdout + r.stderr
    tk = json.loads((tmp_path / "b" / "toolkit.json").read_text())
    assert tk["cublas"] is None and tk["no_vmm"] is True and not (tmp_path / "b" / "configure.log").exists()
    # cuBLAS present, no stub: configure gets -DGGML_CUDA_NO_VMM=ON (cmake stubbed: it records its arguments)
    (bare / "lib64").mkdir()
    (bare / "lib64" / "libcublas.so.13").write_bytes(b"")
    src = tmp_path / "src" / "llama.cpp"
    src.mkdir(parents=True)
    subprocess.run(["tar", "-czf", str(tmp_path / "src.tar.gz"), "-C", str(tmp_path / "src"), "llama.cpp"], check=True)
    stubs = tmp_path / "bin"
    _stub(stubs, "cmake", f'echo "$*" >> {tmp_path}/cmake.args\n')
    env["PATH"] = f"{stubs}{os.pathsep}{env['PATH']}"
    r = subprocess.run(["bash", "bench/gpu_llamacpp.sh", str(tmp_path / "src.tar.gz"), str(tmp_path / "b")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
    args = (tmp_path / "cmake.args").read_text()
    assert "-DGGML_CUDA=ON" in args and "-DGGML_CUDA_NO_VMM=ON" in args and "-DCMAKE_CUDA_ARCHITECTURES=90" in args
    assert json.loads((tmp_path / "b" / "toolkit.json").read_text())["cublas_from"] == "toolkit"


def test_nvcc_build_rounds_where_the_source_says(tmp_path):
    """nvcc fuses a*b+c into one FMA unless told not to; the CPU and the emulator never do. Every nvcc
    compile of the backend must carry --fmad=false (and -lineinfo for the sanitizers)."""
    import shutil
    if not shutil.which("nvcc") and not Path("/usr/local/cuda/bin/nvcc").exists():
        pytest.skip("no nvcc")
    env = dict(os.environ)
    env["PATH"] = "/usr/local/cuda/bin" + os.pathsep + env["PATH"]
    b = tmp_path / "b"
    r = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(b), "-G", "Ninja", "-DDFLASH27B_CUDA=ON",
                        "-DDFLASH27B_CUDA_ARCHITECTURES=90"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    cmds = subprocess.run(["ninja", "-C", str(b), "-t", "commands", "dflash27b"], capture_output=True, text=True)
    nvcc = [c for c in cmds.stdout.splitlines() if "nvcc" in c.split(" ", 1)[0] and " -c " in c]
    assert len(nvcc) == len(list((ROOT / "csrc" / "backend" / "cuda").glob("*.cu"))) + 1, cmds.stdout[-2000:]  # + api
    for c in nvcc:
        assert "--fmad=false" in c and "-lineinfo" in c, c


def test_parse_junit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0"
failures="1" skipped="2" tests="5"><testcase classname="t" name="a" time="0.1"/>
<testcase classname="t" name="b" time="0.1"><failure message="assert 1 == 2">x</failure></testcase>
<testcase classname="t" name="c" time="0.1"><skipped type="pytest.skip" message="no GPU">s</skipped></testcase>
<testcase classname="t" name="d" time="0.1"><skipped type="pytest.xfail" message="near-tie">s</skipped></testcase>
<testcase classname="t" name="e" time="0.1"/></testsuite></testsuites>""")
    assert gb.parse_junit(xml) == {"passed": 2, "failed": 1, "skipped": 1, "xfailed": 1}


def test_parse_backend_ops_and_sanitizer():
    assert gb.parse_backend_ops("matmul Q4_K n=1: ok\nrmsnorm n=3: ok\nALL OK\n") == {"passed": 2, "failed": 0}
    assert gb.parse_backend_ops("matmul Q4_K n=1: ok\nattn n=7: max err 3e-2 > 1e-4\n") == {"passed": 1, "failed": 1}
    assert gb.parse_backend_ops("") == {"passed": 0, "failed": 1}  # a crash before the first case
    mem = "========= COMPUTE-SANITIZER\n....\n========= ERROR SUMMARY: 0 errors\n"
    race = ("========= Error: Race reported between Write access at k+0x10\n"
            "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
    assert gb.parse_sanitizer(mem) == {"errors": 0, "hazards": 0, "runs": 1}
    assert gb.parse_sanitizer(race) == {"errors": 0, "hazards": 2, "runs": 1}
    assert gb.parse_sanitizer(mem + "========= ERROR SUMMARY: 3 errors\n")["errors"] == 3


def test_parse_llama_bench():
    rows = json.loads((FIX / "llama-bench.json").read_text())
    out = gb.parse_llama_bench(rows)
    assert out["decode_tok_s"] == 55.0 and out["prefill_512_tok_s"] == 2500.0 and out["prefill_8192_tok_s"] == 2100.0
    assert out["build"] == "0c1e5709 (build 1)" and out["flash_attn"] is True and out["n_gpu_layers"] == 99


def test_tree_shapes():
    for n in gb.VERIFY_NODES:
        for kind in ("chain", "tree"):
            par = gb.tree_shape(n, kind)
            assert len(par) == n - 1 and all(0 <= p <= i for i, p in enumerate(par))  # parent id < node id (1-based)
            depth = [0]
            for p in par:
                depth.append(depth[p] + 1)
            assert max(depth) == (n - 1 if kind == "chain" else (n) // 2), (n, kind, depth)


def test_every_part_on_the_cpu_makes_a_complete_record(tmp_path):
    parts = tmp_path / "parts"
    py = [sys.executable, str(ROOT / "bench" / "gpu_bench.py")]
    # The package this test imported (in CI the installed one, with its library), not the source tree's.
    pkg_root = Path(dflash27b.__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pkg_root), os.environ.get("PYTHONPATH", "")]))

    def part(*args):
        r = subprocess.run(py + list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r

    part("exact", "--device", "cpu", "--threads", "2", "--n-new", "24", "--out", str(parts / "exact.json"))
    part("ours", "--device", "cpu", "--threads", "2", "--n-decode", "24", "--prefill", "512,1024", "--nodes", "2,4,8",
         "--repeats", "1", "--steps-tokens", "8", "--ctx", "2048", "--out", str(parts / "ours.json"))
    assert "partial" not in json.loads((parts / "ours.json").read_text())  # the checkpoints, then the whole part
    part("llamacpp", "--json", str(FIX / "llama-bench.json"), "--out", str(parts / "llamacpp.json"))
    part("draftmodel", "--device", "cpu", "--threads", "2", "-n", "24", "--out", str(parts / "draftmodel.json"))
    part("prefix", "--device", "cpu", "--threads", "2", "--history", "600", "-n", "8", "--ctx", "1024",
         "--out", str(parts / "prefix.json"))
    part("slots", "--device", "cpu", "--threads", "2", "-n", "16", "--slots", "3", "--ctx", "512",
         "--out", str(parts / "slots.json"))
    part("drafters", "--device", "cpu", "--threads", "2", "-n", "16", "--ctx", "512",
         "--out", str(parts / "drafters.json"))
    junit = tmp_path / "j.xml"
    junit.write_text('<testsuites><testsuite><testcase name="a"/><testcase name="b"/></testsuite></testsuites>')
    ops = tmp_path / "ops.log"
    ops.write_text("matmul n=1: ok\nALL OK\n")
    part("checks", "--junit", str(junit), "--backend-ops", str(ops), "--out", str(parts / "checks.json"))
    r = part("record", "--parts", str(parts), "--out-dir", str(tmp_path / "results"), "--commit", "abc123")

    recs = list((tmp_path / "results").glob("gpu-*.json"))
    assert len(recs) == 1 and re.fullmatch(r"gpu-\d{8}-\d{4}\.json", recs[0].name)
    rec = json.loads(recs[0].read_text())
    for key, sub in RECORD_KEYS.items():
        assert key in rec, key
        if sub:
            assert sub <= set(rec[key]), (key, sub - set(rec[key]))
    assert rec["commit"] == "abc123" and rec["device"].startswith("cpu")
    assert rec["exact"] == {"cuda_ar_eq_cpu_ar": True, "chain_eq_ar": True, "ddtree_eq_ar": True,
                            "sampled_ddtree_eq_ar": True}
    assert rec["tests"]["passed"] == 3 and rec["tests"]["failed"] == 0
    assert rec["sanitizer"] == {"memcheck_errors": None, "racecheck_hazards": None}  # not run: null, not 0
    assert rec["ar"]["decode_tok_s"] > 0 and rec["ar"]["prefill_512_tok_s"] > 0
    assert rec["ar"]["prefill_8192_tok_s"] is None  # not measured in this run
    st = rec["steps"]
    assert set(st["verify_ms"]) == set(st["verify_tree_ms"]) == {"2", "4", "8"}
    assert all(v > 0 for v in st["verify_ms"].values()) and st["ar_ms"] > 0
    assert st["draft_ms"] > 0 and st["commit_ms"] > 0 and st["ddtree22_step_ms"] > st["draft_ms"]
    assert rec["oracle"]["accept_length"] >= 5  # block 8: up to 8 tokens per step, every draft right
    assert rec["oracle"]["eq_ar"] is True and rec["oracle"]["auto_eq_ar"] is True and rec["oracle"]["auto_tok_s"] > 0
    assert rec["llamacpp"]["decode_tok_s"] == 55.0
    assert rec["prefix"]["exact"] is True and rec["prefix"]["cached_tokens"] >= 600
    dmb = rec["draft_model"]["blocks"]
    assert set(dmb) == {f"{m}-{b}" for m in ("chain", "ddtree", "ddtree") for b in (5, 9)} | \
        {"ddtree-5-expand4", "ddtree-9-expand4"} and all(v["eq_ar"] for v in dmb.values())
    assert dmb["chain-9"]["accept_length"] >= 3 and dmb["chain-9"]["step_in_ar"] > 0
    assert rec["prefix"]["turn2_ttft_s"] < rec["prefix"]["turn1_ttft_s"]
    sl = rec["slots"]   # the bundled pair in 3 slots: AR, auto and DDTree (one drafter forward a step) == solo
    assert sl["ar_eq_solo"] and sl["auto_eq_solo"] and sl["ddtree_eq_solo"] and sl["ddtree_tok_s"] > 0
    dr = rec["drafters"]   # a tiny target with an MTP head: every drafter priced, every mode == AR
    assert set(dr["estimates"]) == {"mtp", "dflash", "lookup"}
    assert all(e["draft_in_ar"] > 0 and {"2", "8", "23"} <= set(e["verify_in_ar"]) for e in dr["estimates"].values())
    assert dr["mtp_chain"]["eq_ar"] and dr["mtp_ddtree"]["eq_ar"] and dr["auto"]["eq_ar"]
    assert dr["mtp_chain"]["step_in_ar"] > 0 and dr["auto"]["ar_step_in_ar"] > 0
    assert rec["memory"]["plan_bytes"] > 0 and rec["memory"]["peak_bytes"] is None  # no device counter on the CPU
    md = recs[0].with_suffix(".md").read_text()
    assert "| decode |" in md and "| verify 8 nodes (tree) |" in md and "DDTree-22 step" in md and "| chain-9 |" in md
    assert "| MTP head, chain |" in md and "| lookup (auto's estimates) |" in md and "auto over head + DFlash" in md
    assert "parts not measured in this run: matmul" not in md  # matmul is optional, not a missing part
    assert "wrote " in r.stdout


def test_record_with_missing_parts_is_null_not_absent(tmp_path):
    rec = gb.assemble({}, "c0ffee", "NVIDIA H100 80GB HBM3", gb._dt.datetime(2026, 11, 23, 12, 0))
    for key, sub in RECORD_KEYS.items():
        assert key in rec
        for k in sub or ():
            assert rec[key][k] is None, (key, k)
    assert any("parts not measured" in n for n in rec["notes"])
    assert "—" in gb.markdown(rec)


def test_record_names_a_kernel_set_by_the_environment(monkeypatch):
    """A run with DFLASH27B_CUDA_MMA=sync (the tiled kernel set aside after it failed on the device) says so in
    the record's notes; a run without one has no such note."""
    monkeypatch.delenv("DFLASH27B_CUDA_MMA", raising=False)
    plain = gb.assemble({}, "c", "H100", gb._dt.datetime(2026, 11, 28))
    assert not any(n.startswith("run with DFLASH27B_CUDA_") for n in plain["notes"])
    monkeypatch.setenv("DFLASH27B_CUDA_MMA", "sync")
    rec = gb.assemble({}, "c", "H100", gb._dt.datetime(2026, 11, 28))
    assert "run with DFLASH27B_CUDA_MMA=sync" in rec["notes"] and "run with DFLASH27B_CUDA_MMA=sync" in gb.markdown(rec)


def test_a_part_cut_short_keeps_what_it_measured():
    """`ours` writes its JSON after each section (marked partial), so a run the device's time limit ends still
    gives the numbers measured so far; the record says it was cut short."""
    ours = {"partial": True, "ar": {"decode_tok_s": 30.0}, "steps": {"ar_ms": 33.0}, "notes": []}
    rec = gb.assemble({"ours": ours}, "c0ffee", "NVIDIA H100 80GB HBM3", gb._dt.datetime(2026, 11, 25, 12, 0))
    assert rec["ar"]["decode_tok_s"] == 30.0 and rec["steps"]["ar_ms"] == 33.0 and rec["steps"]["draft_ms"] is None
    assert any("cut short" in n for n in rec["notes"])
    assert "cut short" in gb.markdown(rec)


def test_vram24_in_the_record():
    part = {"ctx": 131072, "cap_bytes": 24 * 2**30, "plan_bytes": 22 * 2**30, "peak_bytes": 21 * 2**30,
            "exact": True, "kv_type": "q4_0", "notes": []}
    rec = gb.assemble({"vram24": part}, "c", "H100", gb._dt.datetime(2026, 11, 23))
    assert rec["vram24"] == {"ctx": 131072, "draft_type": None, "peak_bytes": 21 * 2**30,
                             "plan_bytes": 22 * 2**30, "cap_bytes": 24 * 2**30, "exact": True}
    assert "24 GiB cap: ctx 131072, drafter stored, peak 21.00 GiB, plan 22.00 GiB" in gb.markdown(rec)
    empty = gb.assemble({}, "c", "H100", gb._dt.datetime(2026, 11, 23))
    assert empty["vram24"] is None and empty["vram24_262k"] is None
    # the 262K run beside it: the drafter in Q8_0, its own row; a refusal is a note naming the run
    big = dict(part, ctx=262144, draft_type="q8_0", plan_bytes=int(23.19 * 2**30))
    rec = gb.assemble({"vram24": part, "vram24_262k": big}, "c", "H100", gb._dt.datetime(2026, 11, 23))
    assert rec["vram24_262k"]["ctx"] == 262144 and rec["vram24_262k"]["draft_type"] == "q8_0"
    assert "ctx 262144, drafter q8_0" in gb.markdown(rec)
    refused = gb.assemble({"vram24_262k": {"ctx": 262144, "error": "plan too big", "notes": []}}, "c", "H100",
                          gb._dt.datetime(2026, 11, 23))
    assert "vram24_262k: plan too big" in refused["notes"]


def test_attention_grouping_section():
    """The CUDA attention comparison pins one query row per CTA, then restores auto, clears the tree hook,
    and reports both times and whether the tokens agree; the record and its table carry it."""
    from types import SimpleNamespace

    class Lib:
        calls: list = []

        kernels: list = []

        def dfl_cuda_attention_rows(self, toks, heads):
            self.calls.append((toks, heads))
            return 0

        def dfl_cuda_attention_kernel(self, kind):
            self.kernels.append(kind)
            return 0

    class Ctx:
        hook = "unset"

        def set_tree_hook(self, fn):
            self.hook = fn

    class Dec:
        _ctx = Ctx()

        def generate(self, ids, n, ignore_eos, mode, **kw):
            slow = Lib.calls[-1] == (1, 1) or Lib.kernels[-1] == -1
            if mode == "ddtree":
                tok, par = self._ctx.hook(len(ids), 0, 64)
                assert len(par) == 22 and len(tok) == 22  # 23 nodes: the root and 22 drafted
            ms = (2.0 if mode == "ar" else 5.0) * (3 if slow else 1)
            return SimpleNamespace(tokens=[1, 2, 3], stats=SimpleNamespace(verify_ms=[ms, ms]))

    lib, dec = Lib(), Dec()
    att = gb.attention_grouping(lib, None, dec, list(range(100)), lambda n: list(range(n)), 8)
    assert lib.calls == [(0, 0), (1, 1), (32, 32), (0, 0), (0, 0)] and lib.kernels == [0, 0, 0, -1, 0]
    assert dec._ctx.hook is None
    assert att == {"prompt_tokens": 100, "auto": {"ar_ms": 2.0, "verify23_ms": 5.0},
                   "one_row": {"ar_ms": 6.0, "verify23_ms": 15.0}, "kv_group": {"ar_ms": 2.0, "verify23_ms": 5.0},
                   "simt": {"ar_ms": 6.0, "verify23_ms": 15.0},
                   "same_tokens": True, "simt_same_tokens": True}
    rec = gb.assemble({"ours": {"attention": att, "notes": []}}, "c", "H100", gb._dt.datetime(2026, 11, 26))
    assert rec["attention"] == att
    md = gb.markdown(rec)
    assert "| verify 23 nodes (tree) after 100 tokens, attention grouped / one row a CTA | 5.000 / 15.000 | 3.00x" in md
    assert "| AR step after 100 tokens, attention on tensor cores / f32 | 2.000 / 6.000 | 3.00x" in md
    assert "| AR step after 100 tokens, attention grouped / a whole KV group a CTA | 2.000 / 2.000 | 1.00x" in md


def test_matvec_table(monkeypatch):
    """The matvec part times every AR-step shape with each rows-per-CTA pin and auto, names the fastest pin,
    and restores the automatic choice even when a call fails; the record and its table carry it."""
    import dflash27b._lib as libmod

    class Lib:
        pins: list = []
        splits: list = [0]

        def dfl_cuda_matvec_rows(self, r):
            self.pins.append(r)
            return 0

        def dfl_cuda_mma_split(self, w):
            self.splits.append(w)
            return 0

        def dfl_cuda_bench_matmul(self, tid, rows, cols, n, iters, exact):
            assert exact == 1
            if n > 8 and rows >= 2048:  # the tensor-core verify by K split
                assert iters == (100 if n <= 64 else 20) and n in gb.VERIFY_NS
                return {0: 0.05, 1: 0.04, 2: 0.03, 4: 0.035, -1: 0.2, -2: 0.045}[self.splits[-1]]
            assert iters == 200 and n in (1, 8, 23) and self.splits[-1] == 0
            return {0: 0.010, 16: 0.020, 8: 0.015, 4: 0.010, 2: 0.012, 1: 0.030, -1: 0.05}[self.pins[-1]]

    lib = Lib()
    monkeypatch.setattr(libmod, "load", lambda: (None, lib))
    saved = []  # what each checkpoint would write, at the time it is written
    part = gb.part_matvec([1, 8], checkpoint=lambda o: saved.append((o["partial"], len(o["shapes"]) + len(o["verify"]))))
    assert len(part["shapes"]) == len(gb.MATVEC_SHAPES) and not part["notes"]
    # a partial record after every shape, so a run cut short by its time limit keeps what it measured
    assert saved == [(True, k) for k in range(1, len(saved) + 1)] and "partial" not in part
    row = part["shapes"]["Q4_K 5120x17408"]["1"]
    assert row["best"] == "4" and set(row) == {"auto", "16", "8", "4", "2", "1", "best"}
    assert row["4"]["gb_s"] == pytest.approx(5120 * 68 * 144 / 1e9 / 1e-5)
    assert lib.pins[-1] == 0
    rec = gb.assemble({"matvec": part}, "c", "H100", gb._dt.datetime(2026, 11, 27))
    md = gb.markdown(rec)
    assert part["shapes"]["Q4_K 48x5120"]["23"]["best"] == "auto" and "23" not in part["shapes"]["Q4_K 5120x6144"]
    matvec_md = md.split("K-quant verify")[0]
    rows = [ln for ln in matvec_md.splitlines() if ln.startswith(("| Q4_K ", "| Q6_K ")) and " | 23 | " not in ln]
    assert len(rows) == 2 * len(gb.MATVEC_SHAPES) and all(ln.endswith(" | 4 |") for ln in rows)
    assert "| Q4_K 48x5120 | 23 | 14 | — | — | — | — | — | 3 | auto |" in md
    assert "| Q4_K 5120x17408 | 1 | " in md
    big = [f"{f} {r}x{c}" for f, r, c in gb.MATVEC_SHAPES if r >= 2048]
    assert list(part["verify"]) == big and list(part["verify"][big[0]]) == ["16", "23", "64", "512"]
    v = part["verify"]["Q4_K 17408x5120"]["23"]
    assert v["best"] == "w2" and set(v) == {"auto", "w1", "w2", "w4", "sync", "tiled", "best"}
    assert v["sync"]["gb_s"] == pytest.approx(17408 * 20 * 144 / 1e9 / 2e-4)
    assert lib.splits[-1] == 0 and rec["mma_verify"] == part["verify"]
    assert "| Q4_K 17408x5120 | 23 | 1003 | 1253 | 1671 | 1432 | 251 | 1114 | w2 |" in md

    class Failing(Lib):
        def dfl_cuda_bench_matmul(self, *a):
            return -1.0

    bad = Failing()
    monkeypatch.setattr(libmod, "load", lambda: (None, bad))
    monkeypatch.setattr(libmod, "last_error", lambda: "no device")
    part = gb.part_matvec([1])
    assert part["notes"] == ["matvec: no device"] and bad.pins[-1] == 0
