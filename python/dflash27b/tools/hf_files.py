"""Hugging Face checkpoint side files for models made here (tests' tiny models, the bundled pair).

`write_tokenizer_files` writes a byte-level BPE `tokenizer.json` (NFC, the qwen35 split regex, ByteLevel,
ChatML control tokens as added tokens; vocabulary trained on Python standard-library sources as the
synthetic models' is) and `tokenizer_config.json` with a ChatML chat template.
"""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role: ' + message.role) }}{%- endif %}\n"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}\n"
)


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
