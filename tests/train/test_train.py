"""draftport train: TTT learns on a tiny target, checkpoints load in SGLang layout, killed-and-resumed
== uninterrupted (bitwise, CPU), 2 gloo ranks == 1 process, warm starts keep the vocab mapping."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file

from draftport import cli
from draftport.capture.capture import CaptureConfig, run_capture
from draftport.data.store import Store
from draftport.errors import DraftportError
from draftport.train.config import TrainConfig
from draftport.train.loop import lr_at, run_train
from draftport.model.formats import load_drafter, save_drafter

QUIET = Console(stderr=True, quiet=True)
PHRASE = "the robot paints a quiet town by the sea every morning".split()
TARGET = "tiny-gemma3"  # its sliding window makes its next token learnable from a few dozen samples


def write_cyclic(path, n: int, seed: int = 0) -> str:
    """n conversations whose answers cycle through one phrase from a random offset."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            off = int(rng.integers(len(PHRASE)))
            words = [PHRASE[(off + j) % len(PHRASE)] for j in range(int(rng.integers(20, 40)))]
            msgs = [{"role": "user", "content": " ".join(rng.choice(PHRASE, 3))},
                    {"role": "assistant", "content": " ".join(words)}]
            f.write(json.dumps({"id": str(i), "messages": msgs}) + "\n")
    return str(path)



@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("train")
    data = write_cyclic(d / "cyc.jsonl", 80)
    run_capture(CaptureConfig(target=TARGET, data=data, out=str(d / "store")), console=QUIET)
    return str(d / "store")


def _cfg(store, out, **kw) -> TrainConfig:
    base = dict(target=TARGET, data=store, out=str(out), batch_size=8, ttt_steps=4, steps=4, lr=5e-3, device="cpu")
    return TrainConfig(**{**base, **kw})


def test_lr_schedule_warmup_then_cosine_to_ten_percent():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lr_at(100, 100, 1.0, 10) == pytest.approx(0.1)


def test_capture_then_train_lowers_loss_and_raises_tau(store, tmp_path):
    s = run_train(_cfg(store, tmp_path / "run", steps=60, val_fraction=0.2), console=QUIET)
    fresh = s["initial_val"]
    assert s["val_loss"] < fresh["val_loss"] - 2.0
    assert s["val_accept_len"] >= fresh["val_accept_len"] + 0.5, (fresh, s)
    assert s["num_val"] >= 10 and s["mode"] == "offline" and s["steps"] == 60
    # metrics.jsonl: the fresh validation at step 0, then one object per step
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in recs] == list(range(61)) and "val_accept_len" in recs[0]
    assert os.listdir(tmp_path / "run" / "tb")

    # the final checkpoint is an SGLang directory: its weights are the trained ones (bf16), its config
    # records the layers and the target; the resume state sits in resume/ only
    from draftport.model.drafter import Eagle3Drafter

    final, ck = s["final_drafter"], s["checkpoint"]
    assert final == str(tmp_path / "run" / "final") and ck.endswith("step-00000060")
    assert sorted(os.listdir(final)) == ["config.json", "model.safetensors"]
    assert sorted(os.listdir(ck)) == ["config.json", "model.safetensors", "resume"]
    cfg = json.load(open(os.path.join(final, "config.json")))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["draftport"]["trained_layers"] == [2, 4, 5] and cfg["draftport"]["target_architecture"] == "Gemma3ForCausalLM"
    loaded = load_drafter(final)[0]
    master = load_file(os.path.join(ck, "resume", "state.safetensors"))
    for name, t in loaded.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(t, master[f"model.drafter.{name}"].to(t.dtype)), name
    assert int(loaded.t2d.sum()) == 512 and loaded.load_report.missing == []


def test_online_mode_matches_offline_store(store, tmp_path):
    """Conversations with the target in the loop give the same run as its capture store (which keeps
    the hidden states in bf16, hence the tolerance)."""
    data = os.path.join(os.path.dirname(store), "cyc.jsonl")
    on = run_train(_cfg(data, tmp_path / "online", steps=2), console=QUIET)
    off = run_train(_cfg(store, tmp_path / "offline", steps=2), console=QUIET)
    assert on["mode"] == "online" and off["mode"] == "offline"
    assert on["num_train"] == off["num_train"]
    assert on["initial_val"]["val_loss"] == pytest.approx(off["initial_val"]["val_loss"], rel=1e-3)
    assert on["final_loss"] == pytest.approx(off["final_loss"], rel=2e-2)


