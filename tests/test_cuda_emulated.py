"""The CUDA backend's own source, run where there is no GPU.

CMake's DFLASH27B_CUDA_EMU=ON compiles csrc/backend/cuda/*.cu as C++ against csrc/backend/cuda/emu/shim,
whose launch runs every CTA's threads as fibers (barriers and warp shuffles
as written).  This builds that library plus tests/cpp/backend_ops.cpp into
build/emu-tests once, then runs
  * every backend op on "CUDA" against the CPU backend (batches up to 64 here;
    bench/gpu_bench.sh runs up to 512 on a real GPU), and
  * the `cuda`-marked Python tests (tests/test_cuda_ops.py,
    tests/test_cuda_forward.py) against the emulated device.
It proves the kernels' logic and the host code, not GPU timing, memory
ordering or occupancy: those need the lent GPU.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def workers() -> int:
    """The cores this process may use (CI has 2): the emulator runs a launch on one core, so the op test and
    the Python tests run as that many processes side by side."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except AttributeError:
        return max(1, min(4, os.cpu_count() or 1))


def run_ops(exe, *args: str, env=None, timeout: int = 1200) -> list[str]:
    """dfl_backend_ops ARGS in workers() shards at once (--shard I/N); every shard must end "ALL OK".
    Returns the case lines of all shards."""
    n = workers()
    procs = [subprocess.Popen([str(exe), *args, "--shard", f"{i}/{n}"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for i in range(n)]
    lines: list[str] = []
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        got = out.splitlines()
        bad = [ln for ln in got if not ln.endswith(": ok")]
        assert p.returncode == 0 and got and got[-1] == "ALL OK", f"shard {i}/{n}:\n" + "\n".join(bad[-40:]) + err[-2000:]
        lines += got[:-1]
    return lines


@pytest.fixture(scope="module")
def emu_build():
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("no cmake")
    out = ROOT / "build" / "emu-tests"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", str(ROOT), "-B", str(out), *gen, "-DCMAKE_BUILD_TYPE=Release",
                          "-DDFLASH27B_CUDA=OFF", "-DDFLASH27B_CUDA_EMU=ON", "-DDFLASH27B_BUILD_TESTS=ON"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    bld = subprocess.run([cmake, "--build", str(out), "-j", str(os.cpu_count() or 2)], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout[-4000:] + bld.stderr[-4000:]
    return out


def test_backend_ops_on_emulator(emu_build):
    lines = run_ops(emu_build / "dfl_backend_ops", "64")
    assert sum(ln.endswith(": ok") for ln in lines) > 500


def test_backend_ops_on_a_99_kib_card(emu_build):
    """DFL_EMU_SMEM_OPTIN_KIB=99 gives the emulated device an sm_86 / sm_89's shared memory per CTA (an RTX
    3090 or 4090): the tensor-core attention then takes 16 rows a CTA at head_dim 256 (32 on an H100), the
    tiled prefill matmul (95 KiB) still fits, and both agree with the CPU as on the big card.  The threads run
    in a random order of warps and lanes (DFL_EMU_SCHEDULE=random:2), so a shared-memory race in these kernels
    fails here."""
    env = dict(os.environ, DFL_EMU_SMEM_OPTIN_KIB="99", DFL_EMU_SCHEDULE="random:2")  # races show here too
    for family, max_batch in (("attention", "2"), ("matmul", "512")):
        lines = run_ops(emu_build / "dfl_backend_ops", "--only", family, max_batch, env=env)
        assert any(ln.startswith("27b-heads " + family) for ln in lines)


def test_cuda_tests_on_emulator(emu_build):
    env = dict(os.environ, DFLASH27B_LIB=str(emu_build / "libdflash27b.so"), DFLASH27B_TEST_EMULATED_CUDA="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    # one pytest worker a core (pytest-xdist, from the test extra), each test to whichever worker is free
    n = workers()
    spread = ["-n", str(n), "--dist", "worksteal"] if n > 1 and importlib.util.find_spec("xdist") else []
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rxs",
                          *spread, "tests/test_cuda_ops.py", "tests/test_cuda_forward.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


def sanitizer_build(name: str, build_type: str, cxx_flags: str, runtime: str, target: str | None = None) -> Path:
    """The emulator build under a sanitizer (build/NAME; `runtime`: the sanitizer's library, e.g. libasan.so,
    skipped without it): configured and built, the whole tree or one target."""
    cmake, gcc = shutil.which("cmake"), shutil.which("gcc")
    if not cmake or not gcc:
        pytest.skip("no cmake / gcc")
    lib = subprocess.run([gcc, f"-print-file-name={runtime}"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(lib) or not os.path.exists(lib):
        pytest.skip(f"no {runtime}")
    out = ROOT / "build" / name
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    cfg = subprocess.run([cmake, "-S", str(ROOT), "-B", str(out), *gen, f"-DCMAKE_BUILD_TYPE={build_type}",
                          f"-DCMAKE_CXX_FLAGS={cxx_flags}",
                          "-DDFLASH27B_CUDA=OFF", "-DDFLASH27B_CUDA_EMU=ON", "-DDFLASH27B_BUILD_TESTS=ON"],
                         capture_output=True, text=True)
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    bld = subprocess.run([cmake, "--build", str(out), *(["--target", target] if target else []),
                          "-j", str(os.cpu_count() or 2)], capture_output=True, text=True)
    assert bld.returncode == 0, bld.stdout[-4000:] + bld.stderr[-4000:]
    return out


def test_backend_under_address_sanitizer(tmp_path):
    """The stand-in for compute-sanitizer memcheck where there is no GPU: the emulator build under
    AddressSanitizer ("device" memory is exact-size host memory; dynamic shared memory ends at the launch's
    size) and UBSan's alignment check (a misaligned vector load), running the op test and a short
    AR / chain / DDTree / sampled decode of the bundled pair on the emulated device."""
    out = sanitizer_build("emu-asan-tests", "Debug", "-O1 -g -fsanitize=address,alignment "
                          "-fno-sanitize-recover=alignment -fno-omit-frame-pointer", "libasan.so")
    libasan = subprocess.run([shutil.which("gcc"), "-print-file-name=libasan.so"], capture_output=True,
                             text=True).stdout.strip()
    asan = "detect_stack_use_after_return=0:detect_leaks=0:abort_on_error=0:exitcode=86"
    # random schedule: the threads in a fresh order at every barrier, so a race shows as a mismatch
    run_ops(out / "dfl_backend_ops", "7", env=dict(os.environ, ASAN_OPTIONS=asan, DFL_EMU_SCHEDULE="random:1"))
    code = ("from dflash27b import Decoder\n"
            "with Decoder(device='cuda', ctx=256, threads=2, kv_type='q4_0') as d:\n"
            "    ids = d.tokenize('import os\\n\\n\\ndef walk(path):\\n    for root, dirs, files in os.walk(')\n"
            "    ar = d.generate(ids, 6, ignore_eos=True, mode='ar').tokens\n"
            "    dd = d.generate(ids, 6, ignore_eos=True, mode='ddtree').tokens\n"
            "    ch = d.generate(ids, 6, ignore_eos=True, mode='chain').tokens\n"
            "    d.generate(ids, 4, ignore_eos=True, mode='ddtree', temperature=0.7, seed=3)\n"
            "    assert dd == ar == ch, (ar, dd, ch)\n"
            "print('decode ok')\n")
    env = dict(os.environ, LD_PRELOAD=libasan, ASAN_OPTIONS=asan, DFLASH27B_LIB=str(out / "libdflash27b.so"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1200, env=env)
    assert run.returncode == 0 and "decode ok" in run.stdout, run.stdout[-2000:] + run.stderr[-6000:]


def test_backend_under_thread_sanitizer():
    """The stand-in for compute-sanitizer racecheck: the op test built with ThreadSanitizer, every emulated
    thread a fiber ordered with the others only by what orders them on a GPU (emu::race in the shim), so a
    shared- or global-memory race is reported whatever order the threads ran in.  Left out, block_sum's first
    barrier passes row_topk's op tests under the default schedule and is reported here (docs/GPU.md).  Every
    family at batches 1-2, and two of attention's cases (most of the run) at each model shape; the whole op test
    at max batch 3, matmul at 512 and attention at every case were clean when this check landed."""
    out = sanitizer_build("emu-tsan-tests", "RelWithDebInfo", "-O2 -g -fsanitize=thread", "libtsan.so",
                          target="dfl_backend_ops")
    exe = str(out / "dfl_backend_ops")
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0:exitcode=66")
    listed = subprocess.run([exe, "--list"], capture_output=True, text=True, env=env)
    if "FATAL: ThreadSanitizer" in listed.stderr:  # this kernel's address-space layout, say
        pytest.skip("ThreadSanitizer cannot run here: " + listed.stderr[-300:])
    rest = ",".join(f for f in listed.stdout.split() if f != "attention")
    # attention: cases 0 and 3 of each model shape (f32 and q8_0 caches), one process each, beside the rest
    runs = [[exe, "--only", rest, "2"], [exe, "--only", "attention", "--shard", "0/7", "2"],
            [exe, "--only", "attention", "--shard", "3/7", "2"]]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for a in runs]
    for a, p in zip(runs, procs):
        o, e = p.communicate(timeout=1500)
        assert p.returncode == 0 and o.splitlines()[-1:] == ["ALL OK"] and "ThreadSanitizer" not in e, \
            " ".join(a[1:]) + "\n" + o[-2000:] + e[-6000:]
        assert sum(ln.endswith(": ok") for ln in o.splitlines()) > 10


def test_backend_ops_families_and_ctest(emu_build):
    """One CTest case per op family (`ctest --test-dir BUILD -R backend_ops.matmul`); --only runs a family,
    an unknown one is refused; --time reports each family's wall time."""
    exe = str(emu_build / "dfl_backend_ops")
    fams = subprocess.run([exe, "--list"], capture_output=True, text=True).stdout.split()
    assert {"matmul", "attention", "gdn", "mma", "row_topk"} <= set(fams)
    listed = subprocess.run(["ctest", "--test-dir", str(emu_build), "-N"], capture_output=True, text=True).stdout
    for f in fams:
        assert f"backend_ops.{f}" in listed, listed
    one = subprocess.run([exe, "--only", "row_topk", "--time", "7"], capture_output=True, text=True, timeout=600)
    assert one.returncode == 0 and "row_topk" in one.stdout and "time row_topk" in one.stdout
    assert " matmul " not in one.stdout
    bad = subprocess.run([exe, "--only", "bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown op family 'bogus'" in bad.stderr
