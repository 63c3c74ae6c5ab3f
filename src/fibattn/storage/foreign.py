"""What a folder given where a fibattn run or export is expected actually is, to say so in the error.

Below :mod:`.runs` and :mod:`.pretrained`, which both name a foreign folder the same way.
"""
from __future__ import annotations

from pathlib import Path

from ..files import read_json

CONFIG = "config.json"


def foreign_hint(path) -> str:
    """What a folder that is neither a fibattn run nor an export is, when its config.json says (a transformers
    folder, e.g. from ``export --format hf``), and what to use instead; ``""`` otherwise."""
    try:
        doc = read_json(Path(path) / CONFIG)
    except (OSError, ValueError):
        return ""
    if not isinstance(doc, dict) or "fibattn_format" in doc or not isinstance(doc.get("model_type"), str):
        return ""
    return (f" — it is a transformers folder (model_type {doc['model_type']!r}, e.g. from `fibattn export --format "
            f"hf`): load it with transformers (or fibattn.interop.hf_llama.from_pretrained); fibattn's commands take "
            f"the run it came from or a `fibattn export RUN OUT` folder, and `fibattn train --init-from` it starts "
            f"a new run from its weights")
