"""Hugging Face checkpoint side files for models made here (tests' tiny models, the bundled pair).

`write_tokenizer_files` writes a byte-level BPE `tokenizer.json` (NFC, the qwen35 split regex, ByteLevel,
ChatML control tokens as added tokens; vocabulary trained on Python standard-library sources as the
synthetic models' is) and `tokenizer_config.json` with a ChatML chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

# The chat template of the models made here: Qwen3.5's conventions, written for these files.  The generation
# prompt opens a thinking block ("<think>\n"; enable_thinking=false closes it empty), tools are listed as JSON in
# a system block, an assistant's tool calls are written in Qwen's XML form (strings raw, other values as JSON),
# tool results go back in a user turn as <tool_response> blocks, and the reasoning of the turns after the last
# user message is kept in the prompt.
CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else none -%}
{%- if tools -%}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + tool | tojson -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nTo call a function, reply with nothing else than:\\n\\n<tool_call>\\n<function=NAME>\\n'
    '<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' -}}
{%- if system -%}{{- '\\n\\n' + system -}}{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- elif system is not none -%}
{{- '<|im_start|>system\\n' + system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
{%- if not loop.first -%}{{- raise_exception('a system message must come first') -}}{%- endif -%}
{%- elif m.role == 'user' -%}
{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' -}}
{%- elif m.role == 'assistant' -%}
{%- set content = (m.content or '') | trim -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if loop.index0 > ns.last_user -%}
{{- '<think>\\n' + ((m.reasoning_content or '') | trim) + '\\n</think>\\n\\n' -}}
{%- endif -%}
{{- content -}}
{%- for call in (m.tool_calls or []) -%}
{%- set f = call.function if call.function is defined else call -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- elif content -%}{{- '\\n\\n' -}}{%- endif -%}
{{- '<tool_call>\\n<function=' + f.name + '>\\n' -}}
{%- for key, value in (f.arguments or {}).items() -%}
{{- '<parameter=' + key + '>\\n' + (value if value is string else value | tojson) + '\\n</parameter>\\n' -}}
{%- endfor -%}
{{- '</function>\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}
{%- else -%}
{{- raise_exception('unknown role: ' + m.role) -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n<think>\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '\\n</think>\\n\\n' -}}{%- endif -%}
{%- endif -%}
"""


def write_tokenizer_files(out_dir: Path, vocab_size: int) -> None:
    """tokenizer.json (NFC + qwen35 Split + ByteLevel, specials as added tokens) and tokenizer_config.json."""
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    from dflash27b.tokenizer import QWEN35_REGEX
    from dflash27b.tools.synth import SPECIALS, train_byte_bpe

    tokens, merges = train_byte_bpe(vocab_size - len(SPECIALS))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                          byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(out_dir / "tokenizer.json"))
    base = len(tokens)
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": 4096, "add_bos_token": False,
           "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
           "chat_template": CHAT_TEMPLATE, "errors": "replace", "clean_up_tokenization_spaces": False,
           "added_tokens_decoder": {str(base + k): {"content": s, "special": True, "normalized": False,
                                                    "lstrip": False, "rstrip": False, "single_word": False}
                                    for k, s in enumerate(SPECIALS)}}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1, ensure_ascii=False))
