"""The package's layering, read from the source (AST) so lazy imports inside functions count too.

Rules (docs/internals.md, "the map of the house"):
1. The torch-free modules — `check/`, the root helpers (`economics`, `errors`, `progress`, `safeio`), `cli`, the engines'
   flags (`decode/options`, `train/config`) and the verbs `check`, `economics` and the flag builder
   (`verbs/flags`) — import no torch, transformers or matplotlib: not directly (lazy imports included), and
   not through any draftport module they import. `draftport check` and `economics` answer in well under a
   second and run without torch; `draftport --help` starts without it.
2. The parts form layers, each importing only those below it (and root helpers):
   check < data, model < decode < capture, serving < train < study < verbs < cli. decode/options.py, a torch-free leaf
   holding the engines' flags, is readable by every part (model/native.py takes its compile scopes from it).
3. No import cycles between modules, lazy imports included.
4. A draftport import inside a function is allowed only to keep torch out of a torch-free module, and its
   line says so (a comment with "lazy"). `if TYPE_CHECKING:` blocks never run and count as no import.
5. Nothing below the CLI imports the CLI.

`import_graph()` is also how the counts in the issue notes are made: the internal import arrows are
the distinct (importer, imported module) pairs of `arrows`, lazy ones included, packages' __init__ not
counted as a module.
"""
from __future__ import annotations

import ast
import pathlib

import draftport

HEAVY = ("torch", "transformers", "matplotlib")
ROOT = pathlib.Path(draftport.__file__).parent
HELPERS = ("economics", "errors", "interrupt", "progress", "safeio")  # root modules every part may import
LAYERS = {"check": 0, "data": 1, "model": 1, "decode": 2, "capture": 3, "serving": 3, "train": 4, "study": 5, "verbs": 6,
          "cli": 7, "__main__": 8}
LEAVES = ("draftport.decode.options",)          # torch-free flag modules every part may read
LIGHT_MODULES = ("draftport.cli", "draftport.decode.options", "draftport.train.config", "draftport.verbs",
                 "draftport.verbs.check", "draftport.verbs.economics", "draftport.verbs.flags")


def modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, packages included (draftport.check for check/__init__.py)."""
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = ["draftport", *p.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _type_checking(node) -> bool:
    """`if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`): imports only type checkers read."""
    t = node.test
    return isinstance(node, ast.If) and ((isinstance(t, ast.Name) and t.id == "TYPE_CHECKING")
                                         or (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"))


def imports_of(path: pathlib.Path, with_lines: bool = False) -> list[tuple]:
    """(imported name, at module top?) for every import in the file, (…, line number) with with_lines;
    `from a import b` yields a and a.b. Imports under `if TYPE_CHECKING:` are left out (they never run)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(c) for n in tree.body if isinstance(n, ast.If) and _type_checking(n) for c in ast.walk(n)}
    top = {id(n) for n in tree.body}
    # an import under a module-level `if`/`try` still runs at import time
    for n in tree.body:
        if isinstance(n, (ast.If, ast.Try)):
            top |= {id(c) for c in ast.walk(n) if isinstance(c, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        extra = (node.lineno,) if with_lines and hasattr(node, "lineno") else ()
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top, *extra) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, id(node) in top, *extra))
            out += [(f"{node.module}.{a.name}", id(node) in top, *extra) for a in node.names]
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


def _light(module: str) -> bool:
    return _part(module) in ("check", *HELPERS) or module in LIGHT_MODULES


def _heavy(names) -> list[str]:
    return sorted({n for n, _ in names if n.split(".")[0] in HEAVY})


def _closure(start: str, arrows, lazy: bool = False) -> set[str]:
    """draftport modules imported from `start`, transitively (packages' __init__ included); at module top only,
    or every import with lazy=True."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        parents = [".".join(m.split(".")[:i]) for i in range(2, m.count(".") + 1)]  # importing a.b.c runs a.b
        for nxt in [b for a, b, top in arrows if a == m and (top or lazy)] + parents:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_torch_free_parts():
    mods, arrows, raw = import_graph()
    light = [m for m in mods if _light(m)]
    assert {"draftport.check.compat", "draftport.economics", "draftport.cli", "draftport.verbs.check"} <= set(light)
    bad = {}
    for m in light:
        found = _heavy(raw[m]) + [f"{h} via {dep}" for dep in _closure(m, arrows)
                                  for h in _heavy([(n, t) for n, t in raw[dep] if t])]
        if found:
            bad[m] = found
    assert not bad, bad


def test_parts_import_only_the_layers_below():
    _, arrows, _ = import_graph()
    bad = []
    for a, b, _ in arrows:
        pa, pb = _part(a), _part(b)
        if pa == pb or pb in HELPERS or b in LEAVES:
            continue
        if pa in HELPERS or pb not in LAYERS or LAYERS[pb] >= LAYERS[pa]:
            bad.append((a, b))
    assert not sorted(bad), sorted(bad)


def test_the_leaves_and_helpers_import_no_part():
    _, arrows, _ = import_graph()
    bad = sorted((a, b) for a, b, _ in arrows if (a in LEAVES or _part(a) in HELPERS) and _part(b) not in HELPERS)
    assert not bad, bad


def test_no_import_cycles():
    """Tarjan's strongly connected components over every arrow, lazy ones included."""
    mods, arrows, _ = import_graph()
    succ = {m: sorted({b for a, b, _ in arrows if a == m}) for m in mods}
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in succ[v]:
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
                cycles.append(sorted(comp))

    for m in mods:
        if m not in index:
            visit(m)
    assert not cycles, cycles


def test_lazy_imports_only_keep_torch_out_and_say_so():
    mods, arrows, _ = import_graph()
    bad = []
    for m, path in mods.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for name, top, line in imports_of(path, with_lines=True):
            if top or not name.startswith("draftport.") or name not in mods:
                continue
            heavy_target = any(_heavy([(n, t) for n, t in imports_of(mods[d]) if t])
                               for d in {name} | _closure(name, arrows))
            if not (_light(m) and heavy_target and "lazy" in lines[line - 1]):
                bad.append(f"{m}:{line} imports {name} inside a function")
    assert not bad, bad


def test_nothing_below_the_cli_imports_it():
    _, arrows, _ = import_graph()
    bad = sorted((a, b) for a, b, _ in arrows if _part(b) == "cli" and _part(a) not in ("cli", "__main__"))
    assert not bad, bad


def test_the_graph_sees_lazy_imports(tmp_path):
    """The walker itself: an import inside a function is an arrow (not at top); one under a module-level
    `try` is at top; one under `if TYPE_CHECKING:` is none — so the rules above cannot pass by missing what a
    function imports."""
    p = tmp_path / "m.py"
    p.write_text("from typing import TYPE_CHECKING\ntry:\n    import torch\nexcept ImportError:\n    pass\n"
                 "if TYPE_CHECKING:\n    import matplotlib\n"
                 "def f():\n    from draftport.cli import main\n    import transformers\n")
    got = imports_of(p)
    assert ("torch", True) in got and ("transformers", False) in got
    assert ("draftport.cli", False) in got and ("draftport.cli.main", False) in got
    assert not [n for n, _ in got if n.startswith("matplotlib")]
    mods, arrows, _ = import_graph()
    assert len(mods) > 30 and arrows
