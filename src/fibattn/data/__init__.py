"""fibattn data pipeline: sources -> tokenizer -> token shards -> deterministic training batches.

Public API::

    prepare(data_cfg, *, progress=True, force=False) -> Path   # build (or reuse) data_cfg.out_dir
    ensure_prepared(data_cfg) -> Path                           # reuse when it matches, else build
    verify_prepared(path) -> dict                               # re-hash every file
    data_config(path) -> (DataConfig, manifest)                 # the config a folder was built with
    TokenData(path, verify=False)                               # .vocab_size .eos_id .tokenizer .manifest
        .val_names, .val_tokens(name, verify=True)              # verified against the manifest (cached)
        .train_loader(seq_len, micro_batch, *, seed, rank, world_size)
    Loader.next() -> (x, y); .state_dict(); .load_state_dict(d)
    load_tokenizer(path) -> ByteTokenizer | BPETokenizer

The optional packages ``datasets``, ``pyarrow`` and ``tokenizers`` (extra ``fibattn[data]``)
are imported only by the sources / tokenizer that need them.
"""
from __future__ import annotations

from .corpus import corpus_texts, read_corpus
from .loader import Loader, TokenData
from .manifest import MANIFEST_FILE, data_config, read_manifest
from .pipeline import ensure_prepared, prepare, verify_prepared
from .shards import ShardError, open_shard, write_shard
from .tokenizers import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

__all__ = [
    "BPETokenizer", "ByteTokenizer", "Loader", "MANIFEST_FILE", "ShardError", "TokenData", "corpus_texts",
    "data_config", "ensure_prepared", "load_tokenizer", "open_shard", "prepare", "read_corpus", "read_manifest",
    "train_bpe", "verify_prepared", "write_shard",
]