def test_fp8_store_trains_the_bf16_stores_curve(store, tmp_path):
    """A drafter trained from the fp8 store of the same data takes the bf16 store's loss curve, step for step: the
    e4m3 rounding (at most 2^-4 of an element, data/store.py) moves each loss by under 0.5 % (measured: 0.1 %)
    and by under 5 % of the largest change one step makes (measured 2 %). The offline τ of one drafter on either
    store (what `eval --store` reports) agrees within 0.05: the target's next token is the head's argmax on the
    stored final state, and on this random target, whose top two logits lie within 0.05 at 5 % of positions, the
    fp8 state moves that argmax at about 4 % of them (Gemma-3-270M: 2 %, BENCHMARKS.md "The fp8 store")."""
    from draftport.decode.offline import offline_accept_len
    from draftport.model.target import load_target

    data = os.path.join(os.path.dirname(store), "cyc.jsonl")
    fp8 = str(tmp_path / "fp8")
    run_capture(CaptureConfig(target=TARGET, data=data, out=fp8, store_dtype="fp8"), console=QUIET)
    curves, runs = {}, {}
    for name, path in (("bf16", store), ("fp8", fp8)):
        runs[name] = run_train(_cfg(path, tmp_path / name, steps=10, val_fraction=0.2, val_every=0), console=QUIET)
        curves[name] = np.array([json.loads(line)["loss"] for line in open(tmp_path / name / "metrics.jsonl")
                                 if '"loss"' in line])
    ref, ours = curves["bf16"], curves["fp8"]
    assert len(ref) == len(ours) == 10 and ref[-1] < ref[0] - 2.0  # it learns: the curve is not flat
    assert not np.array_equal(ours, ref)  # the fp8 states are not the bf16 ones
    np.testing.assert_allclose(ours, ref, rtol=5e-3)
    assert np.abs(ours - ref).max() < 0.05 * np.abs(np.diff(ref)).max()
    assert runs["fp8"]["val_loss"] == pytest.approx(runs["bf16"]["val_loss"], rel=5e-3)
    drafter = load_drafter(runs["bf16"]["final_drafter"])[0].float()
    target = load_target(TARGET, device="cpu")
    drafter.set_embedding(target.embed_weight)
    tau = {name: offline_accept_len(drafter, path, target=target, depth=3, max_samples=40)["accept_len"]
           for name, path in (("bf16", store), ("fp8", fp8))}
    assert tau["bf16"] > 1.2 and tau["fp8"] == pytest.approx(tau["bf16"], abs=0.05), tau
    a, b = Store(store), Store(fp8)
    same = [target.logits(a[i]["last_hidden"].float()).argmax(-1) == target.logits(b[i]["last_hidden"].float()).argmax(-1)
            for i in range(40)]
    assert 0.9 < float(torch.cat(same).float().mean()) < 1.0


def test_rerun_resumes_refuses_other_flags_and_restart_starts_over(store, tmp_path, capsys):
    out = tmp_path / "run"
    first = run_train(_cfg(store, out, steps=3, save_every=2), console=QUIET)
    assert first["resumed_from_step"] == 0
    again = run_train(_cfg(store, out, steps=3, save_every=2), console=QUIET)  # finished: nothing to do
    assert again["resumed_from_step"] == 3 and again["final_loss"] == first["final_loss"]
    with pytest.raises(DraftportError, match="other settings .*lr") as exc:
        run_train(_cfg(store, out, steps=3, lr=1e-3), console=QUIET)
    assert "\n" not in str(exc.value) and "--restart" in str(exc.value)
    rc = cli.main(["train", "--target", TARGET, "--data", store, "--out", str(out), "--steps", "3",
                   "--batch-size", "8", "--ttt-steps", "4", "--lr", "0.001", "--device", "cpu", "--restart", "--json"])
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and got["resumed_from_step"] == 0 and got["steps"] == 3


def test_group_by_length_fills_batches_and_is_part_of_the_run(tmp_path):
    """--group-by-length: batches of similar lengths (the summary's batch fill rises), the same samples seen;
    a setting of the run (a rerun with another value is refused, as any weight-deciding flag)."""
    data = write_cyclic(tmp_path / "mixed.jsonl", 64, seed=3)
    rows = [json.loads(line) for line in open(data)]
    for i, r in enumerate(rows):  # a chat-like mix: a few long answers among short ones
        if i % 8 == 0:
            r["messages"][1]["content"] = " ".join([r["messages"][1]["content"]] * 6)
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    kw = dict(steps=6, batch_size=8, max_len=512)
    plain = run_train(_cfg(data, tmp_path / "plain", **kw), console=QUIET)
    grouped = run_train(_cfg(data, tmp_path / "grouped", group_by_length=4, **kw), console=QUIET)
    assert plain["group_by_length"] == 0 and grouped["group_by_length"] == 4
    assert plain["batch_fill"] < 0.6 < grouped["batch_fill"] <= 1.0
    with pytest.raises(DraftportError, match="group_by_length"):
        run_train(_cfg(data, tmp_path / "grouped", group_by_length=8, **kw), console=QUIET)
    with pytest.raises(DraftportError, match="group-by-length"):
        TrainConfig(target=TARGET, data=data, group_by_length=-1).resolved("cpu")


