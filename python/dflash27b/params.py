"""GenParams: one generation request's settings, typed and validated once, wherever the request comes from.

The C core takes them as `dfl_gen_params` (include/dflash27b.h).  Here each setting is a field of one frozen
dataclass whose metadata says everything the rest of the package needs: the C member it fills (copied by
name, `to_c`), how it is checked, the CLI option `dflash27b generate` offers for it (`cli_options` builds
them), its help, and older spellings still accepted.  The CLI, `Decoder`, the daemon and the HTTP front all
build a GenParams (`from_mapping(strict=True)` for requests off the wire), so a new setting is one field here,
one member in the C struct, and its test.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Callable, Mapping

from ._lib import DFlashError

MODES = ("ar", "chain", "ddtree", "auto")
TREE_SCORES = ("selector", "draft")  # dfl_gen_params.tree_scores 0, 1
INT32_MAX = 2**31 - 1  # the C struct's int32 members: larger values are refused here, not truncated there


# ---- checks: each returns the value (normalised) or raises with the field's name --------------------------
class SettingError(DFlashError):
    """A generation setting out of its range: `name must be what (got value)`; the wire formats quote the name."""

    def __init__(self, name: str, what: str, value: Any, plain: str | None = None):
        self.name, self.what, self.value = name, what, value
        super().__init__(f"{name} must be {plain or what} (got {repr(value)[:80]})")


def _bad(name: str, what: str, v, plain: str | None = None) -> SettingError:
    return SettingError(name, what, v, plain)


def is_int(v) -> bool:
    """An integer that is not a bool (JSON and Python both let True pass as 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(lo: int, hi: int = INT32_MAX, note: str = "", optional: bool = False) -> Callable:
    top = "2^31 - 1" if hi == INT32_MAX else str(hi)

    def check(name, v):
        if v is None and optional:
            return None
        if not is_int(v) or not lo <= v <= hi:
            null = " (or null)" if optional else ""
            raise _bad(name, f"an integer in {lo}..{top}{note}{null}", v,
                       plain=f">= {lo}, an integer up to {top}{note}{null}" if hi == INT32_MAX else None)
        return int(v)
    return check


def _num(what: str, ok: Callable[[float], bool]) -> Callable:
    def check(name, v):
        if not is_num(v) or not ok(v):
            raise _bad(name, what, v)
        return float(v)
    return check


def _bool(name, v):
    if not isinstance(v, bool):
        raise _bad(name, "true or false", v)
    return v


def _mode(name, v):
    if v is not None and v not in MODES:
        raise SettingError(name, f"one of {', '.join(MODES)} (unknown mode {v!r})", v)
    return v


def _one_of(choices: tuple[str, ...]) -> Callable:
    def check(name, v):
        if v not in choices:
            raise SettingError(name, f"one of {', '.join(choices)}", v)
        return v
    return check


def _json_schema(name, v):
    if v is not None and not isinstance(v, (dict, str, bool)):
        raise SettingError(name, "a JSON schema (a dict, or JSON text)", v)
    return v


def _text_or_none(name, v):
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise SettingError(name, "a non-empty grammar text", v)
    return v


def _tools(name, v):
    """OpenAI's tools list (or its JSON text): checked here, so a bad tool is refused before anything runs."""
    if v is None:
        return None
    if isinstance(v, str):
        import json
        try:
            v = json.loads(v)
        except json.JSONDecodeError as e:
            raise SettingError(name, "a list of tools (JSON)", v, plain=f"JSON ({e.msg})") from None
    from .tool_calls import parse_tools
    parse_tools(v)
    return v


def _tool_choice(name, v):
    """"auto" | "none" | "required" | {"type": "function", "function": {"name": ...}} (or its JSON text)."""
    if isinstance(v, str) and v.lstrip().startswith("{"):
        import json
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            pass
    from .tool_calls import CHOICES
    if v in CHOICES or isinstance(v, dict):
        return v
    raise SettingError(name, "\"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}", v)


LOGIT_BIAS_MAX = 100.0   # OpenAI's range: -100 all but bans a token, +100 all but forces it


def _logit_bias(name, v):
    """{token id: bias} (OpenAI's logit_bias; JSON keys are strings), its JSON text, or llama.cpp's
    --logit-bias spelling "ID+BIAS,ID-BIAS": normalised to {int: float}, ids ascending."""
    if v is None:
        return None
    what = "{token id: bias} with biases in [-100, 100] (or llama.cpp's \"ID+BIAS,ID-BIAS\")"
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("{"):
            import json
            try:
                v = json.loads(text)
            except json.JSONDecodeError:
                raise SettingError(name, what, v) from None
        else:
            import re
            pairs = {}
            for part in filter(None, (p.strip() for p in text.split(","))):
                m = re.fullmatch(r"(\d+)\s*([+-]\s*(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)", part)
                if not m or m.group(1) in pairs:
                    raise SettingError(name, what, v)
                pairs[m.group(1)] = float(m.group(2).replace(" ", ""))
            v = pairs
    if not isinstance(v, Mapping):
        raise SettingError(name, what, v)
    out: dict[int, float] = {}
    for k, b in v.items():
        tid = k if is_int(k) else int(k) if isinstance(k, str) and k.strip().isascii() and k.strip().isdigit() \
            else None
        if tid is None or tid < 0 or tid > INT32_MAX or tid in out:
            raise SettingError(name, what, v, plain=f"{what}: bad token id {k!r}")
        if not is_num(b) or abs(b) > LOGIT_BIAS_MAX:
            raise SettingError(name, what, v, plain=f"{what}: bad bias {b!r} for token {tid}")
        out[tid] = float(b)
    return dict(sorted(out.items())) or None


def _setting(default, check: Callable, help: str, *, c: str | None = None, cli: tuple[str, ...] = (),
             to_c: Callable | None = None, aliases: tuple[str, ...] = (), choices: tuple[str, ...] = (),
             text_or_file: bool = False):
    """A GenParams field: default, check(name, value) -> value, help; c = the dfl_gen_params member it fills
    (to_c converts), cli = the generate command's option names, aliases = deprecated spellings, choices = the
    values a string setting takes (the CLI offers them), text_or_file = the CLI takes text or a file holding it."""
    return field(default=default, metadata={"check": check, "help": help, "c": c, "cli": cli, "to_c": to_c,
                                            "aliases": aliases, "choices": choices, "text_or_file": text_or_file})


@dataclass(frozen=True)
class GenParams:
    max_new_tokens: int = _setting(256, _int(0), "tokens to generate at most", c="max_new_tokens",
                                   cli=("-n", "--max-new-tokens"))
    ignore_eos: bool = _setting(False, _bool, "keep generating past end-of-generation tokens", c="ignore_eos",
                                cli=("--ignore-eos",), to_c=int)
    mode: str | None = _setting(None, _mode, "decode mode: auto (each step AR or the DDTree budget expected "
                                "fastest; the default with a drafter), ar, chain or ddtree", cli=("--mode",),
                                choices=MODES)
    block_size: int | None = _setting(None, _int(1, optional=True), "draft block incl. the root (chain, ddtree) "
                                      "[default: the drafter's]", cli=("--block-size",))
    budget: int = _setting(22, _int(0), "DDTree node budget (auto: the largest it may choose)", c="tree_budget",
                           cli=("--budget",))
    tree_topk: int = _setting(0, _int(0), "DDTree candidates per depth (0 = the budget)", c="tree_topk",
                              cli=("--tree-topk",), aliases=("topk",))
    chain_seed: bool = _setting(True, _bool, "insert the drafter's greedy chain into the tree first",
                                c="chain_seed", cli=("--chain-seed/--no-chain-seed",), to_c=int)
    expand: int = _setting(0, _int(0), "a draft model's tree by expanding branches: nodes run per depth "
                           "(0 = one draft pass)", c="tree_expand", cli=("--tree-expand",))
    tree_scores: str = _setting("selector", _one_of(TREE_SCORES), "a DFlash2 drafter's DDTree: from its candidate "
                                "selector's transition scores, or from the draft probabilities alone",
                                c="tree_scores", cli=("--tree-scores",), to_c=TREE_SCORES.index, choices=TREE_SCORES)
    temperature: float = _setting(0.0, _num("a number >= 0", lambda v: v >= 0), "sampling temperature "
                                  "(0 = greedy)", c="temperature", cli=("--temp", "--temperature"))
    top_k: int = _setting(0, _int(0, note=" (0 = off)"), "top-k filter (0 = off)", c="top_k", cli=("--top-k",))
    top_p: float = _setting(1.0, _num("a number in (0, 1]", lambda v: 0 < v <= 1), "top-p filter (1 = off)", c="top_p",
                            cli=("--top-p",))
    min_p: float = _setting(0.0, _num("a number in [0, 1]", lambda v: 0 <= v <= 1), "min-p filter (0 = off)", c="min_p",
                            cli=("--min-p",))
    typical_p: float = _setting(1.0, _num("a number in (0, 1]", lambda v: 0 < v <= 1), "locally typical sampling "
                                "after top-k (1 = off)", c="typical_p", cli=("--typical-p", "--typical"))
    seed: int | None = _setting(None, _int(0, 2**32 - 1, optional=True), "sampling seed (default: a fresh one, "
                                "reported in the stats)", c="seed", cli=("-s", "--seed"),
                                to_c=int)
    repeat_penalty: float = _setting(1.0, _num("a number > 0 (1 = off)", lambda v: v > 0),
                                     "divide the logit of tokens seen in the last repeat_last_n (1 = off)",
                                     c="repeat_penalty", cli=("--repeat-penalty",))
    repeat_last_n: int = _setting(64, _int(-1, note=" (-1 = all, 0 = off)"), "tokens the penalties look back "
                                  "over (-1 = all)", c="repeat_last_n", cli=("--repeat-last-n",))
    frequency_penalty: float = _setting(0.0, _num("a number (0 = off)", lambda v: True),
                                        "subtract count x this from seen tokens' logits", c="frequency_penalty",
                                        cli=("--frequency-penalty",))
    presence_penalty: float = _setting(0.0, _num("a number (0 = off)", lambda v: True),
                                       "subtract this from seen tokens' logits", c="presence_penalty",
                                       cli=("--presence-penalty",))
    logit_bias: dict | None = _setting(None, _logit_bias, "add a bias to tokens' logits before the penalties and "
                                       "the sampler: {token id: bias} as JSON, or llama.cpp's \"ID+BIAS,ID-BIAS\" "
                                       "(biases in [-100, 100]; -100 all but bans a token)", cli=("--logit-bias",),
                                       text_or_file=True)
    logprobs: int | None = _setting(None, _int(0, 20, optional=True), "record each token's log-probability and "
                                    "its k most likely alternatives", c="n_logprobs",
                                    to_c=lambda v: -1 if v is None else v)

    json_schema: Any = _setting(None, _json_schema, "constrain the reply to JSON valid against this schema "
                                "(a dict or JSON text, or a file holding it; {} = any JSON object): every mode gives "
                                "the constrained AR reply (needs llguidance)", cli=("--json-schema",),
                                text_or_file=True)
    grammar: str | None = _setting(None, _text_or_none, "constrain the reply to this GBNF grammar (llama.cpp's "
                                   "format; Lark too), or a file holding it (needs llguidance)",
                                   cli=("--grammar", "--grammar-file"), text_or_file=True)
    grammar_prune: bool = _setting(True, _bool, "under a constraint, drop draft nodes it forbids before the verify")
    tools: list | None = _setting(None, _tools, "OpenAI tools ([{\"type\": \"function\", \"function\": {name, "
                                  "description, parameters}}], JSON text or a file): the chat template lists them and "
                                  "the model's calls are constrained to their schemas (needs llguidance)",
                                  cli=("--tools",), text_or_file=True)
    tool_choice: Any = _setting("auto", _tool_choice, "with tools: auto (text or calls), none, required, or "
                                "{\"type\": \"function\", \"function\": {\"name\": N}}", cli=("--tool-choice",))
    parallel_tool_calls: bool = _setting(True, _bool, "with tools: the reply may make several calls")

    def __post_init__(self):
        for f in fields(self):
            v = f.metadata["check"](f.name, getattr(self, f.name))
            object.__setattr__(self, f.name, v)
        if self.tools is None:
            if self.tool_choice != "auto":
                raise DFlashError("tool_choice needs tools")
        else:
            from .tool_calls import parse_tool_choice, parse_tools
            parse_tool_choice(self.tool_choice, parse_tools(self.tools))
            if self.tool_choice != "none" and (self.json_schema is not None or self.grammar is not None):
                raise DFlashError("tools and a json_schema / grammar ask for two constraints: give one "
                                  "(or tool_choice \"none\")")

    @property
    def calls_tools(self) -> bool:
        """The reply is constrained and parsed as tool calls (tools given, tool_choice not "none")."""
        return self.tools is not None and self.tool_choice != "none"

    # -- construction ------------------------------------------------------------------------------------
    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def aliases(cls) -> dict[str, str]:
        return {a: f.name for f in fields(cls) for a in f.metadata["aliases"]}

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any], strict: bool = True, base: "GenParams | None" = None) -> "GenParams":
        """The settings in m (missing ones from base, else the defaults).  strict: a key that is not a setting
        is refused by name (requests off the wire); else it is left for the caller.  A deprecated spelling is
        accepted with a warning; None means "the default" only for fields whose default is None."""
        known, alias = set(cls.names()), cls.aliases()
        vals: dict[str, Any] = {}
        for k, v in m.items():
            name = alias.get(k, k)
            if name not in known:
                if strict:
                    raise DFlashError(f"unknown generation setting {k!r}")
                continue
            if name != k:
                warnings.warn(f"{k!r} is deprecated: use {name!r}", DeprecationWarning, stacklevel=3)
            if name in vals:
                raise DFlashError(f"{name!r} given twice (as {k!r} too)")
            vals[name] = v
        return replace(base, **vals) if base is not None else cls(**vals)

    def with_(self, **kw) -> "GenParams":
        return self.from_mapping(kw, strict=True, base=self)

    def to_mapping(self, only_changed: bool = False) -> dict[str, Any]:
        """The settings as a dict (only_changed: those that differ from the defaults), e.g. for the wire."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if not only_changed or v != (f.default if f.default is not MISSING else None):
                out[f.name] = v
        return out

    def c_fields(self) -> dict[str, Any]:
        """dfl_gen_params member -> value for every setting the C struct carries (the seed must be resolved)."""
        out = {}
        for f in fields(self):
            c = f.metadata["c"]
            if c is not None:
                v = getattr(self, f.name)
                out[c] = f.metadata["to_c"](v) if f.metadata["to_c"] else v
        return out


def cli_options(command: Callable) -> Callable:
    """Decorates a click command with one option per GenParams field that has CLI names (defaults from the
    dataclass), plus the deprecated spellings as hidden options; the command receives them as keyword
    arguments named after the fields (use `params_from_cli`)."""
    import click

    for f in reversed(fields(GenParams)):
        names = f.metadata["cli"]
        if not names:
            continue
        default = f.default
        kw: dict[str, Any] = {"help": f.metadata["help"]}
        if names[0].startswith("--") and "/" in names[0]:
            kw.update(default=default, show_default=True)
        elif isinstance(default, bool):
            kw.update(is_flag=True, default=default)
        elif f.metadata["text_or_file"]:
            kw.update(default=None, type=str, metavar="TEXT|FILE")
        elif f.metadata["choices"]:
            kw.update(type=click.Choice(f.metadata["choices"]), default=default, show_default=default is not None)
        else:
            kw.update(default=default, show_default=default is not None)
            kw["type"] = float if isinstance(default, float) else str if isinstance(default, str) else int
        command = click.option(*names, f.name, **kw)(command)
        for a in f.metadata["aliases"]:  # deprecated spellings: accepted, hidden, warned about
            command = click.option(f"--{a.replace('_', '-')}", f"_alias_{a}", default=None, hidden=True,
                                   type=kw.get("type"), help=f"deprecated: {names[-1]}")(command)
    return command


def params_from_cli(kwargs: dict[str, Any]) -> GenParams:
    """Pops the GenParams options (and their deprecated spellings) out of a click command's kwargs."""
    vals = {name: kwargs.pop(name) for name in GenParams.names() if name in kwargs}
    for f in fields(GenParams):  # a constraint given as a file: its text
        v = vals.get(f.name)
        if f.metadata["text_or_file"] and isinstance(v, str) and "\n" not in v and len(v) < 4096:
            from pathlib import Path
            path = Path(v).expanduser()
            if path.is_file():
                try:
                    vals[f.name] = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as e:
                    raise SettingError(f.name, "a readable UTF-8 file", v) from e
            elif path.suffix.lower() in (".json", ".gbnf", ".lark", ".txt") and not v.lstrip().startswith(("{", "[")):
                # named like a file, and not one: say so (it had been parsed as the schema's text)
                raise SettingError(f.name, "the text itself or an existing file (no such file)", v)
    for a, name in GenParams.aliases().items():
        v = kwargs.pop(f"_alias_{a}", None)
        if v is not None:
            import click
            click.echo(f"warning: --{a.replace('_', '-')} is deprecated, use "
                       f"{_cli_name(name)}", err=True)
            vals[name] = v
    return GenParams.from_mapping(vals)


def _cli_name(field_name: str) -> str:
    f = next(f for f in fields(GenParams) if f.name == field_name)
    return f.metadata["cli"][-1].split("/")[0]
