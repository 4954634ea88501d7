"""The CPU emulator of the CUDA backend refuses what a GPU refuses at launch, so it is found without one:
dynamic shared memory over 48 KiB without cudaFuncSetAttribute's opt-in (227 KiB at most), more than 1024
threads a block, grid.y over 65535, and calls that synchronise or allocate
while the thread captures a stream; and its cp.async copies land at the issuing thread's wait, not before.  Its
schedule (DFL_EMU_SCHEDULE) reorders threads between barriers and CTAs in a grid, so a race shows as results that
change with it, and dynamic shared memory starts every CTA as garbage.  Each case of
tests/cpp/emu_launch_checks.cpp runs as its own process."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _includes() -> list[str]:
    # the shim first (cuda_runtime.h), then the backend's common.cuh and what it includes
    return ["-I", str(ROOT / "csrc" / "backend" / "cuda" / "emu" / "shim"), "-I", str(ROOT / "csrc" / "backend" / "cuda"),
            "-I", str(ROOT / "csrc"), "-I", str(ROOT / "include")]


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if not cxx:
        pytest.skip("no C++ compiler")
    exe = tmp_path_factory.mktemp("emu") / "emu_launch_checks"
    r = subprocess.run([cxx, "-std=c++17", "-O1", "-DDFL_EMU=1", *_includes(),
                        str(ROOT / "tests" / "cpp" / "emu_launch_checks.cpp"), "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def _sanitized(tmp_path_factory, name: str, flags: list[str], runtime: str) -> Path:
    """The program built with a sanitizer's flags (skipped where the compiler lacks its runtime)."""
    cxx = shutil.which("g++")
    if not cxx:
        pytest.skip("no g++")
    exe = tmp_path_factory.mktemp(name) / "emu_launch_checks"
    r = subprocess.run([cxx, "-std=c++17", *flags, "-DDFL_EMU=1", *_includes(),
                        str(ROOT / "tests" / "cpp" / "emu_launch_checks.cpp"), "-o", str(exe)],
                       capture_output=True, text=True)
    if r.returncode != 0 and runtime in r.stderr.lower():
        pytest.skip(f"no {runtime} runtime: " + r.stderr[-300:])
    assert r.returncode == 0, r.stderr[-3000:]
    probe = subprocess.run([str(exe), "smem48k"], capture_output=True, text=True, timeout=60)
    if "FATAL: " in probe.stderr:  # e.g. ThreadSanitizer and this kernel's address-space layout
        pytest.skip(f"{runtime} cannot run here: " + probe.stderr[-300:])
    return exe


@pytest.fixture(scope="module")
def asan_checks(tmp_path_factory):
    """The same program under AddressSanitizer, as tests/test_cuda_emulated.py builds the backend."""
    return _sanitized(tmp_path_factory, "emu-asan", ["-O1", "-g", "-fsanitize=address", "-fno-omit-frame-pointer"],
                      "asan")


@pytest.fixture(scope="module")
def tsan_checks(tmp_path_factory):
    """The same program under ThreadSanitizer: the emulator's race check (emu::race in its shim)."""
    return _sanitized(tmp_path_factory, "emu-tsan", ["-O2", "-g", "-fsanitize=thread"], "tsan")