def test_train_regenerate_equals_training_on_the_regenerated_file(store, tmp_path, monkeypatch):
    """--regenerate: the target answers the prompts first (batch engine, two sampled answers a prompt),
    then the run trains online on <out>/regenerated.jsonl, exactly as if that file were --data; a rerun
    reuses the saved answers; a capture store cannot be regenerated."""
    import draftport.capture.regenerate as regen_mod

    data = os.path.join(os.path.dirname(store), "cyc.jsonl")
    kw = dict(regenerate=True, samples_per_prompt=2, temperature=0.8, max_new_tokens=24, regen_batch_size=16,
              max_samples=20, steps=2)
    out = tmp_path / "regen"
    got = run_train(_cfg(data, out, **kw), console=QUIET)
    regen = out / "regenerated.jsonl"
    rows = [json.loads(line) for line in regen.read_text().splitlines()]
    assert len(rows) > 20 and {r["id"].split("#")[1] for r in rows} == {"0", "1"}  # 20 prompts × 2 samples
    ref = run_train(_cfg(str(regen), tmp_path / "plain", steps=2), console=QUIET)
    assert got["num_train"] == ref["num_train"] and got["final_loss"] == ref["final_loss"]

    def no_regeneration(*a, **k):
        raise AssertionError("a rerun must reuse the saved answers")

    monkeypatch.setattr(regen_mod, "regenerate", no_regeneration)
    again = run_train(_cfg(data, out, **{**kw, "steps": 3}, restart=True), console=QUIET)
    assert again["num_train"] == got["num_train"]
    with pytest.raises(DraftportError, match="not a capture store"):
        run_train(_cfg(store, tmp_path / "bad", **kw), console=QUIET)


def test_store_layers_must_match_the_drafter(store, tmp_path):
    with pytest.raises(DraftportError, match=r"aux layers \[2, 4, 5\] but the drafter is fed \[1, 3, 5\]"):
        run_train(_cfg(store, tmp_path / "run", aux_layers=[1, 3, 5]), console=QUIET)


def _sglang_drafter(tmp_path, store, seed=3):
    """An SGLang-layout drafter for the tiny target with a non-trivial vocab mapping (Vd = 64)."""
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.target import tiny_target
    from draftport.train.warm_start import drafter_config

    tg = tiny_target("gemma3")
    d = Eagle3Drafter.from_config(drafter_config(tg, [2, 4, 5], tg.vocab_size, 64), seed=seed)
    used = torch.sort(torch.randperm(tg.vocab_size, generator=torch.Generator().manual_seed(seed))[:64]).values
    t2d = torch.zeros(tg.vocab_size, dtype=torch.bool)
    t2d[used] = True
    d.set_vocab_mapping(used - torch.arange(64), t2d)
    save_drafter(d, tmp_path / "init", format="sglang", target=tg.spec, layers=[2, 4, 5])
    return str(tmp_path / "init"), d


def test_warm_start_keeps_vocab_mapping_and_lm_head_rows(store, tmp_path):
    init, d0 = _sglang_drafter(tmp_path, store)
    s = run_train(_cfg(store, tmp_path / "ft", init_from=init, steps=2, lr=1e-4), console=QUIET)
    assert s["vocab"]["vocab"].startswith("kept") and s["draft_vocab_size"] == 64
    w = load_file(os.path.join(s["checkpoint"], "resume", "state.safetensors"))
    assert torch.equal(w["model.drafter.d2t"], d0.d2t) and torch.equal(w["model.drafter.t2d"], d0.t2d)
    old = d0.lm_head.weight.detach()
    new = w["model.drafter.lm_head.weight"]
    assert (new - old).abs().max() < 2 * 2 * 1e-4  # two Adam steps of lr 1e-4 move no weight further
    # each row stayed with its token: row i is nearest to its own old row
    assert torch.equal(torch.cdist(new, old).argmin(1), torch.arange(64))

    # a new mapping only on request, and then each kept token keeps its row
    with pytest.raises(DraftportError, match="--remap-vocab"):
        run_train(_cfg(store, tmp_path / "bad", init_from=init, draft_vocab_size=128), console=QUIET)
    r = run_train(_cfg(store, tmp_path / "remap", init_from=init, remap_vocab=True, draft_vocab_size=128,
                       steps=1, lr=1e-6), console=QUIET)
    w = load_file(os.path.join(r["checkpoint"], "resume", "state.safetensors"))
    used_new = torch.arange(128) + w["model.drafter.d2t"]
    used_old = torch.arange(64) + d0.d2t
    for row_old, tok in enumerate(used_old.tolist()):
        hit = (used_new == tok).nonzero()
        if len(hit):
            torch.testing.assert_close(w["model.drafter.lm_head.weight"][hit[0, 0]], old[row_old], atol=1e-5, rtol=0)
    assert r["vocab"]["vocab"].startswith("new mapping")


def test_lm_head_from_target_starts_at_the_target_head_rows(store, tmp_path):
    from draftport.cli import build_parser, config_from_args

    args = build_parser().parse_args(["train", "--target", TARGET, "--data", store, "--lm-head-from-target"])
    assert config_from_args(TrainConfig, args).lm_head_from_target
    # a negligible lr (one Adam step moves a weight by ~lr): the saved head is the initial one; each draft row is the target head's row of its token
    s = run_train(_cfg(store, tmp_path / "head", lm_head_from_target=True, steps=1, lr=1e-9), console=QUIET)
    w = load_file(os.path.join(s["checkpoint"], "resume", "state.safetensors"))
    from draftport.model.target import TINY_TARGETS
    from draftport.model.target import tiny_target

    head = tiny_target(TINY_TARGETS[TARGET], seed=0, device="cpu", dtype="fp32").lm_head_weight.detach().float()
    ids = torch.arange(w["model.drafter.d2t"].numel()) + w["model.drafter.d2t"]
    torch.testing.assert_close(w["model.drafter.lm_head.weight"], head[ids], atol=1e-6, rtol=0)
    plain = run_train(_cfg(store, tmp_path / "plain", steps=1, lr=1e-9), console=QUIET)
    w0 = load_file(os.path.join(plain["checkpoint"], "resume", "state.safetensors"))
    assert not torch.allclose(w0["model.drafter.lm_head.weight"], head[ids])


# ---------------------------------------------------------------------------------------------
# subprocess runs: the CLI, SIGKILL + rerun, torchrun


def _train_cmd(store, out, *extra):
    return [sys.executable, "-m", "draftport", "train", "--target", TARGET, "--data", store, "--out", str(out),
            "--steps", "8", "--batch-size", "4", "--ttt-steps", "3", "--lr", "0.005", "--device", "cpu",
            "--save-every", "2", *extra]


def _env(**kw):
    return dict(os.environ, OMP_NUM_THREADS="1", **kw)


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_equals_uninterrupted(store, tmp_path):
    ref = subprocess.run(_train_cmd(store, tmp_path / "ref"), env=_env(), capture_output=True, text=True, timeout=600)
    assert ref.returncode == 0, ref.stderr[-2000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(store, out), env=_env(DRAFTPORT_TEST_SLOW_STEP_S="1.0"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = out / "checkpoints" / "step-00000004"
    deadline = time.time() + 300
    while not first.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert first.exists() and not (out / "checkpoints" / "step-00000008").exists()
    again = subprocess.run(_train_cmd(store, out, "--json"), env=_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["resumed_from_step"] in (4, 6)
    a, b = ({k: v for name in ("state", "optimizer") for k, v in
             load_file(str(run / f"checkpoints/step-00000008/resume/{name}.safetensors")).items()}
            for run in (tmp_path / "ref", out))  # the newest checkpoint: it holds the optimizer's moments too
    assert a.keys() == b.keys() and any(k.startswith("optim.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k  # model, optimizer moments and RNG, bitwise
    la = [json.loads(x) for x in open(tmp_path / "ref/metrics.jsonl")]
    lb = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert la == lb or [r["step"] for r in la] == [r["step"] for r in lb]
    assert [r["loss"] for r in la[1:]] == [r["loss"] for r in lb[1:]]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000004", "step-00000006", "step-00000008"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--aux-scale",)], ids=["plain", "aux-scale"])
def test_torchrun_two_gloo_ranks_equal_one_process(store, tmp_path, extra):
    # --aux-scale: each rank computes the constant from the same global first batch, so the ranks agree
    one = subprocess.run(_train_cmd(store, tmp_path / "one", "--steps", "3", *extra), env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "-m", *_train_cmd(store, tmp_path / "two", "--steps", "3", *extra)[2:]],
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    ma = [json.loads(x) for x in open(tmp_path / "one/metrics.jsonl")]
    mb = [json.loads(x) for x in open(tmp_path / "two/metrics.jsonl")]
    # same global batch of 4 (2 per rank): same first-step loss, to fp32 summation-order noise
    assert mb[1]["loss"] == pytest.approx(ma[1]["loss"], rel=1e-5)
    a = load_file(str(tmp_path / "one/checkpoints/step-00000003/resume/state.safetensors"))
    b = load_file(str(tmp_path / "two/checkpoints/step-00000003/resume/state.safetensors"))
    for k in a:
        if k.startswith("model."):
            # three Adam steps of lr 5e-3: Adam divides by √v, so summation-order noise in a gradient
            # near zero can move that one weight by a visible fraction of lr, while the rest agree to fp32
            # rounding. Bound the worst weight loosely and the typical one tightly.
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-4)
            assert (b[k].double() - a[k].double()).abs().mean() < 1e-6, k
    assert "rng.rank1.cpu" in b and json.load(open(tmp_path / "two/summary.json"))["world_size"] == 2
    assert ("model.aux_inv_scale" in b) == bool(extra)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [128, 200])
def test_flex_ttt_attention_equals_eager_on_cuda(T):
    """The fused step-0 kernel + closed-form diagonal == drafter.ttt_attention, values and gradients."""
    from draftport.model.drafter import ttt_attention
    from draftport.train.ttt import flex_ttt_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    B, Hq, Hkv, D, steps = 2, 8, 2, 64, 4
    q = torch.randn(B, Hq, T, D, device="cuda", generator=g, requires_grad=True)
    ks = [torch.randn(B, Hkv, T, D, device="cuda", generator=g, requires_grad=True) for _ in range(steps)]
    vs = [torch.randn(B, Hkv, T, D, device="cuda", generator=g, requires_grad=True) for _ in range(steps)]
    for n in (1, steps):
        ref = ttt_attention(q, ks[:n], vs[:n])
        got = flex_ttt_attention(q, ks[:n], vs[:n])
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        w = torch.randn_like(ref)
        gr = torch.autograd.grad((ref * w).sum(), [q, *ks[:n], *vs[:n]])
        gg = torch.autograd.grad((got * w).sum(), [q, *ks[:n], *vs[:n]])
        for a, b in zip(gg, gr):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
def test_flex_training_step_equals_eager_on_cuda(store, tmp_path):
    """Two steps with attention=flex give the eager trainer's losses and weights (fp32 on CUDA)."""
    runs = {a: run_train(_cfg(store, tmp_path / a, steps=2, device="cuda", dtype="fp32", attention=a), console=QUIET)
            for a in ("eager", "flex")}
    assert runs["flex"]["final_loss"] == pytest.approx(runs["eager"]["final_loss"], rel=1e-4)
    a = load_file(os.path.join(runs["eager"]["checkpoint"], "resume", "state.safetensors"))
    b = load_file(os.path.join(runs["flex"]["checkpoint"], "resume", "state.safetensors"))
    for key in a:
        if key.startswith("model."):
            torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_gemma_270m_sharegpt_capture_then_train_learns(gemma_target, tmp_path):
    """The real target on 32 ShareGPT conversations (128 tokens each), 24 steps on the CPU (a slow test).
    A fresh drafter scores τ = 1.0; this short run gains only a little τ and step-0 accuracy, hence the low
    bars (the +0.5 τ of the tiny test needs far more data and steps than a CPU test can afford)."""
    run_capture(CaptureConfig(target="gemma-3-270m", data="sharegpt", out=str(tmp_path / "store"), max_samples=32,
                              max_len=128, device="cpu", dtype="fp32"), target=gemma_target, console=QUIET)
    s = run_train(TrainConfig(target="gemma-3-270m", data=str(tmp_path / "store"), out=str(tmp_path / "run"),
                              steps=24, batch_size=2, ttt_steps=3, draft_vocab_size=4096, lr=3e-3, val_fraction=0.15,
                              device="cpu", dtype="fp32"), target=gemma_target, console=QUIET)
    fresh = s["initial_val"]
    assert s["val_loss"] < fresh["val_loss"] - 4.0, (fresh, s)
    assert s["val_accept_len"] >= fresh["val_accept_len"] + 0.1 and s["val_acc"][0] > 0.1, (fresh, s)
    cfg = json.load(open(os.path.join(s["final_drafter"], "config.json")))
    assert cfg["draftport"]["trained_layers"] == [2, 9, 15] and cfg["draft_vocab_size"] == 4096
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 8, 14]


# ---------------------------------------------------------------------------------------------
# golden: SpecForge v0.2.0's own TTT (recorded once, its code not in this repository)

GOLDEN_CFG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
              "num_hidden_layers": 1, "vocab_size": 50, "draft_vocab_size": 20, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": False}


