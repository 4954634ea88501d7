"""The CLI contract scripts rely on: --version, generate (text and --json), info."""
import json
import re
import subprocess
import sys

import pytest


def run(*args):
    return subprocess.run([sys.executable, "-m", "dflash27b.cli", *args], capture_output=True, text=True)


def test_version_names_build():
    r = run("--version")
    assert r.returncode == 0
    assert re.match(r"dflash27b \d+\.\d+\.\d+ \(cpu: (avx2\+avx512|avx2|scalar); cuda: (not built|sm_\d+(,sm_\d+)*)\)", r.stdout)


@pytest.fixture(scope="module")
def model(synth_gguf):
    return str(synth_gguf("q4_k_m"))


def test_generate_json_contract(model):
    r = run("generate", "-m", model, "--prompt-ids", "1,2,3", "-n", "6", "--ignore-eos", "--json", "-t", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert len(obj["tokens"]) == 6 and isinstance(obj["text"], str)
    for k in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "decode_tok_s"):
        assert k in obj["stats"]
    assert obj["stats"]["prompt_tokens"] == 3 and obj["stats"]["generated_tokens"] == 6


def test_generate_text_matches_json(model):
    j = json.loads(run("generate", "-m", model, "def f(x):", "-n", "8", "--ignore-eos", "--json").stdout)
    r = run("generate", "-m", model, "def f(x):", "-n", "8", "--ignore-eos")
    assert r.returncode == 0
    # same tokens; invalid UTF-8 from a random model may be replaced at different points when streamed
    strip = lambda t: t.replace("\ufffd", "").rstrip("\n")  # noqa: E731
    assert strip(r.stdout) == strip(j["text"])
    assert "tok/s" in r.stderr


def test_generate_chat_and_kv_flags(model):
    r = run("generate", "-m", model, "hello", "--chat", "--kv-type", "q4_0", "-c", "256", "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stats"]["prompt_tokens"] > 3  # template tokens were added


def test_info(model):
    r = run("info", model)
    assert r.returncode == 0
    assert "qwen35, 8 layers (6 gated delta-net + 2 full attention)" in r.stdout
    assert "Q4_K" in r.stdout and "Q6_K" in r.stdout


@pytest.mark.parametrize("args,msg", [
    (["generate", "-m", "nobody/None-GGUF:Q4_K_M", "hi"], "cannot find target 'nobody/None-GGUF:Q4_K_M'"),
    (["generate", "-m", "MODEL"], "give exactly one of PROMPT or --prompt-ids"),
    (["generate", "-m", "MODEL", "--prompt-ids", "1,2", "-c", "2"], "does not fit the context length 2"),
    (["generate", "-m", "MODEL", "--prompt-ids", "1,2", "--device", "cuda"], "device 'cuda'"),
])
def test_cli_errors(model, args, msg):
    r = run(*[model if a == "MODEL" else a for a in args])
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and msg in r.stderr


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from tiny_draft import make_tiny_draft
    return str(make_tiny_draft(tmp_path_factory.mktemp("cli_draft"), n_layers=1, block_size=8))


def test_generate_chain_json_stats(model, draft_dir):
    base = ("generate", "-m", model, "--prompt-ids", "1,2,3", "-n", "12", "--ignore-eos", "--json", "-t", "2")
    ar = json.loads(run(*base, "--mode", "ar").stdout)
    r = run(*base, "-md", draft_dir, "--mode", "chain", "--block-size", "4")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    s = obj["stats"]
    assert obj["tokens"] == ar["tokens"]
    assert s["mode"] == "chain" and s["block_size"] == 4
    # z-lab's convention: per step, tokens committed incl. the bonus; the prefill's token is in no step
    assert sum(s["accept_lengths"]) == 11 and all(1 <= a <= 4 for a in s["accept_lengths"])
    assert s["mean_accept"] == pytest.approx(sum(s["accept_lengths"]) / len(s["accept_lengths"]))
    n = len(s["accept_lengths"])
    assert len(s["draft_ms"]) == len(s["verify_ms"]) == len(s["commit_ms"]) == n
    assert s["target_forwards"] == [1] * n


def test_generate_ddtree_flags(model, draft_dir):
    base = ("generate", "-m", model, "--prompt-ids", "1,2,3", "-n", "12", "--ignore-eos", "--json", "-t", "2")
    ar = json.loads(run(*base).stdout)
    assert json.loads(run(*base, "-md", draft_dir).stdout)["stats"]["mode"] == "auto"  # the default with a drafter
    r = run(*base, "-md", draft_dir, "--mode", "ddtree", "--budget", "6", "--topk", "3", "--no-chain-seed")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    s = obj["stats"]
    assert obj["tokens"] == ar["tokens"] and s["mode"] == "ddtree" and s["budget"] == 6
    n = len(s["accept_lengths"])
    assert len(s["tree_size"]) == len(s["tree_depth"]) == len(s["tree_ms"]) == n
    assert all(1 <= k <= 6 for k in s["tree_size"]) and s["target_forwards"] == [1] * n
    text = run("generate", "-m", model, "--prompt-ids", "1,2,3", "-n", "8", "--ignore-eos", "-md", draft_dir)
    assert text.returncode == 0 and "accept" in text.stderr and "auto: " in text.stderr
    text = run("generate", "-m", model, "--prompt-ids", "1,2,3", "-n", "8", "--ignore-eos", "-md", draft_dir,
               "--mode", "ddtree")
    assert text.returncode == 0 and "accept" in text.stderr and "budget 22" in text.stderr