def _case(exe: Path, name: str, schedule: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, ASAN_OPTIONS="detect_stack_use_after_return=0:detect_leaks=0",
               TSAN_OPTIONS="halt_on_error=0:exitcode=66")
    env.pop("DFL_EMU_SCHEDULE", None)
    if schedule is not None:
        env["DFL_EMU_SCHEDULE"] = schedule
    return subprocess.run([str(exe), name], capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize("name,ran", [("smem48k", 1), ("smem64k_opt_in", 1), ("capture_async", 11),
                                      ("cp_async_waited", 528), ("bound64", 2)])
def test_allowed_launches_run(checks, name, ran):
    r = _case(checks, name)
    assert r.returncode == 0 and r.stdout.strip() == f"ran {ran}", r.stdout + r.stderr


def test_cp_async_lands_at_the_wait(checks):
    """cp.async copies land only at the issuing thread's wait (emu::cp_async): thread 0 summing a tile the 32
    threads copied sees every part (528) when each waited before the barrier, and misses the parts of the threads
    that had not reached their wait yet when they wait after it -- the stale read a GPU could give, which the
    emulator would otherwise hide.  A misaligned copy stops the run, as the GPU faults."""
    assert _case(checks, "cp_async_waited").stdout.strip() == "ran 528"
    r = _case(checks, "cp_async_early")
    assert r.returncode == 0 and 1 <= int(r.stdout.split()[1]) < 528, r.stdout + r.stderr
    r = _case(checks, "cp_async_misaligned")
    assert r.returncode != 0 and "emu: cp.async of 16 bytes" in r.stderr


@pytest.mark.parametrize("name,why", [
    ("smem64k", "dynamic shared memory over the kernel's limit"),
    ("block1025", "threads per block (max 1024)"),
    ("grid_y", "grid.y / grid.z (max 65535)"),
    ("bound64_over", "96 threads per block over bounded_count's __launch_bounds__ (64)"),
])
def test_refused_launches_stop_with_the_reason(checks, name, why):
    r = _case(checks, name)
    assert r.returncode != 0 and "emu: launch refused: " + why in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("name,api", [("capture_sync", "cudaMemcpy (synchronous)"), ("capture_malloc", "cudaMalloc")])
def test_unsafe_calls_while_capturing_stop(checks, name, api):
    """Graph mode captures on the calling thread (cudaStreamCaptureModeThreadLocal): a synchronising or
    allocating call there would invalidate the capture on a GPU."""
    r = _case(checks, name)
    assert r.returncode != 0 and f"emu: {api} is not allowed while this thread captures a stream" in r.stderr, \
        r.stdout + r.stderr


def test_opt_in_beyond_the_device_maximum_is_an_error(checks):
    assert _case(checks, "smem_opt_in_too_big").returncode == 4


def _ran(r: subprocess.CompletedProcess) -> int:
    assert r.returncode == 0 and r.stdout.startswith("ran "), r.stdout + r.stderr
    return int(r.stdout.split()[1])


def test_a_race_changes_with_the_schedule(checks):
    """A thread reading its neighbour's shared slot with no barrier after the writes: how many read it unwritten
    depends on the order the threads run in, so the op tests run under `reverse` and `random` find such a race
    as a mismatch; with the barrier, none does in any order."""
    racy = {sched: _ran(_case(checks, "race", sched)) for sched in ("fifo", "reverse", "random:1", "random:2")}
    assert len(set(racy.values())) > 1, racy
    assert racy["fifo"] == _ran(_case(checks, "race"))  # fifo is the default
    for sched in ("fifo", "reverse", "random:1", "random:2"):
        assert _ran(_case(checks, "race_synced", sched)) == 0


def test_a_write_after_read_race_shows_out_of_fifo_order(checks):
    """block_sum's first barrier ("red may still be read by a previous call") left out: the default order
    hides the race, `reverse` (the released higher warp runs first) and `random` show it; with the barrier no
    order does."""
    assert _ran(_case(checks, "war_race")) == 0
    assert _ran(_case(checks, "war_race", "reverse")) > 0
    assert sum(_ran(_case(checks, "war_race", f"random:{seed}")) > 0 for seed in range(8)) > 0
    for sched in ("fifo", "reverse", "random:1", "random:2"):
        assert _ran(_case(checks, "war_guarded", sched)) == 0


def test_the_schedule_orders_ctas(checks):
    assert _ran(_case(checks, "cta_order")) == 0
    assert _ran(_case(checks, "cta_order", "reverse")) == 7
    firsts = {_ran(_case(checks, "cta_order", f"random:{seed}")) for seed in range(8)}
    assert len(firsts) > 1 and firsts <= set(range(8))


def test_a_bad_schedule_is_named(checks):
    r = _case(checks, "cta_order", "sideways")
    assert r.returncode != 0 and "DFL_EMU_SCHEDULE=sideways: expected fifo, reverse or random[:SEED]" in r.stderr


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "random:3"])
def test_dynamic_shared_memory_starts_as_garbage(checks, schedule):
    """What one CTA left in dynamic shared memory is never the next CTA's: every CTA starts with 0xff bytes."""
    assert _ran(_case(checks, "smem_garbage", schedule)) == 3


