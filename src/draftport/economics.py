"""Will speculation pay? Pure arithmetic on measured cycle times and τ (the `economics` verb: verbs/economics.py).

τ (accept length) = accepted draft tokens + 1 bonus token per verify cycle. With a cycle time c:
tok/s = τ / c, speedup over a baseline b = τ / (c·b), break-even τ* = b·c, the τ a goal G needs = G·c.
For a chain of depth k whose steps each pass with an independent probability α,
τ(α) = 1 + α + … + α^k = (1 − α^(k+1)) / (1 − α); unbounded depth: τ = 1 / (1 − α). τ(α) is
increasing on [0, 1], so α for a given τ is found by bisection. A depth-k chain never exceeds τ = k+1:
a goal beyond that is an answer (`reachable` false, `min_depth`), not an error.

No torch, no scipy: `draftport economics` must answer in well under a second (docs/design.md).
"""

from __future__ import annotations

import math



# ---------------------------------------------------------------------------------------------
# Pure functions (times in milliseconds at the interface, seconds inside the rates).

def cycle_time_ms(verify_ms: float, draft_ms: float, depth: int, overhead_ms: float = 0.0) -> float:
    """One chain cycle: a verify pass, k drafter steps and the fixed overhead."""
    return verify_ms + depth * draft_ms + overhead_ms


def tok_per_s(accept_len: float, cycle_ms: float) -> float:
    """Tokens a second when each cycle of `cycle_ms` emits τ tokens."""
    return accept_len / (cycle_ms / 1000.0)


def speedup(accept_len: float, cycle_ms: float, baseline_tok_s: float) -> float:
    """Speculative tok/s over the baseline's: τ / (c·b)."""
    return tok_per_s(accept_len, cycle_ms) / baseline_tok_s


def break_even_accept_len(baseline_tok_s: float, cycle_ms: float) -> float:
    """τ* = b·c: the τ at which speculation only matches the baseline."""
    return baseline_tok_s * cycle_ms / 1000.0


def required_accept_len(goal_tok_s: float, cycle_ms: float) -> float:
    """τ a cycle must emit to reach `goal_tok_s`: G·c."""
    return goal_tok_s * cycle_ms / 1000.0


