"""What the writing verbs leave on disk, on one small pipeline (a tiny Llama saved as an HF directory: capture →
train → export in every format → eval): every file readable by others as open() would make it (0644 under
umask 022), checkpoint disk use reported and bounded (the optimizer's moments in the newest checkpoint only),
launch lines that name the target's real path, and `check` clean on draftport's own drafter and exports for
the engines they are for."""

from __future__ import annotations

import io
import json
import os
import stat
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from draftport import cli
from draftport.train import resume, rundir

STEPS = 4
FORMAT_ENGINE = {"sglang": "sglang", "vllm": "vllm", "speculators": "vllm"}  # the engine each format is for


def _cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = cli.main(argv)
    return rc, out.getvalue(), err.getvalue()


def _convs(path: Path, n: int) -> str:
    topics = ["the sea", "a robot who paints", "counting to ten", "the quick brown fox"]
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about {topics[i % 4]}."},
        {"role": "assistant", "content": f"Here is a short answer about {topics[i % 4]}, number {i}."}]}) + "\n"
        for i in range(n)))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The pipeline, under umask 022: {name: path} of what each verb wrote, plus train's --json answer and output."""
    from draftport.model.target import tiny_target

    root = tmp_path_factory.mktemp("written")
    old = os.umask(0o022)
    try:
        t = tiny_target("llama", seed=0)
        target = root / "target"
        with redirect_stderr(io.StringIO()):
            t.model.save_pretrained(target)
            t.tokenizer.save_pretrained(target)
        data = _convs(root / "convs.jsonl", 8)
        w = {"target": target, "store": root / "store", "train": root / "train", "eval": root / "eval"}
        rc, _, err = _cli(["capture", "--target", str(target), "--data", data, "--out", str(w["store"]),
                           "--device", "cpu", "--max-len", "48"])
        assert rc == 0, err
        rc, out, err = _cli(["train", "--target", str(target), "--data", str(w["store"]), "--out", str(w["train"]),
                             "--steps", str(STEPS), "--save-every", "1", "--batch-size", "2", "--ttt-steps", "2",
                             "--device", "cpu", "--json"])
        assert rc == 0, err
        w["summary"], w["train_text"] = json.loads(out), " ".join(err.split())
        for fmt in FORMAT_ENGINE:
            w[f"export-{fmt}"] = root / f"export-{fmt}"
            rc, out, err = _cli(["export", str(w["train"] / "final"), "--format", fmt, "--out",
                                 str(w[f"export-{fmt}"]), "--json"])
            assert rc == 0, err
            w[f"launch-{fmt}"] = json.loads(out)
        rc, _, err = _cli(["eval", "--target", str(target), "--drafter", str(w["train"] / "final"), "--prompts", data,
                           "--max-samples", "1", "--max-new-tokens", "8", "--no-hf-baseline", "--out", str(w["eval"]),
                           "--device", "cpu"])
        assert rc == 0, err
    finally:
        os.umask(old)
    return w


def test_every_file_the_verbs_write_is_readable_by_others(run):
    """safetensors' writer and mkstemp create 0600 files: checkpoints, exports and stores get the mode open()
    gives (0666 less the umask), as config.json always had, so an engine running as another user loads them."""
    seen = {}
    for name in ("store", "train", "eval", *(f"export-{f}" for f in FORMAT_ENGINE)):
        for p in [run[name], *run[name].rglob("*")]:
            seen[str(p.relative_to(run[name].parent))] = stat.S_IMODE(p.stat().st_mode) | (0o40000 if p.is_dir() else 0)
    wrong = {p: oct(m) for p, m in seen.items() if m not in (0o644, 0o40755)}
    assert not wrong, wrong
    names = {Path(p).name for p in seen}
    assert {"model.safetensors", "state.safetensors", "optimizer.safetensors", "shard-00000.safetensors",
            "config.json", "summary.json"} <= names  # the writers this guards were all exercised