def test_a_full_warp_shuffle_needs_every_lane(checks):
    """The kernels' shuffles name all 32 lanes; with one exited, or in a block's partial last warp, a GPU gives
    garbage or hangs, and the emulator stops naming the warp."""
    assert _ran(_case(checks, "shfl_full_warp")) == 32
    r = _case(checks, "shfl_after_exit")
    assert r.returncode != 0 and "emu: __shfl_xor_sync over the full warp with 31 of warp 0's 32 lanes live" in r.stderr
    r = _case(checks, "shfl_partial_warp")
    assert r.returncode != 0 and "with 16 of warp 1's 32 lanes live" in r.stderr


@pytest.mark.parametrize("name", ["split_barrier", "split_shuffle"])
def test_threads_meeting_at_two_different_barriers_stop(checks, name):
    """Threads of one CTA at two different __syncthreads calls, or lanes of one warp at two different shuffles
    (a barrier in a branch only some take): a hang or garbage on a GPU, which the emulator had let meet."""
    r = _case(checks, name)
    assert r.returncode != 0 and "emu: divergent barrier: thread " in r.stderr, r.stdout + r.stderr
    assert r.stderr.count("emu_launch_checks.cpp:") == 2, r.stderr


@pytest.mark.parametrize("schedule", ["fifo", "random:4"])
def test_fiber_stacks_under_the_sanitizer_report_only_real_overflows(asan_checks, schedule):
    """The sanitizer build is the stand-in for compute-sanitizer memcheck: a kernel's stack arrays, kept across
    barriers over 32 CTAs that reuse the fibers' stacks, report nothing (the emulator leaves no stale poison on
    a finished fiber's stack), while a read one past a stack array and a write one past a device allocation or
    a static shared array are reported."""
    assert _ran(_case(asan_checks, "stack_arrays", schedule)) == 2 * 16 * 64
    assert _ran(_case(asan_checks, "device_in_bounds", schedule)) == 64
    r = _case(asan_checks, "stack_past_end", schedule)
    assert r.returncode != 0 and "stack-buffer-overflow" in r.stderr, r.stdout + r.stderr[-2000:]
    r = _case(asan_checks, "device_past_end", schedule)
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr, r.stdout + r.stderr[-2000:]
    # a static shared array is the CTA's own allocation, exactly its size: one past its end is reported too
    assert _ran(_case(asan_checks, "static_smem_in_bounds", schedule)) == 2 * 64
    r = _case(asan_checks, "static_smem_past_end", schedule)
    assert r.returncode != 0 and "heap-buffer-overflow" in r.stderr and "static_smem_row" in r.stderr, \
        r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "random:3"])
def test_static_shared_memory_starts_as_garbage(checks, schedule):
    """A static shared array (DFL_STATIC_SMEM) starts every CTA as 0xff bytes too, the first CTA included: as
    function statics they had started the first with zeros and each later one with what the last left."""
    assert _ran(_case(checks, "static_smem_garbage", schedule)) == 4


def test_static_shared_memory_counts_against_the_limit(checks):
    """Static arrays over 48 KiB, or static and dynamic together over the kernel's limit (48 KiB without the
    opt-in), are refused as on the GPU; at the limit, or with the dynamic limit raised, the launch runs."""
    assert _ran(_case(checks, "static_smem48k")) == 2
    assert _ran(_case(checks, "static_dynamic_opt_in")) == 1
    for name in ("static_smem49k", "static_dynamic_smem"):
        r = _case(checks, name)
        assert r.returncode != 0 and "emu: launch refused: static shared memory" in r.stderr, r.stdout + r.stderr


