"""The bundled default corpus: Shakespeare's complete works (see ``corpus/ATTRIBUTION.md``).

``read_corpus()`` returns the whole text (checked against its sha256 once per process);
``corpus_texts()`` returns it split into its 42 texts (plays and poems), one document each.

Split rule: a text starts at its title line, the last non-blank line before a line that
reads ``by William Shakespeare``; it runs up to the next text's title. The split is
lossless: ``"".join(corpus_texts()) == read_corpus()``.
"""
from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.resources

from ..checks import UsageError

CORPUS_FILE = "works.txt.gz"
CORPUS_SHA256 = "3237e33221e73615c677bd59fd69a76da38f9a2eb51d6efb7191f32f8cb9fa4c"
ATTRIBUTION = "Open Shakespeare, Open Knowledge Foundation (CC BY 2.5; the works are in the public domain)"
_BYLINE = "by william shakespeare"


def corpus_resource():
    """The packaged ``works.txt.gz`` as an ``importlib.resources`` traversable."""
    return importlib.resources.files("fibattn.data").joinpath("corpus", CORPUS_FILE)


@functools.lru_cache(maxsize=1)
def read_corpus() -> str:
    """The uncompressed corpus text; raises ValueError if its sha256 does not match."""
    resource = corpus_resource()
    try:
        raw = gzip.decompress(resource.read_bytes())
    except (OSError, EOFError) as exc:
        raise UsageError(f"bundled corpus {resource} cannot be read: {exc}") from exc
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise UsageError(f"bundled corpus {resource} is corrupted: sha256 {digest}, expected {CORPUS_SHA256}")
    return raw.decode("utf-8")


def split_texts(text: str) -> list[str]:
    """Split a concatenation of texts at their title lines (see the module docstring)."""
    lines = text.splitlines(keepends=True)
    starts = []
    for i, line in enumerate(lines):
        if line.strip().lower() != _BYLINE:
            continue
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0 and (not starts or j > starts[-1]):
            starts.append(j)
    if not starts:
        return [text] if text else []
    starts[0] = 0                          # anything before the first title belongs to it
    bounds = starts + [len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@functools.lru_cache(maxsize=1)
def _texts() -> tuple[str, ...]:
    return tuple(split_texts(read_corpus()))


def corpus_texts() -> list[str]:
    """The corpus as a list of its texts, in file order (42 for the bundled file)."""
    return list(_texts())