def test_train_reports_checkpoint_disk_use_and_keeps_the_moments_in_the_newest_only(run):
    s, out = run["summary"], run["train"]
    kept = rundir.list_checkpoints(out)
    assert [step for step, _ in kept] == [2, 3, 4]  # --keep-last's default, 3
    moments = [p.name for _, p in kept if (p / resume.RESUME / resume.OPTIMIZER_TENSORS).exists()]
    assert moments == ["step-00000004"]
    for _, p in kept[:-1]:
        meta = resume.verify_checkpoint(p)
        assert meta["weights_only"] is True and "resume/optimizer.safetensors" not in meta["files"]
    newest = kept[-1][1] / resume.RESUME
    # Adam's two moments are twice the fp32 master weights: the file an older checkpoint no longer holds
    assert (newest / resume.OPTIMIZER_TENSORS).stat().st_size > (newest / resume.STATE_TENSORS).stat().st_size
    on_disk = sum(p.stat().st_size for p in (out / rundir.CHECKPOINTS).rglob("*") if p.is_file())
    assert s["checkpoints"] == {"path": str(out / rundir.CHECKPOINTS), "kept": 3, "bytes": on_disk,
                                "newest_step": STEPS, "keep_last": 3}
    from draftport.capture.capture import human_bytes

    assert f"checkpoints: 3 in {out / rundir.CHECKPOINTS}, {human_bytes(on_disk)} on disk" in run["train_text"]
    # the finished run, rerun: it resumes from the newest (its moments included) and has nothing left to do; what a
    # kill inside a prune leaves (a renamed, half-deleted checkpoint) goes, though the rerun writes no checkpoint
    (out / rundir.CHECKPOINTS / ".trash-step-00000001-99" / "resume").mkdir(parents=True)
    old = os.umask(0o022)  # as the pipeline's (the modes test may run after this)
    try:
        rc, answer, err = _cli(["train", "--target", str(run["target"]), "--data", str(run["store"]), "--out",
                                str(out), "--steps", str(STEPS), "--save-every", "1", "--batch-size", "2",
                                "--ttt-steps", "2", "--device", "cpu", "--json"])
    finally:
        os.umask(old)
    assert rc == 0 and json.loads(answer)["resumed_from_step"] == STEPS, err
    assert "weights only" not in err
    assert sorted(os.listdir(out / rundir.CHECKPOINTS)) == ["step-00000002", "step-00000003", "step-00000004"]


def test_launch_lines_name_the_target_directory(run):
    target = str(run["target"].absolute())
    for fmt in FORMAT_ENGINE:
        launch = run[f"launch-{fmt}"]["launch"]
        assert launch and run[f"launch-{fmt}"]["served_target"] == target
        for engine, line in launch.items():
            assert f" {target} " in line and "<TARGET>" not in line, (fmt, engine, line)


@pytest.mark.parametrize("fmt", list(FORMAT_ENGINE))
def test_check_is_clean_on_each_export_for_its_engine(run, fmt):
    engine = FORMAT_ENGINE[fmt]
    rc, out, err = _cli(["check", str(run[f"export-{fmt}"]), "--target", str(run["target"]), "--engine", engine,
                         "--json"])
    r = json.loads(out)
    assert rc == 0 and r["verdict"] == "compatible", err
    assert r["engine_verdicts"] == {engine: "compatible"}
    assert [f for f in r["findings"] if f["severity"] in ("warning", "error")] == []


def test_check_is_clean_on_the_trained_drafter_for_both_engines(run):
    """train writes its drafter with the aux ids where each engine reads them (SGLang: eagle_config; vLLM: the
    top level), so each feeds the layers trained; with SGLang's ids only, vLLM would take its default layers."""
    final = run["train"] / "final"
    cfg = json.loads((final / "config.json").read_text())
    trained = cfg["draftport"]["trained_layers"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == trained  # vLLM's ids are the layers themselves
    rc, out, err = _cli(["check", str(final), "--target", str(run["target"]), "--json"])
    r = json.loads(out)
    assert rc == 0 and r["engine_verdicts"] == {"sglang": "compatible", "vllm": "compatible"}, err
    assert [f for f in r["findings"] if f["severity"] in ("warning", "error")] == []
    assert r["capture_layers"] == {"sglang": trained, "vllm": trained}


@pytest.mark.slow
def test_launch_lines_of_the_embedded_default_name_its_converted_directory(tmp_path):
    """`gemma-3-270m` is no model id an engine resolves: the launch lines name the HF directory draftport
    converts its GGUF into (in the cache), which holds what an engine loads."""
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import save_drafter
    from draftport.model.gguf import embedded_default_dir
    from draftport.model.target import tiny_config

    src = tmp_path / "src"
    spec = {**tiny_config("llama").to_dict(), "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
            "draftport": {"trained_layers": [2, 9, 15], "target_architecture": "Gemma3ForCausalLM",
                          "target_model_type": "gemma3_text", "target_num_layers": 18, "target_path": "gemma-3-270m"}}
    save_drafter(Eagle3Drafter.from_config(spec, seed=0), src, format="sglang")
    rc, out, err = _cli(["export", str(src), "--format", "sglang", "--out", str(tmp_path / "x"), "--json"])
    assert rc == 0, err
    payload = json.loads(out)
    served = embedded_default_dir()
    assert payload["served_target"] == served and os.path.isfile(os.path.join(served, "config.json"))
    assert any(n.endswith(".safetensors") for n in os.listdir(served))
    assert f"--model-path {served} " in payload["launch"]["sglang"] and "gemma-3-270m " not in payload["launch"]["sglang"]
    assert any(served in note for note in payload["notes"])
