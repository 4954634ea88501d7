"""Several requests at once (issue 41): slots — contexts sharing one backend — decoded in one batched target
forward per step (Context::forward_many, Generator::next_many, Decoder.generate_many).

The contract: a reply does not depend on who else was decoding.  Each slot's rows get the arithmetic they
get alone (the row-wise work runs over every slot's rows at once, attention and the delta-net per slot on
its own state), so every reply equals the same request decoded alone, token for token: AR, chain, DDTree and
auto, greedy and seeded, with prompts of different lengths finishing at different steps (a finished slot
takes the next prompt), after prefix-cache hits, and with drafters of every kind in the slots."""
from __future__ import annotations

import json
import time

import pytest

from dflash27b import Decoder, DFlashError
from dflash27b.params import GenParams

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n" * 3 + "import os\nimport",
           "class Stack:\n    def push(self, x):\n", "# sort a list of numbers\n",
           "def parse(line):\n    key, _, value = line.partition('=')\n", "for i in range(10):\n",
           "x = [1, 2, 3]\nprint(", "def main():\n    args = sys.argv[1:]\n"]
REQS = [dict(mode="ar"), dict(mode="chain"), dict(mode="ddtree", budget=8), dict(mode="auto"),
        dict(mode="ar", temperature=0.8, seed=3), dict(mode="chain", temperature=0.7, seed=11),
        dict(mode="ddtree", budget=6, temperature=0.9, seed=5), dict(mode="auto", temperature=0.8, seed=9)]
LENGTHS = [40, 24, 48, 32, 16, 40, 28, 36]


@pytest.fixture(scope="module")
def dec():
    with Decoder(threads=2, cache_mem=64 << 20) as d:   # the bundled pair: DFlash2 drafts
        yield d


def _params(d: Decoder, k: int) -> GenParams:
    return d._settings(None, LENGTHS[k], dict(REQS[k], ignore_eos=True))


def test_every_reply_equals_its_solo_decode(dec):
    solo = [dec.generate(p, params=_params(dec, k), cache=False) for k, p in enumerate(PROMPTS)]
    many = dec.generate_many(PROMPTS, params=[_params(dec, k) for k in range(len(PROMPTS))], parallel=4, cache=False)
    for k, (a, b) in enumerate(zip(solo, many)):
        assert b.tokens == a.tokens, (k, REQS[k])
        assert b.stats.generated_tokens == LENGTHS[k] and b.stats.mode == a.stats.mode
        assert b.prompt_tokens == a.prompt_tokens


def test_all_at_once_and_one_at_a_time(dec):
    ps = [_params(dec, k) for k in range(4)]
    ref = [dec.generate(p, params=q, cache=False).tokens for p, q in zip(PROMPTS[:4], ps)]
    for parallel in (1, 4):
        got = dec.generate_many(PROMPTS[:4], params=ps, parallel=parallel, cache=False)
        assert [r.tokens for r in got] == ref, parallel


def test_after_prefix_cache_hits(dec):
    base = PROMPTS[4]
    first = dec.generate(base, 16, mode="ar", ignore_eos=True)
    turn2 = [first.prompt_tokens + first.tokens + dec.tokenize(t) for t in ("\n\ndef g(y):\n", "\n\n# next\n")]
    got = dec.generate_many(turn2, 24, mode="ddtree", budget=8, ignore_eos=True)
    assert all(r.stats.cached_tokens > 0 for r in got)
    for r, p in zip(got, turn2):
        assert r.tokens == dec.generate(p, 24, mode="ar", ignore_eos=True, cache=False).tokens



