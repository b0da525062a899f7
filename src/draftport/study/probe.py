"""Will a drafter trained for target A transfer to target B? Measured before any training (the `probe` verb,
verbs/probe.py, captures both targets and runs these).

Three answers, all on the same token sequences:
1. Tokenizer identity. A drafter indexes the target's vocabulary (embedding, d2t/t2d, lm_head rows),
   so A and B must tokenize every probe text to the same ids; otherwise the probe refuses in one line.
2. Per aux layer (the layers the drafter is fed on each target — check/layers.py's rule with
   the probe's --engine — or the default [2, L//2, L-3] without a drafter): mean and 5th-percentile cosine similarity of h_A(t) and
   h_B(t) over tokens, linear CKA (centered, on token features) and the norm ratio
   mean ||h_B|| / mean ||h_A|| (fc reads raw states, so a scale change alone hurts a plugged-in drafter).
3. Plug-in τ: the offline acceptance length of drafter DA when fed B's hidden states and verified
   against B's own predictions, next to its τ on A (the same computation on A's states).

Hidden states go through two capture stores (`<out>/store-a`, `<out>/store-b`, written by
`capture.run_capture`, so a rerun reuses them), then both statistics stream over the stores, sample by
sample, in float64. The first token of every sample is left out of the similarity: it is the attention
sink, whose hidden state is tens of times larger than the rest and would dominate CKA and the norms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from draftport.data.chat import tokenize_conversation
from draftport.decode.offline import offline_accept_len
from draftport.errors import DraftportError
from draftport.model.formats import load_drafter_for

SKIP_FIRST_TOKENS = 1      # attention-sink position left out of the similarity (see the module docstring)


# ---------------------------------------------------------------------------------------------
# Similarity math (pure functions, float64)


def cosine_per_token(ha: torch.Tensor, hb: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """ha, hb [N, H] -> [N] cosine of each token's pair of states."""
    ha, hb = ha.double(), hb.double()
    dots = (ha * hb).sum(-1)
    return dots / (ha.norm(dim=-1) * hb.norm(dim=-1)).clamp_min(eps)


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Linear CKA of token features x [N, Hx], y [N, Hy] (columns centred):
    ||Yc^T Xc||_F^2 / (||Xc^T Xc||_F · ||Yc^T Yc||_F). 1 = same up to rotation and isotropic scale."""
    x, y = x.double(), y.double()
    x, y = x - x.mean(0), y - y.mean(0)
    num = (y.T @ x).pow(2).sum()
    den = (x.T @ x).norm() * (y.T @ y).norm()
    return float(num / den) if den > 0 else float("nan")


@dataclass
class LayerStats:
    """Streaming sufficient statistics of one layer pair: exact cosine quantiles, CKA and norms
    without keeping the token features (Xc^T Yc = Σ x yᵀ − n·mean_x·mean_yᵀ)."""
    hidden_a: int
    hidden_b: int
    n: int = 0
    cosines: list = field(default_factory=list)     # float64 arrays, one per update
    norm_a: float = 0.0                             # Σ ||h_A||
    norm_b: float = 0.0                             # Σ ||h_B||
    sum_a: torch.Tensor | None = None               # [Ha] Σ h_A
    sum_b: torch.Tensor | None = None               # [Hb]
    saa: torch.Tensor | None = None                 # [Ha, Ha] Σ h_A h_Aᵀ
    sbb: torch.Tensor | None = None                 # [Hb, Hb]
    sba: torch.Tensor | None = None                 # [Hb, Ha] Σ h_B h_Aᵀ

    def update(self, ha: torch.Tensor, hb: torch.Tensor) -> None:
        """ha [N, Ha], hb [N, Hb]: the same N tokens on A and on B."""
        if ha.shape[0] != hb.shape[0]:
            raise ValueError(f"token counts differ: {ha.shape[0]} vs {hb.shape[0]}")
        a, b = ha.double(), hb.double()
        if self.sum_a is None:
            self.sum_a, self.sum_b = torch.zeros(self.hidden_a, dtype=torch.float64), torch.zeros(self.hidden_b, dtype=torch.float64)
            self.saa = torch.zeros(self.hidden_a, self.hidden_a, dtype=torch.float64)
            self.sbb = torch.zeros(self.hidden_b, self.hidden_b, dtype=torch.float64)
            self.sba = torch.zeros(self.hidden_b, self.hidden_a, dtype=torch.float64)
        self.n += a.shape[0]
        if self.hidden_a == self.hidden_b:
            self.cosines.append(cosine_per_token(a, b).numpy())
        self.norm_a += float(a.norm(dim=-1).sum())
        self.norm_b += float(b.norm(dim=-1).sum())
        self.sum_a += a.sum(0)
        self.sum_b += b.sum(0)
        self.saa += a.T @ a
        self.sbb += b.T @ b
        self.sba += b.T @ a

    def result(self) -> dict:
        """{cosine_mean, cosine_p5, cka, norm_ratio, tokens} (cosines None when widths differ)."""
        if self.n == 0:
            raise DraftportError("no tokens to compare (every probe sample was a single token)")
        ma, mb = self.sum_a / self.n, self.sum_b / self.n
        caa = self.saa - self.n * torch.outer(ma, ma)
        cbb = self.sbb - self.n * torch.outer(mb, mb)
        cba = self.sba - self.n * torch.outer(mb, ma)
        den = caa.norm() * cbb.norm()
        cka = float(cba.pow(2).sum() / den) if den > 0 else float("nan")
        cos = np.concatenate(self.cosines) if self.cosines else None
        return {"cosine_mean": None if cos is None else float(cos.mean()),
                "cosine_p5": None if cos is None else float(np.percentile(cos, 5)),
                "cka": min(cka, 1.0),  # Cauchy–Schwarz bounds it by 1; rounding can step past
                "norm_ratio": self.norm_b / self.norm_a if self.norm_a > 0 else float("nan"),
                "tokens": self.n}


def layer_key(layer_a: int, layer_b: int) -> str:
    """summary.json key of a layer pair: "12", or "12:14" when B feeds the drafter another layer."""
    return str(layer_a) if layer_a == layer_b else f"{layer_a}:{layer_b}"


def store_similarity(store_a, store_b, skip_first: int = SKIP_FIRST_TOKENS) -> dict[str, dict]:
    """Per aux layer pair: similarity of two stores captured on the same token sequences."""
    if len(store_a) != len(store_b):
        raise DraftportError(f"the two stores hold {len(store_a)} and {len(store_b)} samples", store_b.path)
    la, lb = store_a.aux_layers, store_b.aux_layers
    if len(la) != len(lb):
        raise DraftportError(f"{len(la)} aux layers on A vs {len(lb)} on B", store_b.path)
    Ha, Hb = store_a.hidden_size, store_b.hidden_size
    stats = [LayerStats(Ha, Hb) for _ in la]
    for i in range(len(store_a)):
        sa, sb = store_a[i], store_b[i]
        if not torch.equal(sa["input_ids"], sb["input_ids"]):
            raise DraftportError(f"sample {i} has different token ids in the two stores", store_b.path)
        aux_a, aux_b = sa["aux"][skip_first:], sb["aux"][skip_first:]
        for j, st in enumerate(stats):
            st.update(aux_a[:, j * Ha:(j + 1) * Ha], aux_b[:, j * Hb:(j + 1) * Hb])
    return {layer_key(a, b): st.result() for a, b, st in zip(la, lb, stats)}


# ---------------------------------------------------------------------------------------------
# Tokenizers


def check_tokenizers(tok_a, tok_b, conv_texts: list | None = None,
                     where: str = "target-b", chat_template: str | None = None, max_len: int | None = None) -> int:
    """Refuse (one line) unless A and B share the vocabulary and give the same ids on the probe texts.
    Returns the number of texts compared."""
    va, vb = tok_a.get_vocab(), tok_b.get_vocab()
    if len(va) != len(vb):
        raise DraftportError(f"tokenizers differ: {len(va)} tokens in A's vocabulary vs {len(vb)} in B's; a drafter "
                             "for A indexes A's vocabulary", where)
    if va != vb:
        diff = sorted(k for k in va if vb.get(k) != va[k])[:3]
        raise DraftportError(f"tokenizers differ: same size but different ids for {len(diff)}+ tokens (e.g. "
                             f"{', '.join(repr(d) for d in diff)})", where)
    n = 0
    for i, conv in enumerate(conv_texts or []):
        ia, _ = tokenize_conversation(tok_a, conv, chat_template=chat_template, max_len=max_len)
        ib, _ = tokenize_conversation(tok_b, conv, chat_template=chat_template, max_len=max_len)
        ia, ib = ia.tolist(), ib.tolist()
        if ia != ib:
            at = next((t for t, (x, y) in enumerate(zip(ia, ib)) if x != y), min(len(ia), len(ib)))
            raise DraftportError(f"tokenizers differ: probe text {i} tokenizes differently from token {at} on "
                                 "(same vocabulary, different rules or chat template)", where)
        n += 1
    return n


# ---------------------------------------------------------------------------------------------
# The plug-in


def set_aux_layers(target, layers: list[int], where: str) -> None:
    """Tap `layers` on this target from now on (capture and the offline τ read target.aux_layers)."""
    bad = [i for i in layers if not 0 <= int(i) <= target.num_layers]
    if bad:
        raise DraftportError(f"the drafter would be fed layers {bad}, which a {target.num_layers}-layer target "
                             "does not have", where)
    target.aux_layers = [int(i) for i in layers]


def offline_tau(drafter_path: str, store, target, depth: int) -> dict:
    """Offline τ (offline.offline_accept_len) of the drafter on a store of `target`'s states, verified by
    `target`'s own head. The drafter reads `target`'s embedding unless its checkpoint carries one: behind
    B an engine shares B's embedding with the drafter, and that is what a plug-in gets."""
    drafter = load_drafter_for(drafter_path, target)
    return offline_accept_len(drafter, store, target=target, depth=depth, aux_layers=target.aux_layers)


