"""The CUDA backend's own source, run where there is no GPU.

CMake's DFLASH27B_CUDA_EMU=ON compiles cuda/*.cu as C++ against cuda/emu/shim,
whose launch runs every CTA's threads as fibers (barriers and warp shuffles
as written).  This builds that library plus tests/cpp/backend_ops.cpp into
build/emu-tests once, then runs
  * every backend op on "CUDA" against the CPU backend (batches up to 64 here;
    bench/gpu_check.sh runs up to 512 on a real GPU), and
  * the `cuda`-marked Python tests (tests/test_cuda_ops.py,
    tests/test_cuda_forward.py) against the emulated device.
It proves the kernels' logic and the host code, not GPU timing, memory
ordering or occupancy: those need the lent GPU.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


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
    run = subprocess.run([str(emu_build / "dfl_backend_ops"), "64"], capture_output=True, text=True, timeout=1200)
    lines = run.stdout.splitlines()
    bad = [ln for ln in lines if not ln.endswith(": ok")]
    assert run.returncode == 0 and lines and lines[-1] == "ALL OK", "\n".join(bad[-40:]) + run.stderr[-2000:]
    assert sum(ln.endswith(": ok") for ln in lines) > 500


def test_cuda_tests_on_emulator(emu_build):
    env = dict(os.environ, DFLASH27B_LIB=str(emu_build / "libdflash27b.so"), DFLASH27B_TEST_EMULATED_CUDA="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rxs",
                          "tests/test_cuda_ops.py", "tests/test_cuda_forward.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout
