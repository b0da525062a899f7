"""`draftport check`: is this drafter drop-in for another, a warm start, or incompatible; does it fit a target
and which layers each engine feeds it. Reads config.json and safetensors headers only (no torch).

The rules are check/'s: compat.py turns engines.py's serving rules and layers.py's id conventions into
findings and verdicts; this module loads the arguments, runs those checks and prints or returns the result.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from draftport.check.compat import (check_drafter, check_drafters, check_target, embedding_findings, engine_support,
                                    serving_class)
from draftport.check.engines import parse_engines
from draftport.check.inventory import PICKLE_SUFFIXES, Inventory, read_d2t, read_inventory
from draftport.check.spec import DrafterSpec, load_drafter_spec, load_target_spec
from draftport.errors import bad_input
from draftport.verbs.answer import answer


@dataclass
class CheckConfig:
    drafter: str                 # drafter directory, its config.json, or one .safetensors file beside a config.json
    other: str | None = None     # a second drafter: can `drafter` replace it behind the same target?
    target: str | None = None    # target dir, config.json, .gguf, or `gemma-3-270m`
    engine: str = "both"         # sglang | vllm | both: whose loading and aux-id rules to apply
    json: bool = False           # print one JSON object on stdout instead of tables


def _load_drafter(path: str) -> tuple[DrafterSpec, Inventory]:
    """A drafter argument -> (spec, inventory of its weights). Pickles are refused, never opened."""
    if os.path.isfile(path) and path.endswith(PICKLE_SUFFIXES):
        raise bad_input(path, "is a pickle file; draftport never unpickles weights (convert them to safetensors and "
                              "pass the drafter directory)")
    if os.path.isfile(path) and path.endswith(".safetensors"):
        config, weights = os.path.join(os.path.dirname(path) or ".", "config.json"), path
        if not os.path.isfile(config):
            raise bad_input(path, "no config.json beside this safetensors file")
    else:
        config = path
        weights = path if os.path.isdir(path) else (os.path.dirname(path) or ".")
    spec = load_drafter_spec(config)
    return spec, read_inventory(weights)


def _worst_exit(*verdicts: str | None) -> int:
    return 1 if any(v in ("partial", "incompatible", "invalid") for v in verdicts) else 0


def run_check(cfg: CheckConfig) -> dict:
    """Everything `check` reports, as the JSON object `--json` prints."""
    refs = parse_engines(cfg.engine)
    engines = tuple(r.engine for r in refs)
    a, inv_a = _load_drafter(cfg.drafter)
    nbytes = a.bytes_read + inv_a.bytes_read
    findings = check_drafter(a, inv_a, "drafter")
    result: dict = {"drafter": cfg.drafter}
    b = inv_b = target = None
    if cfg.other is not None:
        b, inv_b = _load_drafter(cfg.other)
        nbytes += b.bytes_read + inv_b.bytes_read
        findings += check_drafter(b, inv_b, "other")
        result["other"] = cfg.other
    if cfg.target is not None:
        target = load_target_spec(cfg.target)
        nbytes += target.bytes_read
        result["target"] = cfg.target
    structural = any(f["severity"] == "error" for f in findings if f.get("about") == "drafter")

    if b is not None:
        d2t_a = d2t_b = None
        if "d2t" in inv_a.tensors and "d2t" in inv_b.tensors:  # the only tensor data check ever reads
            d2t_a, d2t_b = read_d2t(inv_a.source, inv_a), read_d2t(inv_b.source, inv_b)
            nbytes += d2t_a.nbytes + d2t_b.nbytes
        verdict, pair, same = check_drafters(a, b, inv_a=inv_a, inv_b=inv_b, target=target, engines=refs,
                                             d2t_a=d2t_a, d2t_b=d2t_b)
        findings += pair
        result["verdict"] = verdict
        result["transferable_tensors"] = same
    if target is not None:
        tf, captured = check_target(a, inv_a, target, refs)
        findings += tf
        per_engine = {e: "incompatible" if structural or any(
            f["severity"] == "error" and f.get("engine") in (None, e) for f in tf) else "compatible" for e in engines}
        result["target_verdict"] = "incompatible" if "incompatible" in per_engine.values() else "compatible"
        result["engine_verdicts"] = per_engine
        result["engine_serving"] = {e: serving_class(findings, e) for e in engines}
        result["capture_layers"] = captured
        result.setdefault("verdict", result["target_verdict"])
    if b is None and target is None:
        # without a target the question is "can these engines load this checkpoint as its config
        # means": what an engine cannot load or would load silently wrong makes it invalid for it
        ef: list[dict] = []
        for ref in refs:
            ef += engine_support(a, inv_a, ref.engine, version=ref.version)
        ef += embedding_findings(a, inv_a, a.target_hidden_size, refs)  # fc reads states of the target's width
        findings += ef
        per_engine = {e: "incompatible" if structural or any(f["severity"] == "error" and f.get("engine") == e
                                                             for f in ef) else "compatible" for e in engines}
        result["engine_verdicts"] = per_engine
        result["engine_serving"] = {e: serving_class(findings, e) for e in engines}
        result["verdict"] = "invalid" if "incompatible" in per_engine.values() else "valid"
    result["findings"] = findings
    result["bytes_read"] = int(nbytes)
    return {"verdict": result.pop("verdict"), **result}


_STYLE = {"error": "bold red", "warning": "yellow", "info": "dim"}


def render(result: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    ok = _worst_exit(result["verdict"], result.get("target_verdict")) == 0
    line = f"verdict: [bold {'green' if ok else 'red'}]{result['verdict']}[/]"
    if "target_verdict" in result and "other" in result:
        line += f"   target: [bold]{result['target_verdict']}[/]"
    console.print(line)
    if result.get("engine_verdicts"):
        serving = result.get("engine_serving", {})
        console.print("engines: " + ", ".join(f"{e} {v}" + (f" ({serving[e]})" if e in serving else "")
                                              for e, v in result["engine_verdicts"].items()))
    if result.get("capture_layers"):
        console.print("layers captured: " + ", ".join(f"{e} {ids}" for e, ids in result["capture_layers"].items()))
    show_engine = any("engine" in f for f in result["findings"])
    show_about = "other" in result  # only two drafters make "which one" a question
    table = Table(show_header=True, header_style="bold", box=None, pad_edge=False)
    table.add_column("severity", no_wrap=True)
    table.add_column("code", no_wrap=True)
    if show_engine:
        table.add_column("engine", no_wrap=True)
    if show_about:
        table.add_column("about", no_wrap=True)
    table.add_column("message", overflow="fold", ratio=1)
    order = {"error": 0, "warning": 1, "info": 2}
    for f in sorted(result["findings"], key=lambda f: order[f["severity"]]):
        row = [f"[{_STYLE[f['severity']]}]{f['severity']}[/]", f["code"]]
        row += [f.get("engine", "")] if show_engine else []
        row += [f.get("about", "")] if show_about else []
        table.add_row(*row, escape(f["message"]))  # messages quote config values: text, never rich markup
    if result["findings"]:
        console.print(table)
    console.print(f"[dim]{result['bytes_read']} bytes read[/]")


def main(cfg: CheckConfig) -> int:
    result = run_check(cfg)
    answer(result, cfg.json, render)
    return _worst_exit(result["verdict"], result.get("target_verdict"))
