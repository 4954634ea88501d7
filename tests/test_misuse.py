"""The Python API and the CLI used wrongly (a user's and an attacker's pass, 2026-11-29): each case had been a
traceback, a hang, wrong tokens returned as if right, or a destroyed file.  Now one line naming the problem, and
the Decoder goes on."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import pytest

from dflash27b import Decoder, DFlashError

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def dec():
    with Decoder(threads=1) as d:
        yield d


@pytest.fixture(scope="module")
def ref(dec):
    return dec.generate(PROMPT, 16, mode="ar").tokens


def test_two_threads_on_one_decoder_never_get_wrong_tokens(dec, ref):
    """One thread decodes, the other is refused while it does: every reply either equals the decode alone
    (`==`) or is that error (they had got 11 wrong tokens as if right, then a drafter error, once a segfault)."""
    got, refused, other = [], [], []

    def run():
        for _ in range(6):
            try:
                got.append(dec.generate(PROMPT, 16).tokens)
            except DFlashError as e:
                (refused if "another thread" in str(e) else other).append(str(e))
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not other and got and all(g == ref for g in got), (other, got)
    assert len(got) + len(refused) == 12


def test_a_stream_superseded_on_its_thread_says_so(dec, ref):
    """A decode started while a stream is open takes the context: the open stream's next step is an error (it
    had yielded nothing, silently), and the new decode is exact."""
    s = dec.stream_ids(PROMPT, 16, mode="ar")
    assert next(s) == ref[:1]
    assert dec.generate(PROMPT, 16, mode="ar").tokens == ref
    with pytest.raises(DFlashError, match="a later decode on this Decoder took its context"):
        next(s)
    assert dec.generate(PROMPT, 16).tokens == ref


def test_a_thread_that_died_holding_a_stream_gives_the_decoder_up(dec, ref):
    held = []
    t = threading.Thread(target=lambda: held.append(next(iter(s := dec.stream_ids(PROMPT, 16, mode="ar")))) or
                         held.append(s))
    t.start()
    t.join()
    assert held and dec.generate(PROMPT, 16, mode="ar").tokens == ref


@pytest.mark.parametrize("prompt, needle", [
    ([1.5, 2.7], "token ids must be integers"), ([True, False], "token ids must be integers"),
    (["1", "2"], "token ids must be integers"), (b"hi", "not bytes"), (None, "not NoneType"), (5, "not int"),
    ([1, -1], "outside the vocabulary"), ("a\udcff", "not valid UTF-8"),
])
def test_prompts_of_the_wrong_kind_are_refused(dec, prompt, needle):
    with pytest.raises(DFlashError, match=needle):
        dec.generate(prompt, 2)


def test_chat_with_token_ids_and_bad_detokenize_ids_are_refused(dec):
    with pytest.raises(DFlashError, match="chat takes text or a list of messages, not token ids"):
        dec.generate([1, 2], 2, chat=True)
    for bad in (-1, 10**9, 1.5):
        with pytest.raises(DFlashError, match="not in the vocabulary"):
            dec.detokenize([bad])
    with pytest.raises(DFlashError, match="parallel must be an integer of at least 1"):
        dec.generate_many(["a"], 2, parallel=0)


@pytest.mark.parametrize("kw, needle", [({"ctx": 2**40}, "ctx must be an integer from 1 to 2147483647"),
                                        ({"threads": 10**6}, "threads must be an integer from 1 to 512"),
                                        ({"threads": 1.5}, "threads must be an integer"),
                                        ({"batch": 2**31}, "batch must be"), ({"ctx": "10"}, "ctx must be"),
                                        ({"cache_mem": float("nan")}, "cache_mem must be a whole number")])
def test_decoder_sizes_are_checked_before_the_core_sees_them(kw, needle):
    with pytest.raises(DFlashError, match=needle):
        Decoder(**kw)


def test_a_closed_decoder_says_so():
    d = Decoder(threads=1, warm_up=False)
    d.close()
    with pytest.raises(DFlashError, match="this Decoder is closed"):
        d.generate(PROMPT, 2)
    with pytest.raises(DFlashError, match="this Decoder is closed"):
        d.logits([1, 2])


def _cli(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "dflash27b.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args, needle", [
    (["generate", "x", "-n", "2", "-c", "2147483648"], "2147483648 is not in the range"),
    (["generate", "x", "-n", "2", "-t", "1000000"], "1000000 is not in the range 1<=x<=512"),   # (it had hung)
    (["plan", "--vram", "nan"], "'nan' is not a finite number"),
    (["serve", "--socket", "/tmp/never.sock", "--request-timeout", "nan"], "'nan' is not a finite number"),
    (["generate", "x", "-n", "2", "--socket", "/tmp/never.sock", "-c", "100"], "drop --ctx"),
    (["generate", "x", "-n", "2", "--json-schema", "/no/such/schema.json"], "no such file"),
    (["generate", "--prompt-ids", "1,2", "--chat", "-n", "2"], "not token ids"),
    (["generate", "x", "-n", "2", "--mode", "ar", "--budget", "8"], "--mode ar drafts nothing"),
    (["plan", "-c", "4096", "-np", "5000"], "leaves 0 tokens each"),   # (a plan serve would then refuse)
    (["serve", "--socket", "/tmp/never.sock", "--http", "[::1"], "an IPv6 host in brackets"),
])
def test_cli_flags_out_of_range_or_ignored_are_one_line(args, needle):
    r = _cli(*args)
    assert r.returncode in (1, 2) and needle in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_convert_never_writes_over_its_checkpoint(tiny_hf_dir, tmp_path):
    """The output given as the checkpoint's own weights had been written over them while they were mapped for
    reading (a bus error, the weights cut to a tenth); its config.json was replaced by a GGUF."""
    hf = tmp_path / "hf"
    shutil.copytree(tiny_hf_dir, hf)
    before = {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()}
    for name in ("model.safetensors", "config.json"):
        r = _cli("convert", str(hf), str(hf / name), timeout=120)
        assert r.returncode == 1 and "is a file of the checkpoint being converted" in r.stderr, r.stderr
    assert {p.name: p.read_bytes() for p in hf.iterdir() if p.is_file()} == before
    r = _cli("convert", str(hf), str(hf / "model.gguf"), timeout=120)   # beside it, as llama.cpp writes
    assert r.returncode == 0, r.stderr
    assert not [p for p in hf.iterdir() if ".part-" in p.name]


def test_drafting_flags_without_a_drafter_are_refused():
    from dflash27b.decoder import bundled_pair
    r = _cli("generate", "x", "-n", "2", "-m", str(bundled_pair()[0]), "--draft-max", "4", "--feature-ring", "64")
    assert r.returncode == 1 and "--draft-max, --feature-ring: nothing drafts without a drafter" in r.stderr, r.stderr


def test_a_regular_file_is_not_a_daemon_socket(tmp_path):
    f = tmp_path / "not.sock"
    f.write_text("x")
    r = _cli("generate", "x", "-n", "2", "--socket", str(f))
    assert r.returncode == 1 and "is not a socket" in r.stderr, r.stderr   # (it had said "stale socket")
    for bad in (-1, float("nan"), 0):
        with pytest.raises(DFlashError, match="timeout must be a positive number"):
            Decoder.connect(str(f), timeout=bad)


def test_ctrl_c_while_decoding_exits_130_keeping_what_was_printed():
    """Interrupted, a command ends as shells expect of an interrupted program (click's Abort had exited 1, like
    an error), with no traceback and the text decoded so far on stdout."""
    import signal
    p = subprocess.Popen([sys.executable, "-m", "dflash27b.cli", "generate", PROMPT, "-n", "100000", "--mode", "ar",
                          "--ignore-eos", "-c", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = p.stdout.read(1)   # decoding has begun
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and first and err.decode().rstrip().endswith("Aborted!"), err.decode()[-500:]
    assert b"Traceback" not in err


def test_the_command_catches_ctrl_c_while_its_modules_load(monkeypatch, capsys):
    """`import dflash27b` loads nothing heavy (the names come on first use), so the command's entry point can
    catch a Ctrl-C while numpy and the library load: "Aborted!" and 130, no traceback of the import."""
    r = subprocess.run([sys.executable, "-c", "import sys, dflash27b; print(sorted(m for m in ('numpy', 'cffi', "
                        "'dflash27b.decoder') if m in sys.modules))"], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "[]", r.stdout + r.stderr
    import builtins

    import dflash27b._entry as entry
    real = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "cli":   # (from .cli import main)
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", interrupted)
    with pytest.raises(SystemExit) as e:
        entry.main()
    assert e.value.code == 130 and "Aborted!" in capsys.readouterr().err


def test_python_dash_m_dflash27b_is_the_command():
    """`python -m dflash27b` runs the command through its entry point (as the installed `dflash27b` does)."""
    r = subprocess.run([sys.executable, "-m", "dflash27b", "plan", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "Usage:" in r.stdout and "plan" in r.stdout, r.stdout + r.stderr
