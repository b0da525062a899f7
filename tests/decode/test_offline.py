"""Offline τ: the teacher-forced chain simulation equals online speculative decoding, cycle for cycle.

The drafters here are tiny EAGLE-3 drafters trained in a second on the tiny target's own greedy text,
with 20 % of the labels replaced by random tokens so that acceptance is mixed (some chains run the
full depth, some stop at once) — a test of τ on a drafter that always or never hits could not fail.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draftport.errors import DraftportError

PROMPTS = ["Hello, how are you today?", "def add(a, b):", "The capital of France is", "Once upon a time there"]



def drafter_config(target, vocab: int | None = None) -> dict:
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": target.hidden_size,
            "intermediate_size": 2 * target.hidden_size, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "num_hidden_layers": 1, "vocab_size": target.vocab_size,
            "draft_vocab_size": vocab or target.vocab_size, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "max_position_embeddings": 1024, "torch_dtype": "float32",
            "draftport": {"trained_layers": list(target.aux_layers)}}


def greedy(target, prompt_ids: list[int], n: int) -> list[int]:
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig

    return SpecEngine(target, None, EngineConfig(max_len=len(prompt_ids) + n + 8)).generate(prompt_ids, n).token_ids


def train_tiny_drafter(target, sequences: list[list[int]], depth: int = 3, steps: int = 30, corrupt: float = 0.2,
                       seed: int = 0):
    """TTT with hard labels (the target's argmax, a fraction replaced by random ids) on the given sequences."""
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.kvcache import TTTCache

    d = Eagle3Drafter.from_config(drafter_config(target), seed=seed)
    d.set_embedding(target.embed_weight)
    T = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (T - len(s)) for s in sequences])
    real = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in sequences], dtype=torch.bool)
    out = target.forward(ids, attention_mask=real.long(), with_logits=True)
    g = torch.Generator().manual_seed(seed)
    labels = out.logits.argmax(-1)
    labels = torch.where(torch.rand(labels.shape, generator=g) < corrupt,
                         torch.randint(0, target.vocab_size, labels.shape, generator=g), labels)
    labels = labels.masked_fill(~real, -100)
    opt = torch.optim.Adam([p for p in d.parameters() if p.requires_grad], lr=1e-2)
    pos = torch.arange(T - 1)
    for _ in range(steps):
        cache = TTTCache.empty(d.num_layers, key_padding=real[:, :T - 1])
        hidden, loss = d.project(out.aux[:, :T - 1]), 0.0
        for i in range(depth):
            hidden, logits = d.step(hidden, F.pad(ids[:, 1 + i:], (0, i)), pos + i, cache)
            lab = F.pad(labels[:, 1 + i:], (0, i), value=-100)
            loss = loss + 0.8 ** i * F.cross_entropy(logits.flatten(0, 1), lab.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def setup(request):
    """(target, drafter, prompt ids): a tiny target (Gemma-3's sliding windows included) and its drafter."""
    from draftport.model.target import tiny_target

    target = tiny_target(request.param, seed=0)
    prompts = [target.tokenizer(p)["input_ids"] for p in PROMPTS]
    seqs = [p + greedy(target, p, 40) for p in prompts[:3]]     # the 4th prompt is unseen in training
    return target, train_tiny_drafter(target, seqs), prompts


def teacher_forced(target, aux_layers, prompt: list[int], continuation: list[int]) -> dict:
    """Raw-tensor sample: fp32 aux and target argmax from one full forward over prompt + continuation."""
    seq = torch.tensor(prompt + continuation)
    out = target.forward(seq[None], aux_layers=aux_layers, with_logits=True)
    mask = torch.zeros(len(seq), dtype=torch.bool)
    mask[len(prompt):] = True
    return {"aux": out.aux[0], "input_ids": seq, "loss_mask": mask, "target_argmax": out.logits[0].argmax(-1),
            "last_hidden": out.last_hidden[0]}


@pytest.mark.parametrize("depth", [1, 2, 3, 5])
def test_offline_walk_equals_online_cycles(setup, depth):
    """Greedy fp32: per prompt, the offline walk over the target's own greedy continuation yields exactly
    the online engine's accept lengths, cycle by cycle (exact: same drafter inputs, same key sets at the
    same relative RoPE positions, same target argmaxes — only fp32 summation order differs)."""
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig
    from draftport.decode.offline import offline_accept_len, sample_walk

    target, drafter, prompts = setup
    N = 30
    engine = SpecEngine(target, drafter, EngineConfig(depth=depth, max_len=128))
    online, samples = [], []
    for p in prompts:
        r = engine.generate(p, N)
        # the baseline runs depth − 1 tokens past N: the last online cycle drafts that far
        cont = greedy(target, p, N + depth - 1)
        assert r.token_ids == cont[:N]
        s = teacher_forced(target, engine.aux_layers, p, cont)
        w = sample_walk(drafter, s["aux"], s["input_ids"], s["loss_mask"], s["target_argmax"], depth, N)
        assert [a + 1 for a in w.cycle_accepts] == r.accept_lens
        online += r.accept_lens
        samples.append(s)
    assert len(set(online)) > 1, "acceptance must be mixed for this test to mean anything"
    res = offline_accept_len(drafter, samples, depth=depth, max_new_tokens=N)
    assert res["accept_len"] == pytest.approx(sum(online) / len(online), abs=1e-12)
    assert res["cycles"] == len(online) and sum(res["accept_hist"].values()) == len(online)
    # the same through last_hidden + the target's own head (argmax computed by offline.py)
    no_argmax = [{k: v for k, v in s.items() if k != "target_argmax"} for s in samples]
    assert offline_accept_len(drafter, no_argmax, target=target, depth=depth, max_new_tokens=N)["accept_len"] \
        == res["accept_len"]


def test_chains_match_static_cache_decoding_on_foreign_text(setup):
    """On text the target did not write, each simulated chain still equals a chain decoded through the
    drafter's static cache: real rows 0..t, then drafts fed back as the next token (not the data's)."""
    from draftport.model.kvcache import causal_cache_mask
    from draftport.decode.offline import simulate_chains

    target, drafter, prompts = setup
    g = torch.Generator().manual_seed(3)
    seq = prompts[0] + torch.randint(4, target.vocab_size, (20,), generator=g).tolist()
    s = teacher_forced(target, target.aux_layers, prompts[0], seq[len(prompts[0]):])
    depth = 3
    sim = simulate_chains(drafter, s["aux"], s["input_ids"], s["target_argmax"], depth)
    ids = s["input_ids"]
    for t in (0, 5, len(seq) // 2, len(seq) - 4):
        cache = drafter.new_cache(1, 64)
        slots = torch.arange(t + 1)
        h, logits = drafter.step(drafter.project(s["aux"][None, :t + 1]), ids[None, 1:t + 2], slots, cache,
                                 cache_positions=slots, attn_mask=causal_cache_mask(slots, 64))
        h, logits = h[:, -1:], logits[:, -1:]
        for i in range(depth):
            d = drafter.to_target_ids(logits[0, 0].argmax())
            assert int(d) == int(sim.drafts[t, i]), (t, i)
            p = torch.tensor([t + 1 + i])
            h, logits = drafter.step(h, d.view(1, 1), p, cache, cache_positions=p, attn_mask=causal_cache_mask(p, 64))
        want = s["target_argmax"][t + 1:t + 1 + depth]
        assert sim.hits[t, :len(want)].tolist() == (sim.drafts[t, :len(want)] == want).tolist()


def test_walk_cycles_jumps_cuts_and_segments():
    from draftport.decode.offline import walk_cycles

    T, k = 16, 3
    hits = torch.zeros(T - 1, k, dtype=torch.bool)
    hits[3] = torch.tensor([1, 1, 0])     # cycle at t=3 accepts 2, next cycle at t=6
    hits[6] = torch.tensor([1, 1, 1])     # accepts 3 → t=10
    hits[10] = torch.tensor([1, 1, 1])    # would accept 3 but the response ends: only t+1+i <= e-1 count
    mask = torch.zeros(T, dtype=torch.bool)
    mask[4:13] = True                     # response x_4..x_12 (prompt ends at 3)
    w = walk_cycles(hits, mask)
    assert w.cycle_accepts == [2, 3, 2]   # t=3, t=6, t=10 (cut: draft i=2 would score p_13, past e-1 = 12)
    assert len(w.position_accepts) == len(range(3, 11))
    # a token budget stops the walk as decoding's max_new_tokens does (x_4 from the prefill + 3 + 4 = 8)
    assert walk_cycles(hits, mask, max_new_tokens=8).cycle_accepts == [2, 3]
    assert walk_cycles(hits, mask, max_new_tokens=4).cycle_accepts == [2]
    assert walk_cycles(hits, mask, max_new_tokens=1).cycle_accepts == []
    # two responses: each walked from its own start
    mask2 = mask.clone()
    mask2[9] = False                      # responses [4, 9) and [10, 13)
    w2 = walk_cycles(hits, mask2)
    assert w2.cycle_accepts[:2] == [2, 2]  # t=6 cut at e-1=8: drafts at 7 and 8 only
    assert w2.cycle_accepts[2:] == [0, 2]  # second response from t=9: all miss (1 token), then t=10 cut at 12


def test_summarize_histogram_and_positions():
    from draftport.decode.offline import summarize

    s = summarize([0, 3, 1, 1, 2], depth=3)
    assert s["accept_len"] == pytest.approx(1 + 7 / 5)
    assert s["accept_hist"] == {"1": 1, "2": 2, "3": 1, "4": 1}
    assert s["per_position"] == pytest.approx([4 / 5, 2 / 5, 1 / 5])
    assert s["cycles"] == 5
    assert summarize([], depth=2)["accept_len"] is None


def test_store_path_tracks_the_raw_tensors(setup, tmp_path):
    """Through a capture store (bf16 aux and last_hidden) the τ stays within 0.1 of the fp32 raw-tensor
    value: bf16 rounding (relative 2^-8) can flip a near-tied argmax of the drafter or of the target's
    head, so equality is not guaranteed — exactness is proven on raw tensors above."""
    from draftport.decode.offline import offline_accept_len
    from draftport.data.store import StoreWriter

    target, drafter, prompts = setup
    samples = [teacher_forced(target, target.aux_layers, p, greedy(target, p, 24)) for p in prompts]
    w = StoreWriter(str(tmp_path / "store"), {"target": "tiny", "hidden_size": target.hidden_size,
                                              "aux_layers": list(target.aux_layers)})
    w.submit([{k: s[k] for k in ("input_ids", "loss_mask", "aux", "last_hidden")} for s in samples])
    w.finish()
    raw = offline_accept_len(drafter, samples, depth=3)
    via_store = offline_accept_len(drafter, str(tmp_path / "store"), target=target, depth=3,
                                   aux_layers=target.aux_layers)
    assert via_store["samples"] == len(prompts)
    assert abs(via_store["accept_len"] - raw["accept_len"]) <= 0.1
    assert abs(via_store["position_accept_len"] - raw["position_accept_len"]) <= 0.1
    with pytest.raises(DraftportError, match="aux layers"):
        offline_accept_len(drafter, str(tmp_path / "store"), target=target, depth=3, aux_layers=[1, 2, 3])


def test_bad_samples_are_one_line_errors(setup):
    from draftport.decode.offline import offline_accept_len, simulate_chains

    target, drafter, _ = setup
    with pytest.raises(DraftportError, match="lacks"):
        offline_accept_len(drafter, [{"input_ids": torch.tensor([1, 2, 3])}], depth=2)
    with pytest.raises(DraftportError, match="no samples"):
        offline_accept_len(drafter, [], depth=2)
    with pytest.raises(DraftportError, match="must match"):
        simulate_chains(drafter, torch.zeros(4, 3 * target.hidden_size), torch.zeros(5, dtype=torch.long),
                        torch.zeros(5, dtype=torch.long), 2)
    with pytest.raises(DraftportError, match="capture store"):
        offline_accept_len(drafter, "/nonexistent/store", depth=2)
