"""The ``tokenizer.json`` + ``tokenizer_config.json`` that transformers' ``AutoTokenizer`` reads as encoding and
decoding every input exactly as a fibattn tokenizer does. Both export formats write these files (one definition).

Where transformers' defaults differ from fibattn, the files say so:

- a special token's text inside a document is plain text (``split_special_tokens``), as fibattn encodes it;
- no post-processor: fibattn adds no BOS/EOS around a text;
- decoding drops special tokens (fibattn's ``decode`` does; transformers keeps them unless
  ``skip_special_tokens``): the decoder maps each to nothing; no clean-up of spaces.

The byte tokenizer becomes a byte-level BPE without merges whose ids are the byte values (eos 255, the byte 0xFF),
written as plain JSON: exporting a byte run needs no ``tokenizers`` package.
"""
from __future__ import annotations

import json
import re

HF_TOKENIZER = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what the ByteLevel pre-tokenizer uses)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


def _byte_doc() -> tuple[dict, str]:
    table = bytes_to_unicode()
    eos = table[255]
    doc = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": 255, "content": eos, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True}],
           "normalizer": None, "pre_tokenizer": dict(_BYTE_LEVEL), "post_processor": None,
           "decoder": dict(_BYTE_LEVEL),
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "vocab": {table[b]: b for b in range(256)}, "merges": []}}
    return doc, eos


def hf_tokenizer_files(tokenizer) -> dict[str, bytes]:
    """``{file name: bytes}`` of the two files AutoTokenizer reads for fibattn's ``tokenizer``."""
    if tokenizer.name == "byte":
        doc, eos = _byte_doc()
    else:
        doc = json.loads(tokenizer.backend.to_str())
        eos = tokenizer.backend.id_to_token(tokenizer.eos_id)     # <|endoftext|>, or a reused tokenizer's own
    specials = sorted({t["content"] for t in doc.get("added_tokens") or [] if t.get("special")} | {eos})
    doc["post_processor"] = None
    drop = {"type": "Replace", "content": "",
            "pattern": {"Regex": r"\A(?:" + "|".join(map(re.escape, specials)) + r")\z"}}
    doc["decoder"] = drop if doc.get("decoder") is None else {"type": "Sequence", "decoders": [drop, doc["decoder"]]}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "split_special_tokens": True,
              "clean_up_tokenization_spaces": False}
    return {HF_TOKENIZER: json.dumps(doc, ensure_ascii=False).encode("utf-8"),
            HF_TOKENIZER_CONFIG: (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")}
