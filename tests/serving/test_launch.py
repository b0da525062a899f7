"""The launch commands `export` prints parse with the engines' own argument parsers: vLLM's `vllm serve` parser from
the installed vllm, and SGLang's ServerArgs parser read from its released wheel (it imports without a GPU once
orjson and IPython are present; .ci/run downloads the wheel and names it in DRAFTPORT_SGLANG_WHEEL), in a
process of its own."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import zipfile

import pytest

from conftest import DEPTH, World


def launch(world: World, fmt: str, name: str) -> tuple[str, dict]:
    """(the export's directory, the launch commands its JSON answer names)."""
    import contextlib
    import io

    from draftport.verbs.export import ExportConfig, main

    out = os.path.join(world.root, "launch", name)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(ExportConfig(drafter=world.drafters[1], format=fmt, out=out, target=world.target_dir, json=True))
    return out, json.loads(buf.getvalue())["launch"]


@pytest.mark.parametrize("fmt", ["vllm", "speculators"])
def test_vllm_parses_the_serve_command(world, fmt):
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    out, cmds = launch(world, fmt, fmt)
    argv = shlex.split(cmds["vllm"])
    assert argv[:2] == ["vllm", "serve"]
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    args = parser.parse_args(argv[1:])
    assert args.model_tag == world.target_dir
    spec = args.speculative_config
    spec = json.loads(spec) if isinstance(spec, str) else dict(spec)
    assert spec == {"method": "eagle3", "model": out, "num_speculative_tokens": DEPTH}


SGLANG_PARSE = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
print(json.dumps({k: v for k, v in vars(p.parse_args(sys.argv[1:])).items() if k.startswith(("model_path", "speculative"))}))
"""


@pytest.fixture(scope="module")
def sglang_site(tmp_path_factory):
    """SGLang's package from its wheel, unpacked (its import patches torch's operator registry, so it is parsed in a
    process of its own, never in this one, where vLLM runs)."""
    wheel = os.environ.get("DRAFTPORT_SGLANG_WHEEL")
    if not wheel:
        pytest.skip("DRAFTPORT_SGLANG_WHEEL names no SGLang wheel (.ci/run downloads one)")
    root = tmp_path_factory.mktemp("sglang")
    with zipfile.ZipFile(wheel) as z:
        z.extractall(root, [n for n in z.namelist() if n.startswith("sglang/")])
    return str(root)


def test_sglang_parses_the_launch_command(world, sglang_site):
    out, cmds = launch(world, "vllm", "vllm-for-sglang")
    argv = shlex.split(cmds["sglang"])
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    env = dict(os.environ, PYTHONPATH=sglang_site)
    done = subprocess.run([sys.executable, "-c", SGLANG_PARSE, *argv[3:]], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    args = json.loads(done.stdout.strip().splitlines()[-1])
    assert (args["model_path"], args["speculative_algorithm"], args["speculative_draft_model_path"]) == \
        (world.target_dir, "EAGLE3", out)
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"], args["speculative_num_draft_tokens"]) == \
        (DEPTH, 1, DEPTH + 1)
