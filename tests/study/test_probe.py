"""probe: similarity math (streaming == direct), self-similarity 1, a copy perturbed from layer 3 on keeps
early layers at 1 and drops later ones, tokenizer mismatch refused, plug-in τ on its own target == offline τ."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from draftport.errors import DraftportError
from draftport.study.probe import LayerStats, cosine_per_token, linear_cka
from draftport.verbs.probe import ProbeConfig, run_probe
from draftport.model.formats import save_drafter

PERTURB_FROM = 3  # decoder layers >= this are perturbed in target B


def write_convs(path, n=6):
    """A small chat JSONL (messages form) the tiny tokenizer encodes into a few dozen tokens each."""
    topics = ["the capital of France", "a robot who paints", "attention in a transformer", "adding two numbers",
              "the quick brown fox", "counting to ten", "the sea at sunrise", "printing squares"]
    with open(path, "w") as f:
        for i in range(n):
            t = topics[i % len(topics)]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Tell me about {t}, please."},
                {"role": "assistant", "content": f"Here is a short answer about {t}. The quick brown fox jumps "
                                                 f"over the lazy dog {i} times."}]}) + "\n")
    return str(path)


def save_target(t, path):
    t.model.save_pretrained(path)
    t.tokenizer.save_pretrained(path)
    return str(path)



def train_drafter(target_dir: str, data: str, out: str, steps: int = 40, depth: int = 3, max_len: int = 64) -> str:
    """A tiny EAGLE-3 drafter for the target in `target_dir`, trained in seconds (TTT, hard labels = the
    target's argmax) on the conversations in `data`, saved in SGLang layout; returns its directory."""
    from draftport.data.chat import tokenize_conversation
    from draftport.data.conversations import load_conversations
    from draftport.model.target import load_target

    decode_tests = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "decode")
    if decode_tests not in sys.path:  # pytest puts tests/decode on the path only when it collects it too
        sys.path.insert(0, decode_tests)
    from test_offline import train_tiny_drafter

    target = load_target(target_dir, device="cpu", dtype="fp32")
    seqs = [tokenize_conversation(target.tokenizer, c, max_len=max_len)[0].tolist() for c in load_conversations(data)]
    d = train_tiny_drafter(target, seqs, depth=depth, steps=steps, corrupt=0.0)
    save_drafter(d, out, format="sglang", target=target)
    return str(out)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """(dir of tiny llama A, dir of B = A with decoder layers >= PERTURB_FROM perturbed, data JSONL)."""
    from draftport.model.target import tiny_target

    root = tmp_path_factory.mktemp("probe")
    a = tiny_target("llama", seed=0)
    path_a = save_target(a, root / "a")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, layer in enumerate(a.model.model.layers):
            if i >= PERTURB_FROM:
                for p in layer.parameters():
                    if p.dim() == 2:
                        p.add_(torch.randn(p.shape, generator=gen) * p.std() * 0.5)
    path_b = save_target(a, root / "b")
    return path_a, path_b, write_convs(root / "convs.jsonl", n=10)


def test_streaming_layer_stats_equal_the_direct_formulas():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 16, generator=gen, dtype=torch.float64) + 2.0
    y = x @ torch.randn(16, 16, generator=gen, dtype=torch.float64) * 0.3 + torch.randn(300, 16, generator=gen,
                                                                                         dtype=torch.float64)
    st = LayerStats(16, 16)
    for a, b in ((x[:100], y[:100]), (x[100:250], y[100:250]), (x[250:], y[250:])):
        st.update(a, b)
    r = st.result()
    cos = cosine_per_token(x, y).numpy()
    assert r["tokens"] == 300
    assert r["cka"] == pytest.approx(linear_cka(x, y), rel=1e-9)
    assert r["cosine_mean"] == pytest.approx(cos.mean(), rel=1e-12)
    assert r["cosine_p5"] == pytest.approx(np.percentile(cos, 5), rel=1e-12)
    assert r["norm_ratio"] == pytest.approx(float(y.norm(dim=1).mean() / x.norm(dim=1).mean()), rel=1e-12)


def test_cka_sees_through_rotation_and_scale_cosine_does_not():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=gen, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(12, 12, generator=gen, dtype=torch.float64))
    assert linear_cka(x, 3.0 * x @ q) == pytest.approx(1.0, abs=1e-10)
    assert float(cosine_per_token(x, x @ q).mean()) < 0.9
    assert linear_cka(x, torch.randn(200, 12, generator=gen, dtype=torch.float64)) < 0.3


