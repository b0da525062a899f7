"""The drafter a training run starts from: a fresh one shaped after the target (its draft vocabulary the
training data's most used tokens), or a warm start from an existing drafter in any layout, whose vocabulary
mapping is kept (or, asked for, rebuilt with lm_head's rows remapped) and whose aux layers must be the ones
the store holds.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from draftport.check.layers import engine_aux_ids, resolve_aux_layers
from draftport.errors import DraftportError, bad_input
from draftport.model.drafter import Eagle3Drafter
from draftport.model.formats import load_drafter
from draftport.model.vocab import VocabMap, build_draft_vocab, remap_lm_head
from draftport.train.config import TrainConfig
from draftport.train.samples import Samples


def drafter_config(target, layers: list[int], vocab_size: int, draft_vocab_size: int,
                   intermediate_size: int | None = None) -> dict:
    """SGLang LlamaForCausalLMEagle3 config of a fresh drafter shaped after the target (MLP width: the target's
    unless `intermediate_size` is given)."""
    s = target.spec
    width = intermediate_size or s.intermediate_size or 4 * target.hidden_size
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": target.hidden_size, "intermediate_size": width,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "num_hidden_layers": 1, "vocab_size": vocab_size,
            "draft_vocab_size": draft_vocab_size, "rms_norm_eps": 1e-6,
            "rope_theta": s.rope_theta or 10000.0, "max_position_embeddings": s.max_position_embeddings or 2048,
            "hidden_act": "silu",  # SGLang's Llama MLP is SiLU only, whatever the target uses
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            "eagle_config": {"use_aux_hidden_state": True,
                             "eagle_aux_hidden_state_layer_ids": engine_aux_ids(layers, s, "sglang")},
            "draftport": {"trained_layers": layers, "target_architecture": s.architecture,
                          "target_model_type": s.model_type, "target_num_layers": target.num_layers}}


def build_drafter(cfg: TrainConfig, target, data: "Samples", train_idx, console, resuming: bool, device):
    """-> (fp32 drafter on `device` with the target's embedding, aux layers, notes). Vocab from the data unless kept from --init-from."""
    V, notes = target.vocab_size, {}
    if cfg.init_from:
        drafter, report = load_drafter(cfg.init_from, dtype=torch.float32)
        if report.not_read:  # e.g. SpecForge's training_state.pt: a pickle, and optimizer state besides
            console.print(f"not opened: {', '.join(os.path.basename(p) for p in report.not_read)} (a pickle; the "
                          "warm start takes the weights only and begins a fresh optimizer)")
        if report.missing:
            console.print(f"[yellow]warning: {cfg.init_from} lacks {', '.join(report.missing[:6])}; "
                          "those start from a fresh init[/yellow]")
        spec = drafter.spec
        if spec.vocab_size != V or spec.target_hidden_size != target.hidden_size:
            raise bad_input(cfg.init_from, f"drafter expects vocab {spec.vocab_size} / aux width "
                                           f"{spec.target_hidden_size}, the target has {V} / {target.hidden_size}")
        layers = resolve_aux_layers(spec, target.spec).layers
        if cfg.aux_layers is not None and list(cfg.aux_layers) != layers:
            raise DraftportError(f"--aux-layers {cfg.aux_layers} differ from the layers {layers} {cfg.init_from} "
                                 "is fed on this target")
        if cfg.remap_vocab and not resuming:
            old = VocabMap.from_d2t(drafter.d2t, V, cfg.init_from)
            new = build_draft_vocab(data.token_counts(train_idx, V), cfg.draft_vocab_size or spec.draft_vocab_size)
            head = target.lm_head_weight if target.hidden_size == spec.hidden_size else None
            weight = remap_lm_head(drafter.lm_head.weight.detach(), old, new,
                                   None if head is None else head.detach().float().cpu())
            if new.draft_vocab_size != spec.draft_vocab_size:
                sd = {k: v for k, v in drafter.state_dict().items() if k not in ("lm_head.weight", "d2t")}
                drafter = Eagle3Drafter(dataclasses.replace(spec, draft_vocab_size=new.draft_vocab_size))
                drafter.load_state_dict(sd, strict=False)
            with torch.no_grad():
                drafter.lm_head.weight.copy_(weight)
            drafter.set_vocab_mapping(new.d2t, new.t2d)
            notes["vocab"] = f"new mapping from the data ({new.draft_vocab_size} rows, lm_head remapped)"
            notes["vocab_filled"] = new.filled
        elif cfg.draft_vocab_size is not None and cfg.draft_vocab_size != spec.draft_vocab_size:
            raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} differs from {cfg.init_from}'s "
                                 f"{spec.draft_vocab_size}; add --remap-vocab to build a new mapping")
        else:
            notes["vocab"] = f"kept from {cfg.init_from}"
    else:
        # a fresh drafter reads what the store captured (or --aux-layers; a mismatch is refused below)
        explicit = cfg.aux_layers if cfg.aux_layers is not None else data.aux_layers
        layers = resolve_aux_layers(None, target.spec, explicit).layers
        Vd = cfg.draft_vocab_size or min(32000, V)
        drafter = Eagle3Drafter.from_config(drafter_config(target, layers, V, Vd, cfg.draft_intermediate_size),
                                            seed=cfg.seed, dtype=torch.float32)
        if not resuming:  # on resume d2t / t2d come back with the weights
            vm = build_draft_vocab(data.token_counts(train_idx, V), Vd)
            drafter.set_vocab_mapping(vm.d2t, vm.t2d)
            if cfg.lm_head_from_target and target.hidden_size == drafter.spec.hidden_size:
                with torch.no_grad():  # the drafter's output plays the target's last hidden: start from its head
                    drafter.lm_head.weight.copy_(target.lm_head_weight.detach()[vm.used.to(target.device)].float())
            notes["vocab"] = "built from the training data"
            notes["vocab_filled"] = vm.filled
            if vm.filled:
                console.print(f"the data holds {Vd - vm.filled} distinct tokens under the loss mask; the draft "
                              f"vocab of {Vd} is filled with the {vm.filled} smallest unused ids")
    if data.aux_layers is not None and data.aux_layers != layers:
        raise bad_input(cfg.data, f"the store holds aux layers {data.aux_layers} but the drafter is fed {layers} "
                                  f"on this target; capture again with --aux-layers {','.join(map(str, layers))}")
    if cfg.draft_vocab_size is not None and not 1 <= cfg.draft_vocab_size <= V:
        raise DraftportError(f"--draft-vocab-size {cfg.draft_vocab_size} must lie in [1, {V}]")
    drafter.to(device)
    drafter.set_embedding(target.embed_weight)  # after the move: shared, not copied, when dtypes agree
    return drafter, layers, notes
