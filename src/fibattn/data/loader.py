"""Reading a prepared data folder: :class:`TokenData` and the training :class:`Loader`.

Shapes: ``Loader.next()`` returns ``(x, y)``, int64 CPU tensors of shape
``(micro_batch, seq_len)`` with ``y[:, t] == x[:, t + 1]`` inside one window of
``seq_len + 1`` consecutive training tokens. ``TokenData.val_tokens(name)`` is a 1-D
read-only memmap, checked against the manifest before it is returned (see below).

Verification. Opening a folder always checks the manifest's keys and types, the tokenizer's
sha256 and every shard's header and size. ``TokenData(path, verify=True)`` also re-hashes
every shard. A validation split is what evaluation turns into a number, so
``val_tokens(name)`` (``verify=True``, the default) returns it only once its whole file
hashes to the manifest's sha256 and its token ids lie in the vocabulary; the check is
cached per file (in memory and in a sidecar in the folder, :mod:`fibattn.data.verified`),
so repeated evaluations of an unchanged folder hash each split once. Training shards get
the same check, through the same cache, before ``train_loader`` returns a loader.

Sampling. Training sequence number ``n`` (a global counter, 0, 1, 2, ...) is a pure
function of ``(seed, n)``: a counter-based hash (splitmix64) of ``n`` picks the source with
probability proportional to its weight, a second one picks the window start uniformly in
that source's training tokens. Rank ``r`` of ``w`` reads sequences ``cursor ..
cursor + micro_batch - 1`` per call, the cursor starting at ``r * micro_batch`` and moving
by ``w * micro_batch``: ``w`` ranks together read exactly what one process reads with the
same global batch. ``state_dict()`` holds the cursor, so resuming continues exactly.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from ..checks import UsageError, check_int
from ..config import ConfigError
from .manifest import read_manifest
from .shards import ShardError, open_shard
from .verified import verified_shard

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_STREAM_SOURCE, _STREAM_OFFSET = 0x736F75726365, 0x6F6666736574


def _mix_int(x: int) -> int:
    """splitmix64 finaliser on a Python int."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _hash(seed: int, stream: int, ids: np.ndarray) -> np.ndarray:
    """splitmix64 output number ``ids + 1`` of a generator keyed by ``(seed, stream)``; uint64."""
    key = _mix_int((seed & _M64) ^ _mix_int(stream))
    x = (ids.astype(np.uint64) + np.uint64(1)) * np.uint64(_GOLDEN) + np.uint64(key)
    x = (x ^ (x >> np.uint64(30))) * _C1
    x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


