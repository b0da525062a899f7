"""A verb's dataclass config from flag values: the one way the CLI and the verbs that run other verbs (study,
demo) build configs. Torch-free: the CLI imports it before it knows which verb runs.

A field whose default is a dataclass (e.g. `eval`'s `decoding: EngineConfig`, its `lookup: LookupConfig`) is a group
of flags shared by several verbs: it is built from the same values, by field name. A name the outer config has
itself stays the outer config's (`eval --max-len` bounds the prompt; it is not the engine's cache size).
"""

from __future__ import annotations

import dataclasses


def _group(f: dataclasses.Field):
    """The dataclass type of a field whose default is one (a flag group), else None."""
    if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory):
        return f.default_factory
    return None


def config_from(cls, values: dict, taken: frozenset = frozenset()):
    """cls(**the values it declares): fields absent from `values` keep their defaults; flag groups are built from
    the same values (names in `taken`, the outer configs' own, excepted)."""
    fields = dataclasses.fields(cls)
    own = taken | {f.name for f in fields if _group(f) is None}
    kwargs = {}
    for f in fields:
        group = _group(f)
        if group is not None:
            kwargs[f.name] = config_from(group, values, own) if f.name not in values else values[f.name]
        elif f.name in values and f.name not in taken:
            kwargs[f.name] = values[f.name]
    return cls(**kwargs)
