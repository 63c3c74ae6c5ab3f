"""Tokenizers: ``byte`` (UTF-8 bytes) and ``bpe`` (Hugging Face ``tokenizers`` ByteLevel BPE).

Both share one interface: ``encode(str) -> list[int]``, ``decode(list[int]) -> str``,
``vocab_size``, ``eos_id``, ``name``, plus ``encode_batch(list[str]) -> list[np.ndarray]``
(fast path used by ``prepare``) and ``save(path)``. Both are stored as ``tokenizer.json``
in a prepared data folder and loaded with :func:`load_tokenizer`.

``byte``: exactly 256 ids, the UTF-8 bytes of the text. The end-of-document token is id
255 (byte 0xFF), a byte that never occurs in valid UTF-8, so the vocabulary stays 256.
``bpe``: ByteLevel BPE (all 256 byte symbols are in the base alphabet, so any text
encodes); ``<|endoftext|>`` is the end-of-document token (id 0). Text that happens to
contain the literal string ``<|endoftext|>`` is encoded as plain text, never as eos.

``decode`` drops end-of-document tokens.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Iterator, Union

import numpy as np

from ..checks import UsageError
from ..files import TextFileError, atomic_write_text, parse_json, utf8_text

TOKENIZER_FILE = "tokenizer.json"
# an export's byte-for-byte copy of the run's own file (its tokenizer.json is transformers' form of it)
EXPORTED_TOKENIZER_FILE = "fibattn_tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
# end-of-document tokens of pretrained tokenizers (GPT-2 style, Llama 1/2, Llama 3, Gemma), in order of preference
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")
DATA_EXTRA = "pip install 'fibattn[data]'"


def require(module: str, purpose: str):
    """Import an optional dependency of the ``data`` extra, or fail naming the extra."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{purpose} needs the optional package '{module}' of the fibattn[data] extra: "
                          f"{DATA_EXTRA}") from exc


class ByteTokenizer:
    """UTF-8 bytes; 256 ids; eos = 255 (0xFF never occurs in UTF-8)."""

    name = "byte"
    vocab_size = 256
    eos_id = 255

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode_array(t) for t in texts]

    def decode(self, ids) -> str:
        arr = np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise UsageError(f"byte tokenizer ids must lie in [0, {self.vocab_size - 1}], "
                             f"got {int(arr.min())}..{int(arr.max())}")
        return arr[arr != self.eos_id].astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps({"fibattn_tokenizer": "byte", "version": 1, "vocab_size": self.vocab_size,
                           "eos_id": self.eos_id}, indent=2, sort_keys=True) + "\n"

    def save(self, path) -> None:
        atomic_write_text(path, self.to_json())


# Encoding a document in one piece takes ~120 bytes per character when it is one run without whitespace (one
# pre-token: a 30 MB line peaked at 3.6 GB). A longer document is encoded in pieces cut where the ByteLevel
# pre-tokenizer cuts anyway -- at a single space or line break between two non-space characters -- so its ids
# equal the whole document's; one without such a place within the limit (or whose tokenizer cuts elsewhere) is
# refused. Pieces are encoded a few at a time, so a long document's encodings never all exist at once.
MAX_ENCODE_CHARS = 1 << 20
_GROUP_PIECES = 8


