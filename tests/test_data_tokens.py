"""Tokenizers (byte, bpe) and the binary shard format."""
import struct
import sys

import numpy as np
import pytest

from fibattn.data import ShardError, load_tokenizer, open_shard, read_corpus, write_shard
from fibattn.data.shards import HEADER_BYTES, MAGIC, dtype_for_vocab, read_header
from fibattn.data.tokenizers import EOS_TOKEN, ByteTokenizer, train_bpe

TEXT = "Shall I compare thee to a summer's day? — naïve café ✓ 日本語\n\nThou art more lovely."


# ------------------------------------------------------------------------------ byte
def test_byte_roundtrip_and_eos(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert tok.vocab_size == 256 and tok.eos_id == 255 and tok.name == "byte"
    assert ids == list(TEXT.encode("utf-8")) and max(ids) < 255      # 0xFF never occurs in UTF-8
    assert tok.decode(ids) == TEXT
    assert tok.decode(ids + [tok.eos_id] + ids) == TEXT + TEXT       # decode drops eos
    assert [a.tolist() for a in tok.encode_batch([TEXT, "ab"])] == [ids, [97, 98]]
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path)                                  # a folder works too
    assert isinstance(again, ByteTokenizer) and again.encode(TEXT) == ids


def test_byte_decode_rejects_out_of_range():
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        ByteTokenizer().decode([1, 300])


# ------------------------------------------------------------------------------- bpe
@pytest.fixture(scope="module")
def small_text():
    return read_corpus()[:200_000]


def _docs(text, n=4000):
    return [text[i:i + n] for i in range(0, len(text), n)]


def test_bpe_train_save_load_roundtrip(tmp_path, small_text):
    pytest.importorskip("tokenizers")
    tok = train_bpe(_docs(small_text), 400)
    assert tok.name == "bpe" and 257 <= tok.vocab_size <= 400 and tok.eos_id == 0
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and all(0 <= i < tok.vocab_size for i in ids)
    assert len(tok.encode(small_text[:5000])) < 5000 * 0.6            # merges compress
    literal = tok.encode("a <|endoftext|> b")
    assert tok.eos_id not in literal and tok.decode(literal) == "a <|endoftext|> b"
    tok.save(tmp_path / "tokenizer.json")
    again = load_tokenizer(tmp_path / "tokenizer.json")
    assert again.vocab_size == tok.vocab_size and again.eos_id == tok.eos_id
    assert again.encode(TEXT) == ids and again.decode(ids + [again.eos_id]) == TEXT
    assert again.backend.token_to_id(EOS_TOKEN) == 0


def test_bpe_training_is_deterministic(small_text):
    pytest.importorskip("tokenizers")
    a = train_bpe(_docs(small_text[:80_000]), 320).to_json()
    b = train_bpe(_docs(small_text[:80_000]), 320).to_json()
    assert a == b


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="data.vocab_size must be an integer >= 257"):
        train_bpe(["abc"], 256)


def test_missing_tokenizers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"fibattn\[data\]"):
        train_bpe(["abc"], 300)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "nope.json")
    (tmp_path / "tokenizer.json").write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="neither"):
        load_tokenizer(tmp_path)


# ----------------------------------------------------------------------------- shards
def test_dtype_for_vocab():
    assert dtype_for_vocab(256) == np.uint16 and dtype_for_vocab(65536) == np.uint16
    assert dtype_for_vocab(65537) == np.uint32
    with pytest.raises(ValueError):
        dtype_for_vocab(0)


@pytest.mark.parametrize("vocab", [256, 100_000])
def test_shard_roundtrip_and_header(tmp_path, vocab):
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab, size=5000)
    dtype = dtype_for_vocab(vocab)
    rec = write_shard(tmp_path / "a.bin", toks, dtype)
    assert rec["file"] == "a.bin" and rec["tokens"] == 5000
    assert rec["bytes"] == HEADER_BYTES + 5000 * dtype.itemsize == (tmp_path / "a.bin").stat().st_size
    head = read_header(tmp_path / "a.bin")
    assert head.count == 5000 and head.dtype == dtype and head.version == 1
    raw = (tmp_path / "a.bin").read_bytes()
    assert raw[:8] == MAGIC and struct.unpack("<I", raw[12:16])[0] == dtype.itemsize
    arr = open_shard(tmp_path / "a.bin", verify=True, expected_sha256=rec["sha256"])
    assert isinstance(arr, np.memmap) and np.array_equal(arr, toks)
    with pytest.raises(ValueError, match="do not fit"):
        write_shard(tmp_path / "b.bin", np.array([70000]), np.uint16)


def test_truncated_shard_detected(tmp_path):
    path = tmp_path / "trunc.bin"
    write_shard(path, np.arange(1000), np.uint16)
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(ShardError, match=r"trunc\.bin is truncated"):
        open_shard(path)
    path.write_bytes(data[:20])
    with pytest.raises(ShardError, match=r"trunc\.bin is truncated"):
        open_shard(path)
    path.write_bytes(b"NOTASHRD" + data[8:])
    with pytest.raises(ShardError, match=r"trunc\.bin is not a fibattn token shard"):
        open_shard(path)
    with pytest.raises(ShardError, match="missing"):
        open_shard(tmp_path / "gone.bin")


def test_corrupted_shard_detected_with_verify(tmp_path):
    path = tmp_path / "bad.bin"
    rec = write_shard(path, np.arange(1000), np.uint16)
    data = bytearray(path.read_bytes())
    data[HEADER_BYTES + 100] ^= 0xFF
    path.write_bytes(bytes(data))
    open_shard(path)                                    # header and size still fine
    with pytest.raises(ShardError, match=r"bad\.bin is corrupted"):
        open_shard(path, verify=True)
    with pytest.raises(ShardError, match=r"bad\.bin"):
        open_shard(path, verify=True, expected_sha256=rec["sha256"])