class _SourceTokens:
    """One source's training shards seen as one token stream."""

    def __init__(self, name: str, shards: list[np.ndarray]):
        self.name, self.shards = name, shards
        sizes = np.asarray([s.size for s in shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.size = int(self.starts[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        local = start - int(self.starts[k])
        if local + length <= self.shards[k].size:
            return self.shards[k][local:local + length]
        parts, need = [], length
        while need:
            piece = self.shards[k][local:local + need]
            parts.append(piece)
            need -= piece.size
            k, local = k + 1, 0
        return np.concatenate(parts)


class TokenData:
    """A prepared data folder (``fibattn prepare``): manifest, tokenizer, training and validation tokens."""

    def __init__(self, path, verify: bool = False):
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.eos_id = int(self.manifest["eos_id"])
        self._check_tokenizer()
        self._tokenizer = None
        self._train: dict[str, _SourceTokens] = {}
        self._val: dict[str, np.ndarray] = {}
        self._val_rec: dict[str, dict] = {}
        self.weights: dict[str, float] = {}
        for src in self.manifest["sources"]:
            shards = [self._open(rec, verify) for rec in src["shards"]]
            self._train[src["name"]] = _SourceTokens(src["name"], shards)
            self._val_rec[src["name"]] = src["val"]
            if verify:
                self._val[src["name"]] = verified_shard(self.path, src["val"], self.vocab_size, force=True)
            else:
                self._val[src["name"]] = self._open(src["val"], False)
            self.weights[src["name"]] = float(src["weight"])

    def _check_tokenizer(self) -> None:
        """The folder's tokenizer file must be the one its shards were made with (manifest sha256)."""
        from .tokenizers import tokenizer_sha256
        rec = self.manifest.get("tokenizer") or {}
        path = self.path / rec.get("file", "tokenizer.json")
        if not path.is_file():
            raise ShardError(f"tokenizer {path} is missing (the manifest of {self.path} names it)")
        try:
            digest = tokenizer_sha256(path)
        except OSError as exc:
            raise ShardError(f"tokenizer {path} cannot be read: {exc.strerror or exc}") from None
        if digest != rec["sha256"]:
            raise ShardError(f"tokenizer {path} does not match the shards: its sha256 differs from the manifest's; "
                             f"prepare the data again with --force")

    def _open(self, rec: dict, verify: bool) -> np.ndarray:
        path = self.path / rec["file"]
        arr = open_shard(path, verify=verify, expected_sha256=rec["sha256"])
        if arr.size != rec["tokens"]:
            raise ShardError(f"shard {path} holds {arr.size} tokens, the manifest says {rec['tokens']}")
        if verify and arr.size and int(arr.max()) >= self.vocab_size:
            raise ShardError(f"shard {path} holds token id {int(arr.max())}, outside the vocabulary "
                             f"[0, {self.vocab_size - 1}] of the manifest")
        return arr

    @property
    def tokenizer(self):
        """The folder's tokenizer (loaded on first use; bpe needs the ``tokenizers`` package)."""
        if self._tokenizer is None:
            from .tokenizers import load_tokenizer
            self._tokenizer = load_tokenizer(self.path / self.manifest["tokenizer"]["file"])
        return self._tokenizer

    @property
    def val_names(self) -> list[str]:
        return list(self._val)

    @property
    def source_names(self) -> list[str]:
        return list(self._train)

    def val_tokens(self, name: str, *, verify: bool = True) -> np.ndarray:
        """The validation split ``name`` (1-D, read-only).

        ``verify=True`` (the default; what evaluation relies on): its file must hash to the
        manifest's sha256 and hold only ids ``< vocab_size``, else :class:`ShardError` naming
        the file. The check is cached while the file's size, mtime, ctime and inode stay the
        same (:func:`fibattn.data.verified.verified_shard`), so only the first call per file
        hashes. ``verify=False``: header and size checks only, as opened.
        """
        if name not in self._val:
            raise UsageError(f"no validation split {name!r} in {self.path} (have: {', '.join(self._val)})")
        if verify:
            self._val[name] = verified_shard(self.path, self._val_rec[name], self.vocab_size)
        return self._val[name]

    def train_tokens(self, name: str) -> int:
        """Number of training tokens of source ``name``."""
        if name not in self._train:
            raise UsageError(f"no source {name!r} in {self.path} (have: {', '.join(self._train)})")
        return self._train[name].size

    def data_id(self) -> str:
        """Fingerprint of the training data (sources, weights, shard digests) for resume checks."""
        rec = [(s["name"], s["weight"], [r["sha256"] for r in s["shards"]]) for s in self.manifest["sources"]]
        return hashlib.sha256(json.dumps(rec).encode()).hexdigest()[:16]

    def verify_train(self) -> None:
        """Check every training shard as the validation splits are checked (whole-file sha256 against the
        manifest, ids in the vocabulary, the same cache): a :class:`ShardError` naming the file otherwise."""
        for src in self.manifest["sources"]:
            shards = [verified_shard(self.path, rec, self.vocab_size) for rec in src["shards"]]
            self._train[src["name"]] = _SourceTokens(src["name"], shards)

    def train_loader(self, seq_len: int, micro_batch: int, *, seed: int, rank: int = 0,
                     world_size: int = 1) -> "Loader":
        """Batches of verified training tokens (:meth:`verify_train` runs first; cached, so cheap when
        nothing changed)."""
        self.verify_train()
        return Loader(self, seq_len, micro_batch, seed=seed, rank=rank, world_size=world_size)


class Loader:
    """Deterministic training batches from a :class:`TokenData` (see the module docstring)."""

    def __init__(self, data: TokenData, seq_len: int, micro_batch: int, *, seed: int, rank: int = 0,
                 world_size: int = 1):
        check_int("seq_len", seq_len, 1)
        check_int("micro_batch", micro_batch, 1)
        check_int("world_size", world_size, 1)
        check_int("seed", seed, 0)
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise UsageError(f"rank must be an integer in [0, {world_size - 1}], got {rank!r}")
        self.data, self.seq_len, self.micro_batch = data, int(seq_len), int(micro_batch)
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)
        self._sources = [data._train[n] for n in data.source_names]
        for src in self._sources:
            if src.size < self.seq_len + 1:
                raise UsageError(f"source {src.name!r} has {src.size} training tokens, fewer than "
                                 f"seq_len + 1 = {self.seq_len + 1}; lower seq_len or add data")
        w = np.asarray([data.weights[s.name] for s in self._sources], dtype=np.float64)
        self._cum = np.cumsum(w / w.sum())
        self._ranges = np.asarray([s.size - self.seq_len for s in self._sources], dtype=np.uint64)
        self.cursor = self.rank * self.micro_batch

    def locate(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window start) of global sequence numbers ``ids``."""
        ids = np.asarray(ids, dtype=np.int64)
        u = (_hash(self.seed, _STREAM_SOURCE, ids) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        src = np.minimum(np.searchsorted(self._cum, u, side="right"), len(self._sources) - 1)
        start = _hash(self.seed, _STREAM_OFFSET, ids) % self._ranges[src]
        return src, start.astype(np.int64)

    def sequences(self, ids) -> np.ndarray:
        """Windows of ``seq_len + 1`` tokens for global sequence numbers ``ids``: int64 (len(ids), seq_len + 1)."""
        src, start = self.locate(ids)
        out = np.empty((len(src), self.seq_len + 1), dtype=np.int64)
        for i, (s, a) in enumerate(zip(src.tolist(), start.tolist())):
            out[i] = self._sources[s].window(a, self.seq_len + 1)
        return out

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.arange(self.cursor, self.cursor + self.micro_batch, dtype=np.int64)
        self.cursor += self.world_size * self.micro_batch
        win = torch.from_numpy(self.sequences(ids))
        return win[:, :-1].contiguous(), win[:, 1:].contiguous()

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        """JSON-serialisable position; ``next_global`` = sequences consumed by all ranks together."""
        return {"version": 1, "seed": self.seed, "seq_len": self.seq_len, "micro_batch": self.micro_batch,
                "rank": self.rank, "world_size": self.world_size, "cursor": self.cursor,
                "next_global": self.cursor - self.rank * self.micro_batch, "data_id": self.data.data_id()}

    def load_state_dict(self, state: dict) -> None:
        """Resume. Same rank layout: the exact cursor. Another world_size / micro_batch: continue
        from ``next_global`` (exact when saved at an optimiser-step boundary, as checkpoints are)."""
        for key in ("seed", "seq_len", "data_id"):
            mine = self.seed if key == "seed" else self.seq_len if key == "seq_len" else self.data.data_id()
            if state.get(key) != mine:
                raise UsageError(f"loader state has {key}={state.get(key)!r}, this loader has {mine!r}; "
                                 f"it cannot be resumed here")
        same = all(state.get(k) == getattr(self, k) for k in ("rank", "world_size", "micro_batch"))
        self.cursor = int(state["cursor"]) if same else int(state["next_global"]) + self.rank * self.micro_batch


def masking_eos(masking: bool, data, field: str) -> int | None:
    """The token that ends each document when document masking (``field``) is on, else None;
    refused when ``data`` has none (a data folder's ``eos_id``, method.md §8)."""
    if not masking:
        return None
    eos = getattr(data, "eos_id", None)
    if isinstance(eos, bool) or not isinstance(eos, int):
        raise ConfigError(f"{field}=true needs data with an end-of-document token (eos_id); the data given has none")
    return eos
