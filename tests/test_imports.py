"""The package's layering, read from the source (AST) so lazy imports inside functions count too.

Rules (docs/internals.md, "the map of the house"):
1. `check/`, `economics`, `errors` and `safeio` import no torch, transformers or matplotlib: not
   directly (lazy imports included), and not through any draftport module they import at module top.
   `check` runs on a laptop without torch (tests/test_economics.py proves it for economics in a
   subprocess); the rule keeps that true as code moves.
2. `cli` imports none of them at module top either (directly or through draftport modules), so
   `draftport --help` and `draftport check` start without torch.
3. `check/` imports only `check/`, `errors` and `safeio` of draftport: it sits under every other part.
4. `decode/` never imports `train/`: the engine does not depend on training (train/ may use decode/).
5. Nothing below the CLI imports the CLI (`cli` and `__main__` only).

`import_graph()` is also how the import graph is counted: the internal import arrows are
the distinct (importer, imported module) pairs of `arrows`, lazy ones included, packages' __init__ not
counted as a module.
"""
from __future__ import annotations

import ast
import pathlib

import draftport

HEAVY = ("torch", "transformers", "matplotlib")
ROOT = pathlib.Path(draftport.__file__).parent


def modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, packages included (draftport.check for check/__init__.py)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["draftport", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def imports_of(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(imported name, at module top?) for every import in the file; `from a import b` yields a and a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    # an import under a module-level `if`/`try` still runs at import time
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(c) for c in ast.walk(n) if isinstance(c, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top))
            out += [(f"{node.module}.{a.name}", id(node) in top) for a in node.names]
    return out


def import_graph() -> tuple[dict[str, pathlib.Path], set[tuple[str, str, bool]], dict[str, list[tuple[str, bool]]]]:
    """-> (modules, arrows {(importer, imported draftport module, at top)}, raw imports per module)."""
    mods = modules()
    raw = {m: imports_of(p) for m, p in mods.items()}
    arrows = set()
    for m, names in raw.items():
        for name, at_top in names:
            # a package's __init__ is no arrow of its own (`from draftport.check import spec` is one arrow, to spec)
            if name in mods and name != m and mods[name].name != "__init__.py":
                arrows.add((m, name, at_top))
    return mods, arrows, raw


def _part(module: str) -> str:
    """draftport.check.spec -> check; draftport.cli -> cli."""
    return module.split(".")[1] if "." in module else ""


def _heavy(names) -> list[str]:
    return sorted({n for n, _ in names if n.split(".")[0] in HEAVY})


def _top_closure(start: str, arrows) -> set[str]:
    """draftport modules imported at module top from `start`, transitively (packages' __init__ included)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        parents = [".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)]  # importing a.b.c runs a.b
        for nxt in [b for a, b, top in arrows if a == m and top] + parents:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_torch_free_parts():
    mods, arrows, raw = import_graph()
    light = [m for m in mods if _part(m) in ("check", "economics", "errors", "safeio")]
    assert "draftport.check.compat" in light and "draftport.economics" in light
    bad = {}
    for m in light:
        direct = _heavy(raw[m])
        via = {dep: _heavy([(n, t) for n, t in raw[dep] if t]) for dep in _top_closure(m, arrows)}
        found = direct + [f"{h} via {dep}" for dep, hs in via.items() for h in hs]
        if found:
            bad[m] = found
    for dep in _top_closure("draftport.cli", arrows):
        if _heavy([(n, t) for n, t in raw[dep] if t]):
            bad.setdefault("draftport.cli", []).append(f"{_heavy(raw[dep])} via {dep}")
    if _heavy([(n, t) for n, t in raw["draftport.cli"] if t]):
        bad.setdefault("draftport.cli", []).append("at module top")
    assert not bad, bad


def test_check_sits_under_every_part():
    _, arrows, _ = import_graph()
    bad = sorted((a, b) for a, b, _ in arrows
                 if _part(a) == "check" and _part(b) not in ("check", "errors", "safeio"))
    assert not bad, bad


def test_decode_does_not_import_train():
    _, arrows, _ = import_graph()
    bad = sorted((a, b) for a, b, _ in arrows if _part(a) == "decode" and _part(b) == "train")
    assert not bad, bad


def test_nothing_below_the_cli_imports_it():
    _, arrows, _ = import_graph()
    bad = sorted((a, b) for a, b, _ in arrows if _part(b) == "cli" and _part(a) not in ("cli", "__main__"))
    assert not bad, bad


def test_the_graph_sees_lazy_imports(tmp_path):
    """The walker itself: an import inside a function is an arrow (not at top); one under a module-level
    `try` is at top — so the rules above cannot pass by missing what a function imports."""
    p = tmp_path / "m.py"
    p.write_text("try:\n    import torch\nexcept ImportError:\n    pass\n"
                 "def f():\n    from draftport.cli import main\n    import transformers\n")
    got = imports_of(p)
    assert ("torch", True) in got and ("transformers", False) in got
    assert ("draftport.cli", False) in got and ("draftport.cli.main", False) in got
    mods, arrows, _ = import_graph()
    assert len(mods) > 30 and any(not top for _, _, top in arrows)
