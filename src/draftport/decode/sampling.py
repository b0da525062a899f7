"""The sampling math of speculative decoding: warps, lossless accept/reject, EAGLE-2 dynamic trees.

Pure functions over tensors, no model code, so each rule can be tested alone (docs/design.md,
"Chain speculation" and "Dynamic tree"). Everything runs on the tensors' device without a host
sync: random numbers come from an explicit `torch.Generator`, categorical sampling uses the
exponential-race trick (argmax of p / E, E ~ Exp(1)) instead of `torch.multinomial`, and data-
dependent loops (the tree walk) run a fixed number of masked iterations.

Shapes: B = batch (the engine uses 1; tests use many trials at once), k = draft depth of a chain,
V = target vocab, Vd = draft vocab, N = tree nodes including the root, K = children per node (topk),
D = tree depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch



# ---------------------------------------------------------------------------------------------
# Warps and sampling
# ---------------------------------------------------------------------------------------------

def warp_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """logits [..., V] → probabilities [..., V] (fp32) after temperature and top-p (nucleus).

    The speculative accept rules stay lossless only when the target and the draft distributions
    go through this same warp. temperature <= 0 means greedy: a one-hot of the argmax.
    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (at least one).
    """
    logits = logits.float()
    if temperature <= 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of the strictly more likely tokens
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return kept / kept.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one index per row of probs [..., V] (rows need not be normalised) → [...] int64.

    argmax(p / E) with E ~ Exp(1) is distributed as p (the exponential race), and needs no host
    sync, unlike torch.multinomial on some devices. Zero-probability entries never win.
    """
    e = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)
    return (probs.float() / e).argmax(-1)


def race_pick(logits: torch.Tensor, noise: torch.Tensor, temperature: float) -> torch.Tensor:
    """The exponential race on logits, no top-p: logits [..., V] and noise E [..., V] ~ Exp(1) → [...] int64.

    argmax(softmax(l / T) / E) == argmax(l / T − log E): the softmax's normaliser is one constant a row and log
    is increasing, so this draws the same token as `sample(warp_probs(l, T), ·)` given the same E (up to fp32 rounding
    at an exact tie). Written this way it is one elementwise pass feeding one reduction, which Inductor fuses into a
    single kernel reading the logits and the noise once: materialising fp32 logits, softmax and p / E over every row ×
    vocabulary entry is a large share of the batch engine's sampled step (measured: see BENCHMARKS.md, Regeneration:
    batch engine vs HF generate). The clamp keeps an E of exactly 0 (possible on the CPU) a finite, dominant score."""
    return (logits.float() / temperature - noise.clamp_min(torch.finfo(torch.float32).tiny).log()).argmax(-1)


def _uniform(shape, device, generator: torch.Generator | None) -> torch.Tensor:
    return torch.rand(shape, device=device, generator=generator)


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool → [B] int64: the length of the all-true prefix of each row."""
    return mask.long().cumprod(-1).sum(-1)


# ---------------------------------------------------------------------------------------------
# Chain acceptance
# ---------------------------------------------------------------------------------------------

def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy chain acceptance. draft_ids [B, k], target_logits [B, k+1, V] (row j = p_{n+j}).

    Returns (accept_len [B], next_token [B]): the longest prefix with d_j == argmax p_{n+j-1},
    and the bonus token argmax p_{n+a} at the first mismatch (or after the last draft).
    """
    target_ids = target_logits.argmax(-1)                        # [B, k+1]
    a = leading_true(draft_ids == target_ids[:, :-1])           # [B]
    return a, target_ids.gather(1, a[:, None])[:, 0]