def test_every_kernel_declares_static_shared_memory_through_the_macro():
    """Only DFL_STATIC_SMEM gives the emulator the garbage start and the size check above: a plain `__shared__`
    in the backend's CUDA sources would be a function static there again."""
    plain = []
    for f in sorted((ROOT / "csrc" / "backend" / "cuda").rglob("*.cu*")):
        if "emu" in f.relative_to(ROOT / "csrc" / "backend" / "cuda").parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("//")[0]
            if "__shared__" in code and "#define" not in code:
                plain.append(f"{f.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not plain, "\n".join(plain)


def test_every_bounded_kernel_checks_its_bound():
    """A kernel declared `__launch_bounds__(n, ...)` opens with `DFL_LAUNCH_BOUND(n);` (the same n), so the
    emulator refuses the launches of more threads a block that the GPU refuses."""
    import re
    bad, seen = [], 0
    for f in sorted((ROOT / "csrc" / "backend" / "cuda").glob("*.cu*")):
        text = f.read_text()
        for m in re.finditer(r"__launch_bounds__\(", text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            if "//" in text[line_start:m.start()]:
                continue  # a comment
            depth, i = 1, m.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            bound = text[m.end():i - 1].split(",")[0].strip()
            body = text.index("{", i) + 1
            first = text[body:text.index(";", body) + 1].strip()
            seen += 1
            if first != f"DFL_LAUNCH_BOUND({bound});":
                bad.append(f"{f.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: bound {bound}, opens "
                           f"with {first!r}")
    assert seen >= 17 and not bad, "\n".join(bad)


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "random:5"])
def test_the_race_check_reports_what_no_barrier_orders(tsan_checks, schedule):
    """Under ThreadSanitizer every emulated thread is a fiber ordered with the others only by what orders them on
    a GPU, so a race is reported whatever order the schedule happened to run the threads in (the schedules find
    one only when it changes a result): a thread reading its neighbour's shared slot with no barrier after the
    writes; a lane reading shared memory another lane wrote before a shuffle (a shuffle exchanges registers and
    orders no memory); two CTAs of a launch writing one element (CTAs are unordered).  Each report names the
    kernel's line."""
    for name, line in (("rc_neighbour_race", "rc_neighbour"), ("rc_shuffle_race", "rc_after_shuffle"),
                       ("rc_cta_race", "rc_ctas")):
        r = _case(tsan_checks, name, schedule)
        assert r.returncode == 66 and "WARNING: ThreadSanitizer: data race" in r.stderr, (name, r.stderr[-3000:])
        assert f"emu_launch_checks.cpp" in r.stderr and f"in {line}(" in r.stderr, (name, r.stderr[-3000:])


@pytest.mark.parametrize("schedule", ["fifo", "reverse", "random:5"])
def test_the_race_check_is_quiet_on_what_a_gpu_orders(tsan_checks, schedule):
    """No report where a GPU orders the accesses, over CTAs that reuse everything the emulator reuses (fiber
    stacks, its scheduler, static and dynamic shared memory): the same kernels with __syncthreads or
    __syncwarp, each CTA writing its own element, and a kernel doing all of it at once (cp.async tiles waited
    for before a barrier, a block sum in dynamic shared memory through shuffles and barriers run twice, half
    the block exited before the later barriers, a second launch reading what the first wrote)."""
    for name, ran in (("rc_neighbour_synced", None), ("rc_shuffle_synced", 992), ("rc_cta_own", 6),
                      ("rc_clean", None)):
        r = _case(tsan_checks, name, schedule)
        assert r.returncode == 0 and "ThreadSanitizer" not in r.stderr, (name, r.stderr[-3000:])
        if ran is not None:
            assert r.stdout.strip() == f"ran {ran}"
    # every thread of the neighbour kernel read its neighbour's value: sum over 8 CTAs of (t + 1) % 64
    assert _case(tsan_checks, "rc_neighbour_synced", schedule).stdout.strip() == f"ran {8 * 2016}"


# -- the memory trace (csrc/backend/cuda/emu/memtrace.cpp; bench/emu_memtrace.py) ---------------------------------

