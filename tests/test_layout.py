"""The package layout: dependencies run one way and nothing imports in a circle.

Every import of a fibattn module counts, at module level or inside a function. A module may
import from its own layer's package or from a layer below; packages that share a layer
(``data`` / ``model``, ``interop`` / ``study``) may not import each other. The root package
``fibattn`` (the public facade) is outside the layers.
"""
import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = [  # lowest first
    ("fibattn.config", "fibattn.config_files", "fibattn.presets", "fibattn.schedules", "fibattn.files", "fibattn.locks", "fibattn.plots", "fibattn.checks",
     "fibattn.devices", "fibattn.validation", "fibattn.threads", "fibattn.entry", "fibattn.effective", "fibattn.launch"),
    ("fibattn.ops",),
    ("fibattn.generation",),
    ("fibattn.model", "fibattn.data"),
    ("fibattn.storage", "fibattn.parallel"),
    ("fibattn.trainer",),
    ("fibattn.eval",),
    ("fibattn.interop", "fibattn.study"),
    ("fibattn.bench",),
    ("fibattn.cli",),
]


def modules() -> dict[str, Path]:
    out = {}
    for f in (SRC / "fibattn").rglob("*.py"):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


MODULES = modules()


def home(module: str) -> tuple[int, str] | None:
    """``(layer, package)`` of a module; None for the root facade."""
    for i, layer in enumerate(LAYERS):
        for pkg in layer:
            if module == pkg or module.startswith(pkg + "."):
                return i, pkg
    return None


def imports(module: str) -> set[str]:
    path = MODULES[module]
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                b = base
                for _ in range(node.level - 1):
                    b = b.rpartition(".")[0]
                src = b + ("." + node.module if node.module else "")
            else:
                src = node.module or ""
            names = [src] + [f"{src}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and name.startswith("fibattn"):
                found.add(name)
    return found


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "fibattn" and home(m) is None] == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "fibattn"))
def test_imports_run_downwards(module):
    layer, pkg = home(module)
    bad = []
    for target in sorted(GRAPH[module]):
        where = home(target)
        if where is None:
            continue                                  # the root facade (e.g. __version__)
        t_layer, t_pkg = where
        if t_layer > layer or (t_layer == layer and t_pkg != pkg and layer > 0):      # the core is one group
            bad.append(f"{target} (layer {t_layer}, {t_pkg})")
    assert not bad, f"{module} (layer {layer}, {pkg}) imports upwards or sideways: {', '.join(bad)}"


def test_no_import_circles():
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v, counter=[0]):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w == "fibattn" or w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in GRAPH:
        if m not in index:
            visit(m)
    assert circles == []


def test_no_module_over_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}