class DocumentTooLong(UsageError):
    """A document that cannot be encoded in bounded memory with ids equal to its whole encoding; ``index``: its
    place in the batch."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


def _cuts_at_spaces(tokenizer) -> bool:
    """True when every cut at a lone space / line break between non-space characters is a cut of the
    tokenizer's own pre-tokenization: no normalizer, the GPT-2 ByteLevel regex without a prefix space, no
    post-processor that changes ids, only special added tokens (encoded as text, see ``encode_special_tokens``)."""
    doc = json.loads(tokenizer.to_str())
    pre, post = doc.get("pre_tokenizer") or {}, doc.get("post_processor") or {}
    return (doc.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space") and post.get("type", "ByteLevel") == "ByteLevel"
            and all(t.get("special") for t in doc.get("added_tokens") or []))


def _safe_cut(text: str, lo: int, hi: int) -> int | None:
    """The last ``p`` in ``(lo, hi)`` where ``text[p]`` is a lone space or line break between non-space
    characters (``str.isspace`` counts more as space than the tokenizer's regex: a stricter choice)."""
    best = None
    for ch in " \n":
        p = text.rfind(ch, lo + 1, hi)
        while p > lo and (text[p - 1].isspace() or p + 1 >= len(text) or text[p + 1].isspace()):
            p = text.rfind(ch, lo + 1, p)
        if p > lo and (best is None or p > best):
            best = p
    return best


class BPETokenizer:
    """A Hugging Face ``tokenizers.Tokenizer`` with an end-of-document token: one fibattn trained
    (ByteLevel BPE, ``<|endoftext|>``) or a pretrained model's ``tokenizer.json`` (its first token of
    ``EOS_CANDIDATES``)."""

    name = "bpe"

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._tok.encode_special_tokens = True      # literal "<|endoftext|>" in text is just text
        eos = next((tokenizer.token_to_id(t) for t in EOS_CANDIDATES if tokenizer.token_to_id(t) is not None), None)
        if eos is None:
            raise UsageError(f"the tokenizer has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}")
        self.eos_id = int(eos)
        self.vocab_size = int(tokenizer.get_vocab_size())
        self._cuttable = None              # decided on the first document longer than MAX_ENCODE_CHARS

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0].tolist()

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)   # fast: no offsets
        pieces = [self._pieces(t, i) for i, t in enumerate(texts)]
        if all(len(p) == 1 for p in pieces):
            return [np.asarray(e.ids, dtype=np.int64) for e in encode(texts, add_special_tokens=False)]
        out = []
        for parts in pieces:
            ids = [np.asarray(e.ids, dtype=np.int64) for k in range(0, len(parts), _GROUP_PIECES)
                   for e in encode(parts[k:k + _GROUP_PIECES], add_special_tokens=False)]
            out.append(np.concatenate(ids))
        return out

    def _pieces(self, text: str, index: int) -> list[str]:
        """``text`` cut into pieces of at most ``MAX_ENCODE_CHARS`` whose encodings join to the whole's."""
        pieces, start = [], 0
        if len(text) > MAX_ENCODE_CHARS and self._cuttable is None:
            self._cuttable = _cuts_at_spaces(self._tok)
        while len(text) - start > MAX_ENCODE_CHARS:
            cut = _safe_cut(text, start, start + MAX_ENCODE_CHARS) if self._cuttable else None
            if cut is None:
                why = ("has no lone space or line break between non-space characters within "
                       f"{MAX_ENCODE_CHARS:,} characters of character {start:,}" if self._cuttable else
                       f"is longer than {MAX_ENCODE_CHARS:,} characters, and this tokenizer's pipeline (normalizer or "
                       "pre-tokenizer) has no place to cut it that keeps its ids")
                raise DocumentTooLong(f"a document of {len(text):,} characters {why} (the BPE encoding's limit "
                                      f"fibattn.data.tokenizers.MAX_ENCODE_CHARS = {MAX_ENCODE_CHARS:,}: encoding "
                                      f"it whole could take ~{120 * len(text) / 1e9:.1f} GB); split it into "
                                      f"documents or lines, or use tokenizer=byte", index)
            pieces.append(text[start:cut])
            start = cut
        pieces.append(text[start:] if start else text)
        return pieces

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UsageError(f"bpe tokenizer ids must lie in [0, {self.vocab_size - 1}], got {bad[0]}")
        return self._tok.decode(ids, skip_special_tokens=True)

    def to_json(self) -> str:
        return self._tok.to_str(pretty=True)

    def save(self, path) -> None:
        atomic_write_text(path, self.to_json())