def test_constrained_slots_reply_as_alone(dec):
    """A JSON schema or a grammar is per request: each slot's matcher masks its own nodes, so constrained and
    free requests decode side by side, each equal to its solo decode (greedy and seeded, every mode)."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"enum": ["read_file", "run_tests"]}, "line": {"type": "integer"}},
              "required": ["name", "line"], "additionalProperties": False}
    reqs = [dict(mode="ddtree", budget=8, json_schema=schema), dict(mode="auto", ignore_eos=True),
            dict(mode="chain", grammar='root ::= "yes" | "no"'), dict(mode="auto", json_schema=schema, temperature=0.8, seed=4),
            dict(mode="ar", json_schema=schema)]
    prompts = ["def f(x):\n", "import os\n", "Answer: ", "class A:\n", "x = "]
    ps = [dec._settings(None, 32, r) for r in reqs]
    solo = [dec.generate(p, params=q, cache=False) for p, q in zip(prompts, ps)]
    many = dec.generate_many(prompts, params=ps, parallel=4, cache=False)
    assert [r.tokens for r in many] == [r.tokens for r in solo]
    assert many[2].text in ("yes", "no")
    ended = [k for k in (0, 3, 4) if many[k].stats.stop_reason != "length"]
    assert ended   # (greedy may write digits until the token limit)
    for k in ended:
        v = json.loads(many[k].text)
        assert v["name"] in ("read_file", "run_tests") and isinstance(v["line"], int), many[k].text

@pytest.mark.parametrize("draft", ["lookup", "mtp", "mtp+lookup"])
def test_slots_with_other_drafters(draft):
    with Decoder(draft=draft.split("+"), threads=2, warm_up=False) as d:
        ps = [d._settings(None, 24, dict(REQS[k], ignore_eos=True)) for k in range(4)]
        ref = [d.generate(p, params=q, cache=False).tokens for p, q in zip(PROMPTS[:4], ps)]
        assert [r.tokens for r in d.generate_many(PROMPTS[:4], params=ps, cache=False)] == ref


def test_bad_requests_are_refused_by_name(dec):
    with pytest.raises(DFlashError, match="parallel must be an integer of at least 1"):
        dec.generate_many(PROMPTS[:2], 8, parallel=-1)
    with pytest.raises(DFlashError, match="3 params for 2 prompts"):
        dec.generate_many(PROMPTS[:2], 8, params=[GenParams()] * 3)
    assert dec.generate_many([], 8) == []


# -- the daemon: serve --parallel ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def parallel_daemon(tmp_path_factory):
    from serve_util import serve
    s = serve(tmp_path_factory.mktemp("slots"), "--parallel", "4", http=False, ctx=8192)
    yield s
    s.stop()


def _wire(k: int) -> dict:
    r = {"max_new_tokens": LENGTHS[k], "ignore_eos": True, **REQS[k]}
    return r


def test_daemon_slots_reply_as_alone(parallel_daemon, dec):
    """8 requests (every mode, greedy and seeded, different lengths) sent at once to serve --parallel 4, one of
    them cancelled halfway by its client: every other reply equals the request decoded alone."""
    import socket
    import threading

    from serve_util import socket_request
    want = [dec.generate(p, params=_params(dec, k), cache=False).tokens for k, p in enumerate(PROMPTS)]
    got: dict[int, list] = {}
    h0 = parallel_daemon.health()
    assert h0["slots"] == {"total": 4, "busy": 0, "n_ctx_each": 2048}

    def run(k: int) -> None:
        evs = socket_request(parallel_daemon.sock, {"prompt": PROMPTS[k], **_wire(k), "cache_prompt": False},
                             timeout=120)
        got[k] = evs

    def leave_halfway() -> None:   # a long request whose client goes away after its first tokens
        s = socket.socket(socket.AF_UNIX)
        s.connect(parallel_daemon.sock)
        s.sendall(json.dumps({"prompt": PROMPTS[0], "max_new_tokens": 100000, "ignore_eos": True,
                              "mode": "ar", "stream": True}).encode() + b"\n")
        f = s.makefile("rb")
        n = 0
        while n < 5:
            n += b'"token"' in f.readline()
        s.close()

    ts = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
    ts.append(threading.Thread(target=leave_halfway))
    for t in ts:
        t.start()
    busy = 0
    while any(t.is_alive() for t in ts):
        busy = max(busy, parallel_daemon.health()["slots"]["busy"])
        time.sleep(0.01)
    for t in ts:
        t.join(120)
    for k in range(len(PROMPTS)):
        done = [e for e in got[k] if e["event"] == "done"]
        assert done and done[0]["tokens"] == want[k], (k, REQS[k], got[k][-1])
    h = parallel_daemon.health()
    assert busy > 1, "no two requests ever decoded at once"
    assert h["cancelled"]["client_gone"] == h0["cancelled"]["client_gone"] + 1
    assert h["after_cancel"] == {"steps": 0, "tokens": 0} and h["queue"] == 0


def test_daemon_refuses_what_a_slot_cannot_hold(parallel_daemon):
    from serve_util import socket_request
    evs = socket_request(parallel_daemon.sock, {"prompt_ids": [5] * 2100, "max_new_tokens": 4},
                         {"prompt": "def f(x):", "max_new_tokens": 4})
    errs = [e for e in evs if e["event"] == "error"]
    assert len(errs) == 1 and "does not fit the context length 2048" in errs[0]["message"]
    assert [e for e in evs if e["event"] == "done"]   # and the next request is served


def test_a_new_prompt_is_prefilled_between_the_running_steps(parallel_daemon, dec):
    """A long prompt (3 prefill chunks) arriving while another request streams: the running request keeps
    getting tokens between the new prompt's chunks (it waits one chunk, not the whole prefill), and both
    replies equal their solo decodes."""
    import socket
    import threading
    long_prompt = [int(t) for t in dec.tokenize(PROMPTS[4] * 80)][:1300]   # > 2 x the 512-token chunk
    assert len(long_prompt) == 1300
    want = dec.generate(long_prompt, 8, mode="ar", ignore_eos=True, cache=False).tokens
    running = dec.generate(PROMPTS[0], 600, mode="ar", ignore_eos=True, cache=False).tokens
    log: list[tuple[str, str]] = []   # (which, event) in the order received
    lock = threading.Lock()

    def stream(which: str, req: dict, out: dict) -> None:
        s = socket.socket(socket.AF_UNIX)
        s.connect(parallel_daemon.sock)
        s.sendall(json.dumps({**req, "stream": True, "cache_prompt": False}).encode() + b"\n")
        toks = []
        for line in s.makefile("rb"):
            ev = json.loads(line)
            with lock:
                log.append((which, ev["event"]))
            if ev["event"] == "token":
                toks += ev["ids"]
            if ev["event"] in ("done", "error"):
                break
        s.close()
        out[which] = toks

    out: dict[str, list] = {}
    a = threading.Thread(target=stream, args=("running", {"prompt": PROMPTS[0], "max_new_tokens": 600,
                                                           "ignore_eos": True, "mode": "ar"}, out))
    a.start()
    while not any(w == "running" and e == "token" for w, e in list(log)):
        time.sleep(0.005)
    b = threading.Thread(target=stream, args=("new", {"prompt_ids": long_prompt, "max_new_tokens": 8,
                                                       "ignore_eos": True, "mode": "ar"}, out))
    b.start()
    a.join(120)
    b.join(120)
    assert out["running"] == running and out["new"] == want
    start = log.index(("new", "start"))
    first = log.index(("new", "token"))
    assert sum(1 for w, e in log[start:first] if w == "running" and e == "token") >= 2, log[start:first]


def test_more_verify_rows_than_one_batch_take_two_forwards():
    """4 DDTree-22 slots hold 92 verify rows; with a 64-token batch their step runs as two shared forwards, and
    every reply is still its solo decode."""
    with Decoder(threads=2, batch=64, warm_up=False) as d:
        ps = [d._settings(None, 24, dict(mode="ddtree", budget=22, ignore_eos=True)) for _ in range(4)]
        ref = [d.generate(p, params=q, cache=False).tokens for p, q in zip(PROMPTS[:4], ps)]
        assert [r.tokens for r in d.generate_many(PROMPTS[:4], params=ps, cache=False)] == ref


@pytest.mark.parametrize("req", [dict(mode="ddtree", budget=8), dict(mode="chain"),
                                 dict(mode="ddtree", budget=6, temperature=0.9, seed=5)])
def test_drafting_slots_share_one_drafter_forward(dec, req):
    """The DFlash drafter's blocks of every drafting slot are made in one drafter forward
    (Drafter::prefetch_blocks: the row-wise work once over every block's rows, attention and DFlash2's
    convolutions per block on its own drafter's context), and each slot's drafts are the bits its own forward
    gives: every reply == its solo decode, and the steps where all three drafted say so."""
    ps = PROMPTS[:3]
    solo = [dec.generate(p, 24, ignore_eos=True, cache=False, **req).tokens for p in ps]
    many = dec.generate_many(ps, 24, ignore_eos=True, cache=False, parallel=3, **req)
    assert [r.tokens for r in many] == solo
    batches = [s["draft_batch"] for k in range(3) for s in dec._slot(k)._ctx.step_stats()]
    assert batches.count(3) >= 3 and set(batches) <= {0, 2, 3}