def accept_len_from_alpha(alpha: float, depth: int | None = None) -> float:
    """τ(α) = Σ_{i=0..k} α^i for a depth-k chain; 1/(1−α) when depth is None (unbounded)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if depth is None:
        return math.inf if alpha == 1.0 else 1.0 / (1.0 - alpha)
    if alpha == 1.0:
        return float(depth + 1)
    if alpha == 0.0:
        return 1.0
    # (1 − α^(k+1)) / (1 − α) via expm1: exact near α → 1, where the plain form cancels.
    log_a = math.log(alpha)
    return math.expm1((depth + 1) * log_a) / math.expm1(log_a)


def max_accept_len(depth: int | None) -> float:
    """The most a depth-k chain can emit in a cycle (every draft accepted): k + 1."""
    return math.inf if depth is None else float(depth + 1)


def alpha_for_accept_len(tau: float, depth: int | None = None) -> float | None:
    """The per-step acceptance α with τ(α) = tau, by bisection; None when tau > depth + 1.

    tau ≤ 1 needs no accepted draft at all: α = 0.
    """
    if tau <= 1.0:
        return 0.0
    if depth is not None and tau >= depth + 1:
        return 1.0 if tau == depth + 1 else None
    lo, hi = 0.0, 1.0  # τ(lo) < tau ≤ τ(hi) throughout (τ(1) = k+1 or ∞)
    for _ in range(200):  # ~55 halvings reach float resolution; stop when the bracket cannot shrink
        mid = 0.5 * (lo + hi)
        if mid <= lo or mid >= hi:
            break
        if accept_len_from_alpha(mid, depth) < tau:
            lo = mid
        else:
            hi = mid
    return hi


def chain_depth_table(per_position: list[float], decode_ms: float, verify_ms: float, draft_ms: float,
                      overhead_ms: float = 0.0) -> list[dict]:
    """Predicted tok/s of a chain cut at each depth d = 1..k, from one chain's measured figures.

    per_position[j-1] = the share of cycles that accepted draft j (so a chain cut at d accepts min(a, d)
    and τ_d = 1 + Σ_{j≤d} per_position[j-1], exactly); verify of d + 1 tokens interpolated linearly
    between the 1-token decode step and the measured (k + 1)-token verify (flat on a launch-bound
    target, linear where compute-bound); d drafter steps of draft_ms each. Depths beyond k are not
    predicted: nothing was measured there."""
    k = len(per_position)
    rows, tau = [], 1.0
    for d in range(1, k + 1):
        tau += per_position[d - 1]
        verify_d = decode_ms + (verify_ms - decode_ms) * d / k
        cycle = cycle_time_ms(verify_d, draft_ms, d, overhead_ms)
        rows.append({"depth": d, "accept_len": tau, "cycle_ms": cycle, "tok_s": tok_per_s(tau, cycle)})
    return rows


def min_depth_for(tau: float) -> int:
    """The shortest chain that can reach τ at all (k + 1 ≥ τ, i.e. with every draft accepted)."""
    return max(0, math.ceil(tau - 1.0))


# ---------------------------------------------------------------------------------------------
# The capture store: how many bytes a captured token takes, what a data set needs on disk, and what follows
# (a bf16 store, an fp8 one, or no store at all: the target's states streamed into training).

STATE_BYTES = {"bf16": 2, "fp8": 1}   # bytes per hidden-state element, by storage dtype
TOKEN_BYTES = 5                       # int32 id + uint8 loss mask
FP8_SCALE_BYTES = 4                   # fp8: one fp32 scale per token and state (a state's range is its own)


def bytes_per_token(num_aux: int, hidden_size: int, storage: str = "bf16") -> int:
    """Disk bytes per captured token: the aux states (n·H) and the final state (H) at the storage dtype, the
    token's id and mask, and (fp8) a scale per state."""
    states = num_aux + 1
    scales = states * FP8_SCALE_BYTES if storage == "fp8" else 0
    return STATE_BYTES[storage] * states * hidden_size + scales + TOKEN_BYTES


def bytes_per_token_sum(num_aux: int, hidden_size: int, storage: str = "bf16") -> str:
    """bytes_per_token's sum spelled out, e.g. '2·(3+1)·7168 + 5' (bf16), '1·(3+1)·7168 + 4·(3+1) + 5' (fp8)."""
    scales = f" + {FP8_SCALE_BYTES}·({num_aux}+1)" if storage == "fp8" else ""
    return f"{STATE_BYTES[storage]}·({num_aux}+1)·{hidden_size}{scales} + {TOKEN_BYTES}"


def store_bytes(num_samples: int, tokens_per_sample: float, num_aux: int, hidden_size: int,
                storage: str = "bf16") -> float:
    """A store of num_samples samples of tokens_per_sample tokens each (shard headers are a few hundred bytes
    a shard: left out)."""
    return num_samples * tokens_per_sample * bytes_per_token(num_aux, hidden_size, storage)


def capture_choice(bf16_bytes: float, fp8_bytes: float, disk_bytes: float | None) -> str:
    """What the disk allows: a bf16 store when it fits, else an fp8 one when that fits, else none ("online": the
    target's states streamed into training, computed again every epoch). No disk given: bf16."""
    if disk_bytes is None or bf16_bytes <= disk_bytes:
        return "bf16"
    return "fp8" if fp8_bytes <= disk_bytes else "online"


def online_target_passes(epochs: int) -> int:
    """Target forward passes over the data per training run: a store pays one (the capture), the online path
    one per epoch."""
    return epochs
