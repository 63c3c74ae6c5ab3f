"""Shared by the tests of the repo's tools (``tools/``): a tool loaded from its file, as a module."""
import importlib.util
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(stem: str, name: str | None = None):
    """``tools/<stem>.py`` as a module registered as ``name`` (default ``stem``): dataclasses look
    their module up by name."""
    spec = importlib.util.spec_from_file_location(name or stem, TOOLS / f"{stem}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