def test_target_against_itself_is_identical(targets, tmp_path):
    a, _, data = targets
    s = run_probe(ProbeConfig(target_a=a, target_b=a, data=data, out=str(tmp_path / "self"), device="cpu"))
    assert s["tokenizer_identical"] and s["tokens_compared"] > 100
    assert list(s["similarity"]) == ["2", "4", "5"]  # the default [2, L//2, L-3] of an 8-layer target
    for layer, v in s["similarity"].items():
        assert v["cosine_mean"] == pytest.approx(1.0, abs=1e-6), layer
        assert v["cosine_p5"] == pytest.approx(1.0, abs=1e-6), layer
        assert v["cka"] == pytest.approx(1.0, abs=1e-6), layer
        assert v["norm_ratio"] == pytest.approx(1.0, abs=1e-9), layer
    assert os.path.isfile(tmp_path / "self" / "summary.json") and os.path.isfile(tmp_path / "self" / "similarity.png")


def test_perturbed_copy_keeps_early_layers_and_drops_later_ones(targets, tmp_path):
    a, b, data = targets
    s = run_probe(ProbeConfig(target_a=a, target_b=b, data=data, out=str(tmp_path / "ab"), device="cpu"))
    sim = s["similarity"]
    # layer 2's input is computed by layers 0-1 only, which B shares with A
    assert sim["2"]["cosine_mean"] == pytest.approx(1.0, abs=1e-6) and sim["2"]["cka"] == pytest.approx(1.0, abs=1e-6)
    for later in ("4", "5"):
        assert sim[later]["cosine_mean"] < 0.99 and sim[later]["cka"] < 0.99, (later, sim[later])
        assert sim[later]["cosine_p5"] <= sim[later]["cosine_mean"]
    # the deeper the layer, the more perturbed layers lie under it
    assert sim["5"]["cosine_mean"] < sim["4"]["cosine_mean"]


def test_different_tokenizers_are_refused_in_one_line(targets, tmp_path):
    from draftport.model.target import tiny_target

    a, _, data = targets
    other = tiny_target("llama", seed=0)
    vocab = other.tokenizer.get_vocab()
    # same size, two ids swapped: what a retrained tokenizer looks like to a drafter indexing by id
    x, y = sorted(vocab, key=vocab.get)[100:102]
    from tokenizers import Tokenizer

    spec = json.loads(other.tokenizer.backend_tokenizer.to_str())
    spec["model"]["vocab"][x], spec["model"]["vocab"][y] = vocab[y], vocab[x]
    other.tokenizer._tokenizer = Tokenizer.from_str(json.dumps(spec))
    path = save_target(other, tmp_path / "swapped")
    with pytest.raises(DraftportError, match="tokenizers differ") as exc:
        run_probe(ProbeConfig(target_a=a, target_b=path, data=data, out=str(tmp_path / "x"), device="cpu"))
    assert "\n" not in str(exc.value) and "swapped" in str(exc.value)


@pytest.fixture(scope="module")
def drafter_a(targets, tmp_path_factory):
    a, _, data = targets
    return train_drafter(a, data, str(tmp_path_factory.mktemp("drafter") / "d"))


def test_plugin_tau_on_its_own_target_equals_its_offline_tau(targets, drafter_a, tmp_path):
    from draftport.capture.capture import CaptureConfig, run_capture
    from draftport.model.formats import load_drafter_for
    from draftport.decode.offline import offline_accept_len
    from draftport.model.target import load_target

    a, _, data = targets
    s = run_probe(ProbeConfig(target_a=a, target_b=a, data=data, out=str(tmp_path / "p"), drafter=drafter_a,
                              device="cpu"))
    assert s["layers_a"] == s["layers_b"] == [2, 4, 5]  # what SGLang feeds the saved drafter on this target
    assert s["plugin_accept_len"] == s["accept_len_a"]
    assert s["accept_len_a"] > 1.3  # a trained drafter: the equality is not 1.0 == 1.0
    # the same figure computed directly: A's states captured on their own, the offline simulation run on them
    target = load_target(a, device="cpu", dtype="fp32", aux_layers=[2, 4, 5])
    run_capture(CaptureConfig(target=a, data=data, out=str(tmp_path / "cap"), max_len=256, device="cpu"), target=target)
    direct = offline_accept_len(load_drafter_for(drafter_a, target), str(tmp_path / "cap"), target=target, depth=3)
    assert direct["accept_len"] == pytest.approx(s["accept_len_a"], rel=1e-12)
    assert s["per_position_a"] == pytest.approx(direct["per_position"])


def test_plugin_tau_drops_on_a_perturbed_target_and_cli_prints_one_json(targets, drafter_a, tmp_path, capsys):
    from draftport import cli

    a, b, data = targets
    assert cli.main(["probe", "--target-a", a, "--target-b", b, "--data", data, "--drafter", drafter_a,
                     "--device", "cpu", "--out", str(tmp_path / "ab"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)  # exactly one JSON object on stdout
    assert set(s["similarity"]) == {"2", "4", "5"}
    assert s["plugin_accept_len"] < s["accept_len_a"]
    assert json.load(open(tmp_path / "ab" / "summary.json"))["plugin_accept_len"] == s["plugin_accept_len"]