def chain_accept(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless chain acceptance (speculative sampling). Distributions already warped.

    draft_ids [B, k] (d_j drawn from q_j), draft_probs [B, k, V] (q_j over the target vocab; a
    one-hot row when the draft was an argmax), target_probs [B, k+1, V] (p_{n..n+k}).
    Accept d_j with probability min(1, p(d_j)/q(d_j)); at the first rejection j the next token is
    drawn from normalise(max(p_j - q_j, 0)); when all k pass it is drawn from p_{n+k}.
    Returns (accept_len [B], next_token [B]); the emitted tokens are d_1..d_a then next_token.
    """
    B, k = draft_ids.shape
    idx = draft_ids[..., None]
    p_d = target_probs[:, :k].gather(-1, idx)[..., 0]            # [B, k]
    q_d = draft_probs.gather(-1, idx)[..., 0]                    # [B, k]
    u = _uniform((B, k), draft_ids.device, generator)
    a = leading_true(u * q_d < p_d)                             # u < p/q without dividing by q
    # Residual at the first rejection; p_{n+k} itself when everything was accepted.
    q_pad = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)  # [B, k+1, V]
    rows = torch.arange(B, device=draft_ids.device)
    p_a, q_a = target_probs[rows, a], q_pad[rows, a]             # [B, V]
    resid = (p_a - q_a).clamp_min(0.0)
    # p == q on the support leaves nothing to reject into; fall back to p (the case has
    # probability zero when a rejection actually happened, but keeps the arithmetic finite).
    empty = resid.sum(-1, keepdim=True) <= 0
    resid = torch.where(empty, p_a, resid)
    return a, sample(resid, generator)


# ---------------------------------------------------------------------------------------------
# EAGLE-2 dynamic tree
# ---------------------------------------------------------------------------------------------

@dataclass
class DraftTree:
    """A draft tree ready for one verify pass; node 0 is the root (the last accepted token).

    Nodes are sorted so that a parent always precedes its children.
    """
    tokens: torch.Tensor     # [N] int64 target ids; tokens[0] = the root token
    parents: torch.Tensor    # [N] int64 node index of the parent; -1 for the root
    depths: torch.Tensor     # [N] int64 0 for the root; RoPE position of node i is n + depths[i]
    attn_mask: torch.Tensor  # [N, N] bool, [i, j] = j is i or an ancestor of i (tree attention)
    paths: torch.Tensor      # [N, D+1] int64 node ids root→i by depth, -1 padded (retrieve paths)
    children: torch.Tensor   # [N, K] int64 children of each node in draft-score order, -1 padded


@dataclass
class TreeLevel:
    """Candidates produced at one depth of the expansion (all kept for the final selection)."""
    tokens: torch.Tensor     # [C] int64 target ids
    scores: torch.Tensor     # [C] fp32 cumulative draft log-probability
    parents: torch.Tensor    # [C] int64 index into the previous level's candidates (-1 = root)
    frontier: torch.Tensor   # [K] int64 indices (into this level) of the K best: expanded next


def tree_root_level(draft_logprobs: torch.Tensor, draft_to_target: torch.Tensor, topk: int) -> TreeLevel:
    """Depth 1: the root's K best children. draft_logprobs [Vd] (log-softmax of the drafter),
    draft_to_target [Vd] int64 maps draft ids to target ids."""
    scores, ids = draft_logprobs.float().topk(topk)
    return TreeLevel(tokens=draft_to_target[ids], scores=scores,
                     parents=torch.full_like(ids, -1), frontier=torch.arange(topk, device=ids.device))


def tree_expand(prev: TreeLevel, child_logprobs: torch.Tensor, draft_to_target: torch.Tensor,
                topk: int) -> TreeLevel:
    """One more depth: each frontier node of `prev` gets its K best children (K² candidates,
    scored by cumulative log-probability); the K best of them form the next frontier.

    child_logprobs [K, Vd]: the drafter's log-probabilities at the K frontier nodes, in frontier order.
    """
    K = prev.frontier.shape[0]
    lp, ids = child_logprobs.float().topk(topk, dim=-1)                  # [K, topk]
    scores = (prev.scores[prev.frontier][:, None] + lp).reshape(-1)      # [K*topk]
    parents = prev.frontier[:, None].expand(K, topk).reshape(-1)
    # Stable sort: equal scores keep candidate order, so the choice is deterministic.
    frontier = scores.sort(descending=True, stable=True).indices[:topk]
    return TreeLevel(tokens=draft_to_target[ids.reshape(-1)], scores=scores, parents=parents,
                     frontier=frontier)


def tree_select(levels: list[TreeLevel], root_token: torch.Tensor, num_nodes: int) -> DraftTree:
    """Keep the root plus the num_nodes-1 best candidates of all levels; build the verify tree.

    A child's cumulative score never exceeds its parent's, and candidates are laid out by depth,
    so a stable descending sort ranks every parent before its children: the selection is closed
    under ancestors without any fix-up.
    """
    device = root_token.device
    D = len(levels)
    tokens = torch.cat([lv.tokens for lv in levels])
    scores = torch.cat([lv.scores for lv in levels])
    sizes = [lv.tokens.shape[0] for lv in levels]
    starts = [sum(sizes[:i]) for i in range(D)]
    # Parents as global candidate indices (-1 = root); depth of each candidate (1-based).
    parents = torch.cat([levels[0].parents] + [lv.parents + starts[i - 1] for i, lv in enumerate(levels) if i > 0])
    depth = torch.cat([torch.full((s,), i + 1, dtype=torch.long, device=device) for i, s in enumerate(sizes)])
    n_keep = min(num_nodes - 1, tokens.shape[0])
    chosen = scores.sort(descending=True, stable=True).indices[:n_keep].sort().values  # [N-1], by depth
    # Global candidate index → node index (root = 0).
    node_of = torch.zeros(tokens.shape[0] + 1, dtype=torch.long, device=device)  # slot -1 → root 0
    node_of[chosen] = torch.arange(1, n_keep + 1, device=device)
    node_tokens = torch.cat([root_token.reshape(1).long(), tokens[chosen]])
    node_parents = torch.cat([torch.full((1,), -1, dtype=torch.long, device=device), node_of[parents[chosen]]])
    node_depths = torch.cat([torch.zeros(1, dtype=torch.long, device=device), depth[chosen]])
    return build_tree(node_tokens, node_parents, node_depths, D, max(lv.frontier.shape[0] for lv in levels))


def build_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, max_depth: int,
               max_children: int) -> DraftTree:
    """Derive the attention mask, retrieve paths and children table from parent pointers.

    Requires parents[i] < i for i > 0 (parents first). All on the device, no host sync.
    """
    device = tokens.device
    N = tokens.shape[0]
    ar = torch.arange(N, device=device)
    # One-hot parent matrix P[i, parent(i)]; ancestors-or-self = I + P + P² + … (depth ≤ max_depth).
    P = torch.zeros(N, N, device=device)
    P[1:].scatter_(1, parents[1:, None], 1.0)  # a scalar index_put would copy 1.0 host→device: a sync
    anc = torch.eye(N, device=device)
    step = torch.eye(N, device=device)
    for _ in range(max_depth):
        step = step @ P
        anc = anc + step
    attn_mask = anc > 0
    # paths[i, d] = the ancestor of i at depth d (or -1): one ancestor per depth by construction.
    at_depth = attn_mask[:, :, None] & (depths[None, :, None] == torch.arange(max_depth + 1, device=device))
    paths = torch.where(at_depth.any(1), (at_depth.long() * ar[None, :, None]).sum(1), -1)
    # children[i, r] = the r-th child of i in node order (node order = draft-score order per depth).
    is_child = parents[None, :] == ar[:, None]                            # [N, N]: j is a child of i
    rank = is_child.long().cumsum(-1) - 1
    slot = torch.where(is_child & (rank < max_children), rank, max_children)  # overflow column dropped
    children = torch.full((N, max_children + 1), -1, dtype=torch.long, device=device)
    children.scatter_(1, slot, ar[None, :].expand(N, N).masked_fill(~is_child, -1))
    return DraftTree(tokens=tokens, parents=parents, depths=depths, attn_mask=attn_mask,
                     paths=paths, children=children[:, :max_children])


def chain_tree(tokens: torch.Tensor) -> DraftTree:
    """A chain [x_n, d_1..d_k] as a degenerate tree (each node the only child of the previous)."""
    n = tokens.shape[0]
    ar = torch.arange(n, device=tokens.device)
    return build_tree(tokens.long(), ar - 1, ar, max(n - 1, 1), 1)


# ---------------------------------------------------------------------------------------------
# Tree acceptance
# ---------------------------------------------------------------------------------------------

def tree_greedy_accept(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance over a tree. target_logits [N, V] (row i = p at node i).

    Along every retrieve path, count how many nodes match the target's argmax at their parent;
    the longest wins (siblings carry distinct tokens, so the matched path is unique).
    Returns (accept_len [] int64, path [D+1] node ids root→last accepted, -1 padded beyond,
    next_token [] the argmax at the last accepted node).
    """
    am = target_logits.argmax(-1)                                  # [N]
    paths = tree.paths
    valid = paths >= 0
    safe = paths.clamp_min(0)
    cand = torch.where(valid, tree.tokens[safe], -1)               # [N, D+1]
    pred = am[safe]                                                # [N, D+1] target argmax at path nodes
    match = cand[:, 1:] == pred[:, :-1]                            # [N, D]
    acc = leading_true(match)                                     # [N]
    best = acc.argmax().reshape(1)                                 # tensor indices: no host sync
    a = acc.index_select(0, best)[0]
    depth_ar = torch.arange(paths.shape[1], device=paths.device)
    path = torch.where(depth_ar <= a, paths.index_select(0, best)[0], -1)
    return a, path, pred.index_select(0, best)[0].gather(0, a.reshape(1))[0]


def tree_sample_accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless acceptance over a tree whose children were picked deterministically (top-K).

    target_probs [B, N, V] warped target distributions at each node (B independent trials of the
    same tree). From the root: r = p at the current node; try its children in order, accepting
    child c with probability r(c)/Σr; on rejection set r(c) = 0. The first accepted child becomes
    the current node; if all are rejected (or there are none), the next token is drawn from r.
    Returns (accept_len [B], path [B, D+1] -1 padded, next_token [B]).
    """
    B, N, V = target_probs.shape
    device = target_probs.device
    D = tree.paths.shape[1] - 1
    K = tree.children.shape[1]
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)         # still descending
    a = torch.zeros(B, dtype=torch.long, device=device)
    path = torch.full((B, D + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    r = target_probs[:, 0].float().clone()                         # residual at the current node
    for depth in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        for s in range(K):
            c = tree.children[cur, s]                              # [B]
            trying = alive & ~moved & (c >= 0)
            tok = tree.tokens[c.clamp_min(0)]
            r_c = r[rows, tok]
            u = _uniform((B,), device, generator)
            ok = trying & (u * r.sum(-1) < r_c)
            # rejected: remove the child's token from the residual
            r[rows, tok] = torch.where(trying & ~ok, torch.zeros_like(r_c), r_c)
            moved = moved | ok
            cur = torch.where(ok, c, cur)
        a = a + moved.long()
        path[:, depth + 1] = torch.where(moved, cur, path[:, depth + 1])
        # on a move the residual restarts from p at the new node
        r = torch.where(moved[:, None], target_probs[rows, cur].float(), r)
        alive = alive & moved
    return a, path, sample(r, generator)