Tokenizer = Union[ByteTokenizer, BPETokenizer]

# The BPE trainer rescans a whole word for every merge it makes in it, and keeps ~70 bytes per character of
# distinct words: one 100k-character line without spaces took seconds, 1M minutes, 30 MB never finished.
# Ordinary text has no run of non-whitespace this long, so its training is unchanged; a longer run (a blob,
# minified code) trains on its first MAX_TRAIN_RUN characters only. Encoding is untouched: every byte encodes.
MAX_TRAIN_RUN = 256
_LONG_RUN = re.compile(r"\S{%d,}" % (MAX_TRAIN_RUN + 1))


def bounded_pieces(texts: Iterable[str]) -> Iterator[str]:
    """``texts`` for the BPE trainer: every run of more than ``MAX_TRAIN_RUN`` non-whitespace characters cut
    to its first ``MAX_TRAIN_RUN`` (the text around it is kept, in separate pieces)."""
    for text in texts:
        start = 0
        for m in _LONG_RUN.finditer(text):
            yield text[start:m.start() + MAX_TRAIN_RUN]
            start = m.end()
        yield text[start:] if start else text


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a ByteLevel BPE of at most ``vocab_size`` ids (eos included) on ``texts``.

    A small corpus may yield fewer merges; the result's ``vocab_size`` is the real size.
    """
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise UsageError(f"data.vocab_size must be an integer >= 257 for tokenizer=bpe "
                         f"(256 byte symbols + end-of-document), got {vocab_size!r}")
    tk = require("tokenizers", "tokenizer=bpe")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(bounded_pieces(texts), trainer=trainer)
    return BPETokenizer(tok)


def _resolve(path) -> Path:
    path = Path(path)
    if path.is_dir() and (path / EXPORTED_TOKENIZER_FILE).is_file():
        return path / EXPORTED_TOKENIZER_FILE
    return path / TOKENIZER_FILE if path.is_dir() else path


def tokenizer_sha256(path) -> str:
    return hashlib.sha256(_resolve(path).read_bytes()).hexdigest()


def load_tokenizer(path) -> Tokenizer:
    """Load a ``tokenizer.json`` (or a prepared data folder that holds one)."""
    file = _resolve(path)
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer at {file}")
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise UsageError(f"tokenizer {file} cannot be read: {exc.strerror or exc}") from None
    return parse_tokenizer(data, file)


def parse_tokenizer(data: bytes, file) -> Tokenizer:
    """The tokenizer of a ``tokenizer.json``'s bytes (``file`` names it in errors): what was hashed is what is
    used."""
    try:
        obj = parse_json(data)              # a byte-order mark is fine; what is wrong is named (files.parse_json)
    except TextFileError as exc:
        raise UsageError(f"{file} is not a tokenizer JSON file: {exc}") from None
    if isinstance(obj, dict) and obj.get("fibattn_tokenizer") == "byte":
        if obj.get("vocab_size") != ByteTokenizer.vocab_size or obj.get("eos_id") != ByteTokenizer.eos_id:
            raise UsageError(f"{file}: byte tokenizer must have vocab_size 256 and eos_id 255, got "
                             f"vocab_size={obj.get('vocab_size')!r} eos_id={obj.get('eos_id')!r}")
        return ByteTokenizer()
    if isinstance(obj, dict) and "model" in obj:
        tk = require("tokenizers", f"loading the bpe tokenizer {file}")
        try:
            return BPETokenizer(tk.Tokenizer.from_str(utf8_text(data)))
        except Exception as exc:         # the tokenizers package raises its own exception types
            raise UsageError(f"{file} is not a valid Hugging Face tokenizer.json: "
                             f"{' '.join(str(exc).split())}") from None
    raise UsageError(f"{file} is neither a fibattn byte tokenizer nor a Hugging Face tokenizer.json")
