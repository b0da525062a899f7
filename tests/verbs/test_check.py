"""`draftport check` end to end: JSON contract, exit codes, one-line errors, no torch, header-only reads."""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys

import pytest

from draftport.cli import main
from draftport.check.spec import load_drafter_spec
from test_inventory import TINY, write_drafter, write_sparse_checkpoint


def run(capsys, *argv):
    rc = main(["check", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv):
    rc, out, err = run(capsys, *argv, "--json")
    return rc, json.loads(out)  # exactly one JSON object on stdout, nothing else


def test_kimi_drafter_on_deepseek_v3(capsys, fixtures_dir):
    rc, r = run_json(capsys, fixtures_dir / "drafter-kimi-k2-eagle3-aqmedai", "--target", fixtures_dir / "target-deepseek-v3")
    assert rc == 1
    assert r["verdict"] == r["target_verdict"] == "incompatible"
    assert r["capture_layers"] == {"sglang": [2, 30, 58], "vllm": [2, 30, 58]}
    assert any(f["code"] == "vocab_mismatch" and "163840" in f["message"] and "129280" in f["message"] for f in r["findings"])
    assert all(set(f) >= {"severity", "code", "message"} and f["severity"] in ("error", "warning", "info")
               for f in r["findings"])
    assert 0 < r["bytes_read"] < 10_000


def test_exit_codes_follow_the_worse_verdict(capsys, fixtures_dir):
    F = fixtures_dir
    rc, r = run_json(capsys, F / "drafter-llama3.1-8b-eagle3-sglang", "--target", F / "target-llama3.1-8b-instruct")
    assert (rc, r["verdict"]) == (0, "compatible")
    rc, r = run_json(capsys, F / "drafter-llama3.1-8b-eagle3-sglang", F / "drafter-llama3.1-8b-eagle3-speculators",
                     "--engine", "vllm")
    assert (rc, r["verdict"]) == (0, "drop-in") and "capture_layers" not in r and "target_verdict" not in r
    rc, r = run_json(capsys, F / "drafter-llama3.1-8b-eagle3-sglang", F / "drafter-llama3.1-8b-eagle3-speculators",
                     "--target", F / "target-llama3.1-8b-instruct")
    # the pair is a warm start (SGLang cannot load the speculators one), the first drafter fits: exit 0
    assert (rc, r["verdict"], r["target_verdict"]) == (0, "warm-start", "compatible")
    rc, r = run_json(capsys, F / "drafter-llama3.1-8b-eagle3-sglang", F / "drafter-qwen3-8b-eagle3-sglang",
                     "--target", F / "target-llama3.1-8b-instruct")
    assert (rc, r["verdict"], r["target_verdict"]) == (1, "incompatible", "compatible")
    rc, r = run_json(capsys, F / "drafter-qwen3-8b-eagle3-sglang")
    assert (rc, r["verdict"]) == (0, "valid")


def test_single_drafter_valid_and_invalid(capsys, tmp_path):
    write_drafter(tmp_path / "ok")
    rc, r = run_json(capsys, tmp_path / "ok")
    assert (rc, r["verdict"]) == (0, "valid")
    write_drafter(tmp_path / "bad", drop=("midlayer.self_attn.q_proj.weight",))
    rc, r = run_json(capsys, tmp_path / "bad" / "model.safetensors")  # a weights file beside its config works too
    assert (rc, r["verdict"]) == (1, "invalid")
    assert any(f["code"] == "missing_tensors" and "q_proj" in f["message"] for f in r["findings"])


def test_pair_of_real_checkpoints_reads_d2t_only(capsys, tmp_path):
    write_drafter(tmp_path / "a")
    write_drafter(tmp_path / "b", shards=2)
    rc, r = run_json(capsys, tmp_path / "a", tmp_path / "b")
    assert (rc, r["verdict"]) == (0, "drop-in")
    headers = sum(8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in tmp_path.glob("*/*.safetensors"))
    configs = sum(p.stat().st_size for p in tmp_path.glob("*/*.json"))
    assert r["bytes_read"] == headers + configs + 2 * 40 * 8  # + two int64 d2t vectors of 40


def test_sparse_3gb_checkpoint_costs_under_a_mebibyte(capsys, tmp_path, fixtures_dir):
    d = tmp_path / "big"
    d.mkdir()
    (d / "config.json").write_text((fixtures_dir / "drafter-llama3.1-8b-eagle3-sglang" / "config.json").read_text())
    write_sparse_checkpoint(d / "model.safetensors", load_drafter_spec(d))
    assert (d / "model.safetensors").stat().st_size > 3 * 10**9
    rc, r = run_json(capsys, d, "--target", fixtures_dir / "target-llama3.1-8b-instruct")
    assert rc == 0 and r["target_verdict"] == "compatible"
    assert r["bytes_read"] < 1 << 20


def _pickle(path):
    path.write_bytes(pickle.dumps({"fc.weight": [1, 2, 3]}))


def _safetensors(path, header: bytes, claimed=None, data=b""):
    path.write_bytes(struct.pack("<Q", len(header) if claimed is None else claimed) + header + data)


MALFORMED = {
    "truncated_json": lambda d: (d / "config.json").write_text('{"architectures": ["LlamaForCausalLMEagle3"], "hidden'),
    "non_object_json": lambda d: (d / "config.json").write_text('["LlamaForCausalLMEagle3"]'),
    "missing_keys": lambda d: (d / "config.json").write_text(json.dumps({k: v for k, v in TINY.items() if k != "hidden_size"})),
    "config_is_a_pickle": lambda d: _pickle(d / "config.json"),
    "header_past_end": lambda d: _safetensors(d / "model.safetensors", b"{}", claimed=10_000),
    "header_not_json": lambda d: _safetensors(d / "model.safetensors", b"PK\x03\x04 not json at all"),
    "offsets_out_of_range": lambda d: _safetensors(d / "model.safetensors", json.dumps(
        {"fc.weight": {"dtype": "F32", "shape": [16, 48], "data_offsets": [0, 3072]}}).encode(), data=b"\0" * 64),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_input_is_one_line_and_exit_2(capsys, tmp_path, case):
    d = tmp_path / "drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    MALFORMED[case](d)
    rc, out, err = run(capsys, d, "--json")
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("draftport: ") and str(d) in err and "Traceback" not in err


def test_other_bad_paths(capsys, tmp_path, fixtures_dir):
    (tmp_path / "empty").mkdir()
    _pickle(tmp_path / "pytorch_model.bin")
    (tmp_path / "t.gguf").write_bytes(b"GGUF" + b"\0" * 4)
    cases = [((tmp_path / "empty",), "directory has no config.json"),
             ((tmp_path / "pytorch_model.bin",), "is a pickle file"),
             ((tmp_path / "nowhere",), "no such file"),
             ((fixtures_dir / "drafter-kimi-k2-eagle3-aqmedai", "--target", tmp_path / "empty"), "directory has no config.json"),
             ((fixtures_dir / "drafter-kimi-k2-eagle3-aqmedai", "--target", tmp_path / "t.gguf"), "GGUF"),
             ((fixtures_dir / "target-deepseek-v3",), "unsupported drafter architecture")]
    for argv, words in cases:
        rc, out, err = run(capsys, *argv)
        assert rc == 2 and out == "" and words in err and err.count("\n") == 1, (argv, err)


def test_human_output(capsys, fixtures_dir):
    rc, out, err = run(capsys, fixtures_dir / "drafter-deepseek-v3-eagle3-sglang", "--target", fixtures_dir / "target-deepseek-v3")
    assert rc == 0 and "verdict: compatible" in out and "[2, 30, 58]" in out and "bytes read" in out


def test_real_process_never_imports_torch_and_errors_cleanly(fixtures_dir, tmp_path):
    code = ("import sys, json\nfrom draftport.cli import main\n"
            f"rc = main(['check', {str(fixtures_dir / 'drafter-kimi-k2-eagle3-aqmedai')!r}, "
            f"{str(fixtures_dir / 'drafter-deepseek-v3-eagle3-sglang')!r}, '--target', "
            f"{str(fixtures_dir / 'target-deepseek-v3')!r}, '--json'])\n"
            "print(json.dumps({'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules)}))\n"
            "sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    lines = p.stdout.splitlines()
    assert p.returncode == 1 and json.loads(lines[0])["verdict"] == "incompatible"
    assert json.loads(lines[1]) == {"heavy": []}
    (tmp_path / "config.json").write_text("{")
    p = subprocess.run([sys.executable, "-m", "draftport", "check", str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and "malformed JSON" in p.stderr


def test_export_takes_the_embedding_from_the_target_directory(tmp_path):
    """A draftport checkpoint carries no embedding; with --target a layout that needs one (speculators by default,
    or --include-embedding) takes the target's, read from its safetensors without loading the model."""
    import torch
    from safetensors.torch import load_file

    from draftport import cli
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import save_drafter
    from draftport.model.target import target_embedding, tiny_target
    from draftport.train.warm_start import drafter_config

    tg = tiny_target("llama")
    tdir = tmp_path / "target"
    tg.model.save_pretrained(tdir)
    tg.tokenizer.save_pretrained(tdir)
    torch.testing.assert_close(target_embedding(str(tdir)), tg.embed_weight.float())
    d = Eagle3Drafter.from_config(drafter_config(tg, [2, 4, 5], tg.vocab_size, tg.vocab_size), seed=0)
    save_drafter(d, tmp_path / "src", format="sglang", target=tg.spec, layers=[2, 4, 5])
    for fmt, extra in (("speculators", []), ("vllm", ["--include-embedding"])):
        out = tmp_path / fmt
        assert cli.main(["export", str(tmp_path / "src"), "--format", fmt, "--out", str(out), "--target", str(tdir),
                         "--json", *extra]) == 0
        torch.testing.assert_close(load_file(out / "model.safetensors")["embed_tokens.weight"].float(),
                                   tg.embed_weight.float())
    # asked for, and the target is a config without weights: one line, exit 2, nothing written
    (tmp_path / "cfgonly").mkdir()
    (tmp_path / "cfgonly" / "config.json").write_text((tdir / "config.json").read_text())
    assert cli.main(["export", str(tmp_path / "src"), "--format", "vllm", "--out", str(tmp_path / "no"),
                     "--target", str(tmp_path / "cfgonly"), "--include-embedding"]) == 2
    assert not (tmp_path / "no").exists()