def golden_case(**overrides):
    """The inputs the golden numbers were recorded on: a drafter with sharpened random weights and a
    random vocab map, aux states, step-0 token ids, target logits and loss mask (already shifted).
    overrides: config keys changed from GOLDEN_CFG (other layouts; not the golden numbers' drafter)."""
    from draftport.model.drafter import Eagle3Drafter

    g = torch.Generator().manual_seed(1234)
    B, T, H, V, Vd = 2, 12, 32, 50, 20
    d = Eagle3Drafter.from_config({**GOLDEN_CFG, **overrides}, seed=7)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if p.dim() == 2 and n != "embed_tokens.weight":
                p.mul_(8.0)  # sharper than the 0.02 init, so the losses are far from log(Vd)
    used = torch.sort(torch.randperm(V, generator=g)[:Vd]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    d.set_vocab_mapping(used - torch.arange(Vd), t2d)
    d.set_embedding(torch.randn(V, H, generator=g) * 0.5)
    aux = torch.randn(B, T, 3 * H, generator=g)
    ids0 = torch.randint(0, V, (B, T), generator=g)
    target = torch.randn(B, T, V, generator=g) * 3.0
    mask0 = torch.rand(B, T, generator=g) > 0.2
    return d, aux, ids0, target, mask0


def test_ttt_losses_and_logits_equal_specforge_v020():
    """Same weights and step-0 inputs (SpecForge's preprocessed input_ids / target / loss_mask) →
    SpecForge v0.2.0's OnlineEagle3Model (flex_attention backend: RoPE position t + i at step i, run
    eagerly on the CPU, loss = its reference `_compute_loss`) gave these per-step losses, accuracies
    and logits. Its loss is a masked sum over all B·T positions, so the counts passed are B·T."""
    import torch.nn.functional as F

    from draftport.model.kvcache import TTTCache
    from draftport.train.losses import shift_left
    from draftport.train.ttt import TTTModel

    gold = json.load(open(os.path.join(os.path.dirname(__file__), "golden_specforge_ttt.json")))
    d, aux, ids0, target, mask0 = golden_case()
    assert float(aux.sum() + target.sum() + ids0.sum() + mask0.sum()) == pytest.approx(gold["input_checksum"], rel=1e-6)
    k, (B, T) = gold["ttt_steps"], ids0.shape
    used = torch.nonzero(d.t2d).reshape(-1)
    with torch.no_grad():
        _, stats, _, _ = TTTModel(d, k, 8)(aux, ids0, mask0, F.pad(target[..., used], (0, 0, 0, k)),
                                           target.argmax(-1), torch.full((k,), B * T))
        assert stats[0].tolist() == pytest.approx(gold["losses"], rel=1e-5)
        assert (stats[1] / mask0.sum()).tolist() == pytest.approx(gold["acc"], abs=1e-6)
        cache, hidden = TTTCache.empty(d.num_layers), d.project(aux)
        for i in range(k):
            hidden, logits = d.step(hidden, shift_left(ids0, i), torch.arange(T) + i, cache)
            torch.testing.assert_close(logits[0, :T - i], torch.tensor(gold["logits"][i]), rtol=0, atol=1e-5)


def _old_ttt_forward(d, k, aux, ids0, mask0, target0, argmax0, counts, chunk):
    """The trainer's step with lm_head outside the loss (the unfused reference): [B, T, Vd] logits from
    drafter.step, soft_ce_chunked over draft-vocab chunks, rescaled from the local to the global count."""
    from draftport.model.kvcache import TTTCache
    from draftport.train.losses import position_valid, shift_left, soft_ce_chunked, step_accuracy

    B, T = ids0.shape
    cache, hidden = TTTCache.empty(d.num_layers), d.project(aux)
    cols = torch.arange(target0.shape[-1])
    loss, stats, hits_all = 0.0, [], []
    for i in range(k):
        ids_i, mask_i, am_i = shift_left(ids0, i), shift_left(mask0, i), shift_left(argmax0, i)
        valid = position_valid(mask_i, am_i, d.t2d)
        hidden, logits = d.step(hidden, ids_i, torch.arange(T) + i, cache)
        ce = soft_ce_chunked(logits, target0[:, i:i + T], cols, valid, chunk)
        li = ce * (valid.sum().clamp_min(1) / counts[i].clamp_min(1))
        loss = loss + 0.8 ** i * li
        hits = step_accuracy(logits, None, d.d2t, mask_i, target_argmax=am_i)
        stats.append(torch.stack([li.detach(), hits.sum().float(), mask_i.sum().float()]))
        hits_all.append(hits)
    return loss, torch.stack(stats, 1), hits_all


@pytest.mark.parametrize("norm_output", [False, True])
def test_fused_lm_head_loss_equals_the_logits_path(norm_output):
    """TTTModel (lm_head fused into the soft CE, row chunks of 5 that straddle the two samples) gives
    the loss, per-step stats, hits and every parameter gradient of the logits-then-loss path."""
    import torch.nn.functional as F

    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.kvcache import TTTCache
    from draftport.train.losses import shift_left
    from draftport.train.ttt import TTTModel

    d, aux, ids0, target, mask0 = golden_case()
    if norm_output:  # EAGLE-3.1: the step output is normed already; otherwise lm_head reads norm(out)
        d31 = Eagle3Drafter.from_config({**GOLDEN_CFG, "norm_output": True}, seed=7)
        d31.load_state_dict(d.state_dict())
        d31.set_embedding(d.embed_tokens.weight)
        d = d31
    assert d.spec.norm_output is norm_output
    k, (B, T) = 4, ids0.shape
    used = torch.nonzero(d.t2d).reshape(-1)
    with torch.no_grad():  # plant hits: target row r peaks at step (r mod k)'s draft at position r − i
        cache, hidden, drafted = TTTCache.empty(d.num_layers), d.project(aux), []
        for i in range(k):
            hidden, logits = d.step(hidden, shift_left(ids0, i), torch.arange(T) + i, cache)
            drafted.append(d.to_target_ids(logits.argmax(-1)))
        for r in range(T):
            i = r % k
            if r - i >= 0 and r % 2 == 0:
                target[torch.arange(B), r, drafted[i][:, r - i]] += 30.0
    target0 = F.pad(target[..., used], (0, 0, 0, k))
    argmax0 = target.argmax(-1)
    counts = torch.tensor([29, 27, 25, 23])  # global counts, as another rank's positions would add
    names, params = zip(*[(n, p) for n, p in d.named_parameters() if p.requires_grad])

    loss, stats, hits, _ = TTTModel(d, k, 5)(aux, ids0, mask0, target0, argmax0, counts, with_hits=True)
    grads = torch.autograd.grad(loss, params)
    old_loss, old_stats, old_hits = _old_ttt_forward(d, k, aux, ids0, mask0, target0, argmax0, counts, 7)
    old_grads = torch.autograd.grad(old_loss, params)

    assert loss.item() == pytest.approx(old_loss.item(), rel=1e-5) and loss.item() > 1.0
    torch.testing.assert_close(stats, old_stats, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(hits, old_hits)) and sum(int(h.sum()) for h in hits) > 0
    for name, g, og in zip(names, grads, old_grads):
        assert og.abs().max() > 0, name
        torch.testing.assert_close(g, og, rtol=1e-4, atol=1e-6 * og.abs().max().item(), msg=name)


def test_layer_regions_equal_eager_for_other_layouts():
    """The layer regions (ttt_layer_in / _out, weights passed in) on the layouts the golden drafter lacks:
    two decoder layers (the second a plain pre-norm layer), EAGLE-3.1's norm_output, speculators'
    norm_before_residual, attention and MLP biases — loss, stats and every gradient equal the modules'."""
    import torch.nn.functional as F

    from draftport.model.fusion import compile_failures
    from draftport.train.ttt import TTTModel

    d, aux, ids0, target, mask0 = golden_case(num_hidden_layers=2, norm_output=True, norm_before_residual=True,
                                              attention_bias=True, mlp_bias=True)
    assert d.num_layers == 2 and d.spec.norm_output and d.spec.norm_before_residual
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if n.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    k = 3
    used = torch.nonzero(d.t2d).reshape(-1)
    inputs = (aux, ids0, mask0, F.pad(target[..., used], (0, 0, 0, k)), target.argmax(-1), torch.tensor([20, 18, 16]))
    params = [p for p in d.parameters() if p.requires_grad]
    runs = []
    for compile in (False, True):
        loss, stats, _, _ = TTTModel(d, k, 5, compile=compile, regions="layer")(*inputs)
        runs.append((loss, stats, torch.autograd.grad(loss, params)))
    (loss, stats, grads), (c_loss, c_stats, c_grads) = runs
    assert not compile_failures()
    assert c_loss.item() == pytest.approx(loss.item(), rel=1e-6) and loss.item() > 1.0
    torch.testing.assert_close(c_stats, stats, rtol=1e-6, atol=1e-6)
    for a, b in zip(c_grads, grads):
        assert b.abs().max() > 0
        # fp32 sums reordered through two layers: a few 1e-8 on biases whose gradients are ~1e-3
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


def test_compiled_flex_merge_equals_ttt_attention():
    """ttt_diagonal_merge compiled (flex_ttt_attention(compiled=True)'s merge; flex itself has no CPU
    backward, so the step-0 causal part and its log-sum-exp come from a plain attention here) equals
    drafter.ttt_attention over all steps' keys: values and the gradients of q and every key and value."""
    from draftport.model.drafter import ttt_attention
    from draftport.model.fusion import compile_failures, compiled
    from draftport.train.ttt import ttt_diagonal_merge

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, T, D, n = 2, 4, 2, 8, 16, 3
    q = torch.randn(B, Hq, T, D, generator=g, requires_grad=True)
    ks = [torch.randn(B, Hkv, T, D, generator=g, requires_grad=True) for _ in range(n)]
    vs = [torch.randn(B, Hkv, T, D, generator=g, requires_grad=True) for _ in range(n)]
    s = (q.view(B, Hkv, Hq // Hkv, T, D) @ ks[0].unsqueeze(2).transpose(-1, -2)) * D ** -0.5
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out0 = (s.softmax(-1) @ vs[0].unsqueeze(2)).reshape(B, Hq, T, D)
    got = compiled(ttt_diagonal_merge, dynamic=None)(out0, s.logsumexp(-1).reshape(B, Hq, T), q,
                                                     torch.stack(ks[1:]), torch.stack(vs[1:]))
    ref = ttt_attention(q, ks, vs)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    inputs = [q, *ks, *vs]
    for a, b in zip(torch.autograd.grad((got * w).sum(), inputs), torch.autograd.grad((ref * w).sum(), inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not compile_failures()


def test_compiled_ttt_step_equals_eager():
    """TTTModel(compile=True) — each layer as two compiled regions around the attention (weights passed
    in, cast once), or the modules with compiled norms, RoPE and act·up; the loss math compiled; with
    and without activation checkpointing (the recompute replays the compiled forward) — gives the eager
    model's loss, stats, hits and parameter gradients, and leaves the state_dict's keys as they were."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from draftport.model.fusion import compile_failures
    from draftport.train.ttt import TTTModel, enable_activation_checkpointing

    d, aux, ids0, target, mask0 = golden_case()
    k, keys = 3, list(d.state_dict())
    used = torch.nonzero(d.t2d).reshape(-1)
    inputs = (aux, ids0, mask0, F.pad(target[..., used], (0, 0, 0, k)), target.argmax(-1), torch.tensor([20, 18, 16]))
    params = [p for p in d.parameters() if p.requires_grad]
    (loss, stats, hits, _) = TTTModel(d, k, 5)(*inputs, with_hits=True)
    grads = torch.autograd.grad(loss, params)
    # each layer as two regions (the default), with and without checkpointing; the modules' norms etc.
    frames = counters["frames"]["ok"]
    for regions, checkpointing in (("layer", False), ("layer", True), ("elementwise", True)):
        if checkpointing:
            enable_activation_checkpointing(d)
        c_loss, c_stats, c_hits, _ = TTTModel(d, k, 5, compile=True, regions=regions)(*inputs, with_hits=True)
        c_grads = torch.autograd.grad(c_loss, params)
        assert counters["frames"]["ok"] > frames and not compile_failures(), "the compiled path did not run"
        assert c_loss.item() == pytest.approx(loss.item(), rel=1e-6) and loss.item() > 1.0
        torch.testing.assert_close(c_stats, stats, rtol=1e-6, atol=1e-6)
        assert all(torch.equal(a, b) for a, b in zip(c_hits, hits))
        for a, b in zip(c_grads, grads):
            assert b.abs().max() > 0
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item())
    assert list(d.state_dict()) == keys


def test_a_drafter_of_two_decoder_layers_trains_and_saves(store, tmp_path):
    """A warm start from a 2-layer drafter trains, and its checkpoints are written in a layout that holds
    both layers (SGLang's holds one; vLLM's spells the second as layers.1), loading back to the same weights."""
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import load_drafter
    from draftport.model.target import tiny_target
    from draftport.train.warm_start import drafter_config

    tg = tiny_target("gemma3")
    d = Eagle3Drafter.from_config(dict(drafter_config(tg, [2, 4, 5], tg.vocab_size, tg.vocab_size),
                                       num_hidden_layers=2), seed=0)
    save_drafter(d, tmp_path / "init", format="vllm", target=tg.spec, layers=[2, 4, 5])
    s = run_train(_cfg(store, tmp_path / "two", init_from=str(tmp_path / "init"), steps=2), console=QUIET)
    back, report = load_drafter(s["final_drafter"])
    assert back.num_layers == 2 and not report.missing and not report.unexpected
    w = load_file(os.path.join(s["checkpoint"], "resume", "state.safetensors"))
    torch.testing.assert_close(back.additional_layers[0].mlp.down_proj.weight,
                               w["model.drafter.additional_layers.0.mlp.down_proj.weight"].to(back.fc.weight.dtype))