@pytest.fixture(scope="module")
def memtrace_checks(tmp_path_factory):
    """tests/cpp/emu_memtrace_checks.cpp with ThreadSanitizer's instrumentation answered by memtrace.cpp (built
    without it), as -DDFLASH27B_CUDA_EMU_MEMTRACE=ON builds the backend."""
    cxx = shutil.which("g++")
    if not cxx:
        pytest.skip("no g++")
    d = tmp_path_factory.mktemp("emu-memtrace")
    flags = ["-std=c++17", "-O2", "-g"]
    for src, extra in ((ROOT / "tests" / "cpp" / "emu_memtrace_checks.cpp",
                        ["-fsanitize=thread", "--param=tsan-instrument-func-entry-exit=0", "-fno-tree-vectorize",
                         "-fno-tree-slp-vectorize", "-DDFL_EMU=1", "-DDFL_EMU_MEMTRACE=1", *_includes()]),
                       (ROOT / "csrc" / "backend" / "cuda" / "emu" / "memtrace.cpp", [])):
        r = subprocess.run([cxx, *flags, *extra, "-c", str(src), "-o", str(d / (src.stem + ".o"))],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
    exe = d / "emu_memtrace_checks"
    r = subprocess.run([cxx, str(d / "emu_memtrace_checks.o"), str(d / "memtrace.o"), "-ldl", "-o", str(exe)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return exe


def _trace(exe: Path, name: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{name}.json"
    r = subprocess.run([str(exe), name, str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    import json
    kernels = json.loads(out.read_text())["kernels"]
    assert len(kernels) == 1
    k = kernels[0]
    return {kind: (c["instructions"], c["bytes"], c.get("sectors", c.get("wavefronts")), c["ideal"])
            for kind, c in k.items() if isinstance(c, dict)} | {"dram": (k["dram_read_bytes"], k["dram_write_bytes"])} \
        | ({"mma": (k["mma_int8"], k["mma_tf32"])} if k["mma_int8"] or k["mma_tf32"] else {})


# 2 CTAs x 64 threads = 4 warps; (instructions, distinct bytes, sectors or wavefronts, the ideal count)
@pytest.mark.parametrize("name,want", [
    ("coalesced4", {"global_read": (4, 512, 16, 16), "global_write": (4, 512, 16, 16), "dram": (512, 512)}),
    ("strided4", {"global_read": (4, 512, 128, 16), "global_write": (4, 512, 16, 16), "dram": (4096, 512)}),
    ("vec16", {"global_read": (4, 2048, 64, 64), "global_write": (4, 2048, 64, 64), "dram": (2048, 2048)}),
    ("broadcast", {"global_read": (4, 16, 4, 4), "global_write": (4, 512, 16, 16), "dram": (32, 512)}),
    # each CTA reads the same 1 KiB: the instructions' sectors twice over, DRAM once
    ("reuse", {"global_read": (16, 2048, 64, 64), "global_write": (4, 512, 16, 16), "dram": (1024, 512)}),
    # a's instructions have 16 lanes, b's still 32 (lined up by place, not by count)
    ("divergent", {"global_read": (8, 768, 24, 24), "global_write": (4, 512, 16, 16), "dram": (768, 512)}),
    ("local_array", {"global_read": (4, 512, 16, 16), "global_write": (4, 512, 16, 16), "dram": (512, 512)}),
    ("smem_stride1", {"shared_write": (4, 512, 4, 4), "shared_read": (4, 512, 4, 4), "global_write": (4, 512, 16, 16),
                      "dram": (0, 512)}),
    ("smem_stride2", {"shared_write": (4, 512, 8, 4), "shared_read": (4, 512, 8, 4), "global_write": (4, 512, 16, 16),
                      "dram": (0, 512)}),
    ("smem_stride32", {"shared_write": (4, 512, 128, 4), "shared_read": (4, 512, 128, 4),
                       "global_write": (4, 512, 16, 16), "dram": (0, 512)}),
    ("smem_vec16", {"shared_write": (4, 2048, 16, 16), "shared_read": (4, 2048, 16, 16),
                    "global_write": (4, 512, 16, 16), "dram": (0, 512)}),
    # cp.async: its global read and shared write counted where it is issued
    ("cp_async16", {"global_read": (4, 2048, 64, 64), "shared_write": (4, 2048, 16, 16),
                    "shared_read": (4, 2048, 16, 16), "global_write": (4, 2048, 64, 64), "dram": (2048, 2048)}),
    # 4 warps, each two int8 and one tf32 mma.sync
    ("mma_count", {"global_write": (4, 512, 16, 16), "dram": (0, 512), "mma": (8, 4)}),
])
def test_memtrace_counts_what_a_profiler_would(memtrace_checks, tmp_path, name, want):
    """Kernels whose traffic is known by hand: sectors a warp instruction touches against the fewest its bytes
    need (coalesced, strided, 16-byte lanes, a broadcast), distinct DRAM bytes a launch reads, shared-memory
    wavefronts (conflict-free, 2-way, 32-way, 16-byte lanes), cp.async at its issue, lanes that skip a load,
    a thread's local array left out, and mma.sync counted once a warp."""
    assert _trace(memtrace_checks, name, tmp_path) == want


def test_memtrace_bench_arithmetic():
    """bench/emu_memtrace.py's roofline and step totals, on a kernel counted by hand and on the committed record:
    a kernel's DRAM bytes at the H100 model's rate, its wavefronts a clock an SM, its mma at the dense rate; the
    27B step's matmuls as the record's note says (AR 5.259 ms, a 23-node verify 5.580)."""
    import json
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import emu_memtrace as em
    k = {"dram_read_bytes": 3_007_000, "dram_write_bytes": 0, "mma_int8": 0, "mma_tf32": 0,
         "shared_read": {"wavefronts": 132 * 1755, "ideal": 132 * 1755}}
    m = em.roofline(k)
    assert m["dram_us"] == pytest.approx(1.0) and m["smem_us"] == pytest.approx(1.0) and m["mma_us"] == 0
    k["mma_int8"] = 1979e6 / 2 / (16 * 8 * 32) * 3   # 3 us of int8 tensor work
    assert em.roofline(k)["bound"] == "mma" and em.roofline(k)["mma_us"] == pytest.approx(3.0)
    rec = json.loads((ROOT / "bench" / "results" / "emu-memtrace.json").read_text())
    assert em.step_totals(rec["cases"]) == {"ar_step_ms": 5.259, "verify23_ms": 5.58, "verify_over_ar": 1.061}


def test_memtrace_summary_names_where_shared_time_goes():
    """A kernel bound by wavefronts it needs (no conflicts) still shows where they go: summarize's busiest
    shared-memory places, each place's share of the kernel's wavefronts, an unrolled loop's copies as one."""
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import emu_memtrace as em

    def site(where, kind, wf, n):
        return {"where": where, kind: {"instructions": n, "bytes": 128 * n, "ideal": wf, "wavefronts": wf}}
    k = {"name": "k", "launches": 1, "ctas": 1, "threads": 32, "dram_read_bytes": 0, "dram_write_bytes": 0,
         "shared_read": {"wavefronts": 100, "ideal": 100}, "shared_write": {"wavefronts": 20, "ideal": 20},
         "sites": [site("a.cu:1", "shared_read", 30, 30), site("a.cu:1", "shared_read", 30, 30),
                   site("a.cu:2", "shared_read", 40, 40), site("a.cu:3", "shared_write", 20, 20)]}
    s = em.summarize(k)
    assert s["worst_sites"] == []
    assert [(w["where"], w["share"]) for w in s["busiest_shared_sites"]] == [
        ("a.cu:1", 0.5), ("a.cu:2", 0.333), ("a.cu:3", 0.167)]


def test_memtrace_case_totals_of_the_committed_records():
    """bench/emu_memtrace.py's per-case model time (each kernel at its bound, summed) on the committed forward
    records: the 0.8B's 23-node verify before and after the delta-net step's float4 reads and attention's 16-bit
    tile (369.5 -> 330.9 us), its AR step level (189.5 / 189.1 us)."""
    import json
    import sys
    sys.path.insert(0, str(ROOT / "bench"))
    import emu_memtrace as em
    res = ROOT / "bench" / "results"
    before = em.case_totals(json.loads((res / "emu-memtrace-forward-stash.json").read_text())["cases"])
    after = em.case_totals(json.loads((res / "emu-memtrace-forward-attention.json").read_text())["cases"])
    assert (before["0.8b ar step"], before["0.8b tree verify 23"]) == (189.5, 369.5)
    assert (after["0.8b ar step"], after["0.8b tree verify 23"]) == (189.1, 330.9)
