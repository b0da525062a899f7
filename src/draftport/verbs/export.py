"""`draftport export`: load a drafter in any layout, write it in an engine's (model/formats.py does the
conversion), and print the command lines that serve it."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from draftport.check.compat import check_drafter, embedding_findings, engine_support, target_findings
from draftport.check.engines import FORMAT_ENGINES, EngineRef, parse_engines
from draftport.check.inventory import read_inventory
from draftport.check.spec import TargetSpec, load_drafter_spec
from draftport.errors import DraftportError
from draftport.model.formats import FORMATS, load_drafter, save_drafter
from draftport.model.gguf import EMBEDDED_DEFAULT, embedded_default_dir
from draftport.model.target import target_embedding
from draftport.safeio import atomic_rename_dir


@dataclass
class ExportConfig:
    drafter: str                          # drafter directory or config.json, any supported layout
    format: str = "sglang"                # sglang | vllm | speculators
    out: str | None = None                # output directory (must be new or empty)
    target: str | None = None             # target dir / config / .gguf / gemma-3-270m: decides the id rules
    json: bool = False                    # one JSON object on stdout
    depth: int = 3                        # chain depth for the launch commands and the speculators config
    include_embedding: bool | None = None  # None: the format decides (see save_drafter)
    engine: str | None = None             # engine[@version] whose rules judge the export (default: the format's
    #                                       engines at their newest rules, check/engines.FORMAT_ENGINES)
    force: bool = False                   # write even what the engine would refuse or mis-load (with a warning)


def export_engines(format: str, engine: str | None) -> tuple:
    """The EngineRefs an export is judged by: the engines `format` is for, at the versions --engine names."""
    named = {r.engine: r for r in parse_engines(engine)} if engine else {}
    stray = sorted(set(named) - set(FORMAT_ENGINES[format]))
    if stray:
        raise DraftportError(f"--engine {engine}: --format {format} is for {', '.join(FORMAT_ENGINES[format])}, "
                             f"not {', '.join(stray)}")
    return tuple(named.get(e, EngineRef(e)) for e in FORMAT_ENGINES[format])


def needs_embedding(spec, cfg: ExportConfig) -> bool:
    """Will the written layout carry embed_tokens.weight (asked, the speculators format, or another width)?"""
    if cfg.include_embedding is not None:
        return cfg.include_embedding
    return cfg.format == "speculators" or spec.hidden_size != spec.target_hidden_size


def export_findings(directory: str, refs, target: TargetSpec | None) -> list[dict]:
    """What `check` says of the written directory for these engines: export and check share one judge."""
    spec, inv = load_drafter_spec(directory), read_inventory(directory)
    out = [f for f in check_drafter(spec, inv) if f["severity"] == "error"]
    for ref in refs:
        out += engine_support(spec, inv, ref.engine, version=ref.version)
    if target is not None:
        out += target_findings(target, refs)
    out += embedding_findings(spec, inv, spec.target_hidden_size, refs)  # fc's input width is the target's
    return [f for f in out if f["severity"] == "error"]


def served_target(target_path: str | None) -> str | None:
    """The path an engine loads the target from: the directory or file given (made absolute when it exists);
    for the embedded default, whose name no engine resolves (its GGUF ships inside a Python package), the
    HF directory draftport converts it into, in its cache (converted here if it is not there yet)."""
    if target_path == EMBEDDED_DEFAULT and not os.path.exists(target_path):
        return embedded_default_dir()
    return os.path.abspath(target_path) if target_path and os.path.exists(target_path) else target_path


def launch_commands(out: str, format: str, target_path: str | None, k: int) -> dict[str, str]:
    """The SGLang / vLLM command lines that serve the exported drafter (chain of depth k, topk 1) on the
    target at `target_path` (served_target's path; None: a <TARGET> placeholder)."""
    tgt = target_path or "<TARGET>"
    cmds = {}
    if format in ("sglang", "vllm"):
        cmds["sglang"] = " ".join([
            "python -m sglang.launch_server", "--model-path", shlex.quote(tgt),
            "--speculative-algorithm EAGLE3", "--speculative-draft-model-path", shlex.quote(out),
            f"--speculative-num-steps {k}", "--speculative-eagle-topk 1", f"--speculative-num-draft-tokens {k + 1}"])
    if format in ("vllm", "speculators"):
        spec_cfg = json.dumps({"method": "eagle3", "model": out, "num_speculative_tokens": k})
        cmds["vllm"] = f"vllm serve {shlex.quote(tgt)} --speculative-config {shlex.quote(spec_cfg)}"
    return cmds


def main(cfg: ExportConfig) -> int:
    if cfg.format not in FORMATS:
        raise DraftportError(f"unknown format {cfg.format!r} (expected one of {', '.join(FORMATS)})")
    if cfg.out is None:
        raise DraftportError("--out is required")
    out = Path(cfg.out).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DraftportError("exists and is not an empty directory (choose another --out or remove it)", out)
    refs = export_engines(cfg.format, cfg.engine)
    drafter, report = load_drafter(cfg.drafter)
    if drafter.embedding_source == "unset" and cfg.target is not None and needs_embedding(drafter.spec, cfg):
        # draftport's checkpoints share the target's embedding and do not carry it: --target has it
        emb = target_embedding(cfg.target)
        if emb is not None:
            drafter.set_embedding(emb)
        elif cfg.include_embedding:
            raise DraftportError("--include-embedding: the drafter carries no embedding and the target directory "
                                 "holds no weights to take it from", cfg.target)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".tmp-{out.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        result = save_drafter(drafter, tmp, cfg.format, target=cfg.target, include_embedding=cfg.include_embedding,
                              num_speculative_tokens=cfg.depth)
        problems = export_findings(str(tmp), refs, result.aux.target)
        if problems and not cfg.force:
            p = problems[0]
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            who = p.get("engine") or "the checkpoint"
            raise DraftportError(f"not written: {who} would refuse or mis-load this export: {p['message']} "
                                 f"[{p['code']}]{more}; pass --force to write it anyway", cfg.drafter)
        # the vLLM layout also loads in SGLang when it has one decoder layer (midlayer. + eagle_config
        # ids): its SGLang launch line is printed only when SGLang's rules find nothing wrong with it
        also_sglang = cfg.format == "vllm" and not export_findings(str(tmp), (EngineRef("sglang"),), result.aux.target)
        for p in problems:
            result.notes.append(f"written with --force although {p.get('engine') or 'the checkpoint'} would refuse or "
                                f"mis-load it: {p['message']} [{p['code']}]")
            print(f"draftport: warning: --force: {p.get('engine') or ''} {p['code']}: {p['message']}", file=sys.stderr)
        atomic_rename_dir(str(tmp), str(out))     # the commit point: all files or none
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    aux = result.aux
    served = served_target(aux.target_path)
    if served != aux.target_path and aux.target_path == EMBEDDED_DEFAULT:
        result.notes.append(f"{EMBEDDED_DEFAULT} is served from its converted HF directory {served}")
    if served is None:
        result.notes.append("no target known: the launch lines say <TARGET> (pass --target to name it)")
    commands = launch_commands(str(out), cfg.format, served, cfg.depth)
    if cfg.format == "vllm" and not also_sglang:
        commands.pop("sglang", None)
        result.notes.append("no SGLang launch line: SGLang would refuse or mis-load this layout "
                            "(`draftport check --engine sglang` says why)")
    payload = {
        "out": str(out), "format": cfg.format, "files": result.files, "num_tensors": result.num_tensors,
        "embedding_included": result.embedding_included,
        "layers": aux.layers, "layers_source": aux.source,
        "aux_ids": {"sglang": aux.sglang_ids if cfg.format != "speculators" else None,
                    "vllm": aux.vllm_ids if cfg.format != "sglang" else None},
        "target": aux.target_path, "served_target": served,
        "load": {"layout": report.layout, "missing": report.missing, "unexpected": report.unexpected},
        "notes": result.notes, "launch": commands,
    }
    if cfg.json:
        print(json.dumps(payload))
        return 0
    _render(payload)
    return 0


def _render(p: dict) -> None:
    con = Console()
    table = Table(title=f"draftport export → {p['format']}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("written", f"{p['out']} ({', '.join(p['files'])}; {p['num_tensors']} tensors"
                             f"{', with embedding' if p['embedding_included'] else ''})")
    table.add_row("aux layers", f"{p['layers']} ({p['layers_source']})")
    for engine, ids in p["aux_ids"].items():
        if ids is not None:
            where = "eagle_config.eagle_aux_hidden_state_layer_ids" if engine == "sglang" else \
                "eagle_aux_hidden_state_layer_ids (top level)"
            table.add_row(f"{engine} ids", f"{ids}  [{where}]")
    if p["load"]["missing"]:
        table.add_row("missing in source", ", ".join(p["load"]["missing"]))
    if p["load"]["unexpected"]:
        table.add_row("ignored from source", ", ".join(p["load"]["unexpected"]))
    for note in p["notes"]:
        table.add_row("note", note)
    con.print(table)
    for engine, cmd in p["launch"].items():
        con.print(f"[bold]{engine}[/bold]:")
        print(cmd, file=sys.stdout)
