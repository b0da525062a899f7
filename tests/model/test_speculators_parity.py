"""The speculators-format export loads in vllm-project/speculators and computes what ours computes.

speculators is a test-only dependency, pinned; install it without its dependencies (its
torchvision/torchaudio pins would replace the CPU torch) plus the few modules it imports:
    pip install --no-deps speculators==0.9.0 loguru==0.7.3 openai==3.57.0 datasets==5.2.0 \
        multiprocess==0.70.19 dill==0.4.1 xxhash==4.1.0 pandas==3.1.1 pyarrow==26.0.1 hs-connectors==0.9.0

Parity: the same 3-step training-time-test unroll (speculators' Eagle3DraftModel.forward with its
eager attention and dense TTT masks; ours through Eagle3Drafter.step with TTTCache and RoPE position
t + i) gives the same logits at every step, fp32, within atol 1e-5 / rtol 1e-4 (room for fp32 rounding only).
"""

from __future__ import annotations

import pytest
import torch

from conftest import reference_module  # noqa: E402

speculators_eagle3 = reference_module("speculators.models.eagle3")  # under CI: fails when missing

from draftport.model.drafter import Eagle3Drafter  # noqa: E402
from draftport.model.kvcache import TTTCache
from draftport.model.formats import save_drafter

V, VD, H, L = 96, 40, 32, 8
LAYER = {"model_type": "llama", "hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
         "max_position_embeddings": 256}
VARIANTS = {
    # SGLang-layout drafter, EAGLE-3.1 norms; eagle_config [1, 3, 4] = layers 2, 4, 5 of the target
    "sglang-eagle3.1": {"architectures": ["LlamaForCausalLMEagle3"], **LAYER, "num_hidden_layers": 1,
                        "draft_vocab_size": VD, "fc_norm": True, "norm_output": True, "torch_dtype": "float32",
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}},
    # speculators drafter with two decoder layers and both speculators norm flags
    "speculators-2-layers": {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                             "transformer_layer_config": {**LAYER, "num_hidden_layers": 2}, "draft_vocab_size": VD,
                             "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "norm_before_residual": True,
                             "norm_before_fc": True, "torch_dtype": "float32"},
}


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    """A tiny local Llama target (speculators reads its config and embedding; never a hub id)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in LAYER.items() if k != "model_type"}, num_hidden_layers=L)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("verifier")
    model.save_pretrained(path)
    return path, model.model.embed_tokens.weight.detach().clone()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_speculators_loads_our_export_and_matches_our_forward(tmp_path, verifier, variant):
    target_dir, embed = verifier
    ours = Eagle3Drafter.from_config(VARIANTS[variant], seed=1).eval()
    ours.set_embedding(embed)
    g = torch.Generator().manual_seed(2)
    used = torch.sort(torch.randperm(V, generator=g)[:VD]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    ours.set_vocab_mapping(used - torch.arange(VD), t2d)
    save_drafter(ours, tmp_path, format="speculators", target=target_dir)

    cfg = speculators_eagle3.Eagle3SpeculatorConfig.from_pretrained(tmp_path)
    cfg.transformer_layer_config._attn_implementation = "eager"   # CPU: dense masks, no flex attention
    theirs = speculators_eagle3.Eagle3DraftModel.from_pretrained(tmp_path, config=cfg).eval()
    assert theirs.config.eagle_aux_hidden_state_layer_ids == [2, 4, 5]
    assert theirs.config.norm_before_residual == ours.spec.norm_before_residual
    assert len(theirs.layers) == ours.num_layers
    assert torch.equal(theirs.d2t, ours.d2t) and torch.equal(theirs.t2d, ours.t2d)
    assert not any(torch.isnan(p).any() for n, p in theirs.named_parameters() if not n.startswith("verifier_"))

    T, k = 9, 3
    aux = torch.randn(1, T, 3 * H, generator=g)
    ids = torch.randint(0, V, (1, T), generator=g)
    caught: list[torch.Tensor] = []
    hook = theirs.lm_head.register_forward_hook(lambda mod, inp, out: caught.append(out))
    with torch.no_grad():
        theirs(hidden_states=aux, input_ids=ids, document_ids=torch.zeros(1, T, dtype=torch.long),
               position_ids=torch.arange(T)[None], ttt_steps=k)
    hook.remove()
    assert len(caught) == k

    cache, hidden = TTTCache.empty(ours.num_layers), ours.project(aux)
    with torch.no_grad():
        for i in range(k):
            step_ids = torch.cat([ids[:, i:], ids.new_zeros(1, i)], dim=1)   # the token read at step i
            hidden, logits = ours.step(hidden, step_ids, torch.arange(T) + i, cache)
            torch.testing.assert_close(logits, caught[i], atol=1e-5, rtol=1e-4)
