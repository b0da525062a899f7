"""The decoder math the drafter, the native target pass and the compiled stand-ins share: RMSNorm in HF's two
conventions and the rotary embedding. Plain functions of tensors, so torch.compile sees straight code.

RMSNorm (the weight applied before or after the cast back):
    Llama / Mistral / Qwen   w · (x̂ in the input dtype)          rms_norm_weight_after_cast
    Gemma 1-3                (x̂ · (1 + w)) in fp32, then cast     rms_norm_unit_offset
with x̂ = x / rms(x) computed in fp32 (`rms_normalized`). `rms_norm` is either, picked by a flag, with Gemma's
1 + w precomputed in fp32 by the caller (the native pass does it once at load).
"""

from __future__ import annotations

import torch


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂ = x / rms(x) in fp32, the part both conventions share."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_weight_after_cast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * rms_normalized(x, eps).to(x.dtype)


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return (rms_normalized(x, eps) * (1.0 + weight.float())).to(x.dtype)


NORM_VARIANTS = (rms_norm_weight_after_cast, rms_norm_unit_offset)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
    """Either convention in its op order: Llama/Qwen w · (x̂ cast back), Gemma (x̂ · (1+w)) in fp32 then cast (w
    here is that fp32 1+w, precomputed)."""
    y = rms_normalized(x, eps)
    if unit_offset:
        return (y * w).to(x.dtype)
    return w * y.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_half_split(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      position_ids=None, unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary embedding of HF's Llama-family modelling files (Llama, Mistral, Qwen, Gemma 1-3), with their
    signature: each head dim paired with the one half a head away. position_ids: the old signature's argument,
    unused there too (cos/sin are already per position). q/k [B, heads, T, D]; cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