def test_generate_mismatched_draft_is_one_error_line(model, tmp_path):
    from tiny_draft import make_tiny_draft
    d = make_tiny_draft(tmp_path / "wide", target_hidden=384)
    r = run("generate", "-m", model, "--prompt-ids", "1,2", "-n", "2", "-md", str(d))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "error: drafter/target mismatch: drafter hidden_size 384 != target hidden size 256"]
    r = run("generate", "-m", model, "--prompt-ids", "1,2", "-n", "2", "--mode", "chain")
    assert r.returncode == 1 and "needs a drafter" in r.stderr


def test_generate_penalty_flags(pair):
    """--repeat-penalty / --repeat-last-n / --frequency-penalty / --presence-penalty reach the engine: the CLI's
    tokens are Decoder's with the same penalties, and differ from the unpenalized ones on a looping prompt."""
    from dflash27b import Decoder
    args = ["generate", "-m", str(pair[0]), "-md", str(pair[1]), "import os\nimport sys\nimport ", "-n", "24",
            "--ignore-eos", "--json", "-t", "2", "--mode", "ddtree"]
    flags = ["--frequency-penalty", "1.0", "--presence-penalty", "0.1", "--repeat-penalty", "1.1",
             "--repeat-last-n", "32"]
    pen = json.loads(run(*args, *flags).stdout)["tokens"]
    plain = json.loads(run(*args).stdout)["tokens"]
    with Decoder(pair[0], pair[1], device="cpu", threads=2) as d:
        want = d.generate("import os\nimport sys\nimport ", 24, ignore_eos=True, mode="ar", frequency_penalty=1.0,
                          presence_penalty=0.1, repeat_penalty=1.1, repeat_last_n=32).tokens
    assert pen == want and pen != plain
    bad = run(*args, "--repeat-penalty", "0")
    assert bad.returncode != 0 and "repeat_penalty" in bad.stderr
    # --logit-bias in llama.cpp's spelling (and JSON): the engine's tokens with the same bias
    biased = json.loads(run(*args, "--logit-bias", f"{plain[0]}-100,{plain[3]}-5").stdout)["tokens"]
    as_json = json.loads(run(*args, "--logit-bias", json.dumps({str(plain[0]): -100, str(plain[3]): -5})).stdout)
    with Decoder(pair[0], pair[1], device="cpu", threads=2) as d:
        want = d.generate("import os\nimport sys\nimport ", 24, ignore_eos=True, mode="ar",
                          logit_bias={plain[0]: -100, plain[3]: -5}).tokens
    assert biased == as_json["tokens"] == want and plain[0] not in biased
    bad = run(*args, "--logit-bias", "5*2")
    assert bad.returncode != 0 and "logit_bias" in bad.stderr


def test_auto_says_why_it_verified_no_tree():
    """generate's line after a run where auto verified no tree: each drafter's draft (its whole block) and a
    verify of the request's budget, in AR steps of this machine, from auto's own estimates; nothing once a
    tree was verified, or outside auto mode."""
    from types import SimpleNamespace

    from dflash27b.cli import _auto_why
    from dflash27b.results import GenerateStats

    est = {"ar_s": 0.002, "draft_s": 0.001, "draft_rows_s": {4: 0.001, 16: 0.004},
           "verify_s": {2: 0.0025, 8: 0.006, 23: 0.014, 33: 0.02}}
    dec = SimpleNamespace(drafts=("/models/tiny-draft2", "lookup"),
                          _ctx=SimpleNamespace(auto_estimates=lambda k: est))
    def stats(mode, auto_budget):
        return GenerateStats(prompt_tokens=4, generated_tokens=4, prefill_s=0.1, decode_s=0.1, decode_tok_s=30.0,
                             prefill_tok_s=40.0, steps=3, stop_reason="length", mode=mode, budget=22,
                             auto_budget=auto_budget)

    s = stats("auto", [0, 0, 0])
    why = _auto_why(dec, s)
    assert why.startswith("auto verified no tree: in AR steps here, tiny-draft2: a draft 2.0, a 23-node verify 7.0;"
                          " lookup: a draft 2.0, a 23-node verify 7.0")
    assert _auto_why(dec, stats("auto", [0, 3, 0])) is None
    assert _auto_why(dec, stats("ddtree", [])) is None
    assert _auto_why(SimpleNamespace(drafts=()), s) is None
