"""parallel.py: batch slicing, single-process no-ops, and FSDP2 on 2 CPU ranks (gloo) == one process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftport.train import parallel
from draftport.errors import DraftportError

_MODEL = """
import torch

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8, bias=False)
        self.midlayer = Block()
        self.lm_head = torch.nn.Linear(8, 5, bias=False)
    def forward(self, x):
        return self.lm_head(self.midlayer(self.fc(x)))

def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 8, generator=g)
    y = torch.randint(0, 5, (4, 3), generator=g)
    w = (torch.rand(4, 3, generator=g) > 0.3).float()  # a loss mask: counts differ between ranks
    return x, y, w

def loss_sum(model, x, y, w):
    ce = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    return (ce * w.flatten()).sum()
"""

_WORKER = """
import json, os, sys
import torch
from safetensors.torch import save_file
sys.path.insert(0, os.path.dirname(__file__))
from netdef import Net, data, loss_sum
from draftport.train import parallel
from draftport.train import resume

info = parallel.init_distributed("cpu")
torch.manual_seed(0)
model = Net()
parallel.apply_fsdp(model, info)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y, w = data()
sl = parallel.rank_slice(x.shape[0], info)
losses = []
for _ in range(3):
    count = parallel.all_reduce_sum(w[sl].sum().clone(), info)  # global normaliser
    local = loss_sum(model, x[sl], y[sl], w[sl]) / count
    opt.zero_grad()
    (local * info.world_size).backward()  # FSDP averages gradients over ranks; undo it
    opt.step()
    losses.append(float(parallel.all_reduce_sum(local.detach().clone(), info)))
msd, _ = resume.gather_full_state(model, opt)
echo = parallel.broadcast_json({"rank": info.rank, "text": "héllo"} if info.is_main else None, info)
rngs = parallel.all_gather_rng(torch.get_rng_state(), info)
if info.is_main:
    save_file({k: v.contiguous() for k, v in msd.items()}, os.environ["OUT_FILE"])
    print(json.dumps({"losses": losses, "echo": echo, "n_rng": len(rngs),
                      "sharded": type(model.fc.weight).__name__}))
del model, opt, msd  # as run_train's frame drops them before its shutdown
parallel.shutdown(info)
"""


@settings(max_examples=40, deadline=None)
@given(n=st.integers(8, 400), batch=st.integers(1, 16), group=st.integers(1, 12), seed=st.integers(0, 5),
       epoch=st.integers(0, 3))
def test_grouped_batches_are_a_length_sorted_partition_of_the_epoch(n, batch, group, seed, epoch):
    """Length grouping keeps what random batches guarantee (each epoch's kept samples exactly once, the same
    remainder dropped, a pure function of the step) and only regroups them: inside each window of `group`
    batches the samples are sorted longest first, so a batch pads to little more than its own samples."""
    from draftport.data.store import sample_order
    from draftport.train.parallel import epoch_batch

    per_epoch = n // batch
    if per_epoch < 1:
        return
    lengths = np.random.default_rng(seed + 100).integers(5, 800, n)
    steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
    got = [epoch_batch(s, n, batch, seed, lengths=lengths, group=group) for s in steps]
    assert all(e == epoch and j == s - epoch * per_epoch for (_, e, j), s in zip(got, steps))
    rows = np.stack([b for b, _, _ in got])
    kept = sample_order(n, seed=seed, epoch=epoch)[:per_epoch * batch]
    assert sorted(rows.ravel().tolist()) == sorted(kept.tolist())  # the random batches' samples, regrouped
    again = epoch_batch(steps[-1], n, batch, seed, lengths=lengths.copy(), group=group)[0]
    assert np.array_equal(again, rows[-1])  # resuming needs only the step
    # each window of `group` batches is one sorted run: a batch's lengths never interleave another's there
    for w in range(0, per_epoch, group):
        win = kept[w * batch:min(w + group, per_epoch) * batch]
        mine = [b for b in rows if set(b.tolist()) <= set(win.tolist())]
        assert len(mine) == len(win) // batch
        spans = sorted(((int(lengths[b].max()), int(lengths[b].min())) for b in mine), reverse=True)
        assert all(hi_lo[1] >= nxt[0] for hi_lo, nxt in zip(spans, spans[1:]))  # ranges never overlap
    # group 0 (or no lengths): exactly the random batches
    assert np.array_equal(epoch_batch(steps[0], n, batch, seed, lengths=lengths, group=0)[0], kept[:batch])
    assert np.array_equal(epoch_batch(steps[0], n, batch, seed)[0], kept[:batch])


def test_grouping_cuts_padding_on_chat_like_lengths():
    """What the option is for, on a chat-like length mix (most answers short, a long tail to the 768 cut):
    random batches of 64 fill about 35 % of their padded tokens, windows of 32 batches about 96 %."""
    from draftport.train.parallel import epoch_batch

    rng = np.random.default_rng(0)
    lengths = np.minimum(768, (rng.lognormal(5.3, 0.6, 8192)).astype(np.int64) + 20)
    fill = {}
    for group in (0, 32):
        rows = [epoch_batch(s, len(lengths), 64, 0, lengths=lengths, group=group)[0] for s in range(128)]
        fill[group] = sum(int(lengths[b].sum()) for b in rows) / sum(64 * int(lengths[b].max()) for b in rows)
    assert fill[0] < 0.45 and fill[32] > 0.9


def test_rank_slice_splits_global_batch():
    infos = [parallel.DistInfo(rank=r, world_size=4) for r in range(4)]
    assert [parallel.rank_slice(8, i) for i in infos] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(DraftportError, match="not divisible"):
        parallel.rank_slice(6, infos[0])


def test_single_process_is_plain():
    old = {k: os.environ.pop(k, None) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    try:
        info = parallel.init_distributed("cpu")
    finally:
        os.environ.update({k: v for k, v in old.items() if v is not None})
    assert not info.distributed and info.is_main and info.device == torch.device("cpu")
    m = torch.nn.Linear(2, 2)
    assert parallel.apply_fsdp(m, info) is m and type(m.weight) is torch.nn.Parameter
    t = torch.tensor([3.0])
    assert parallel.all_reduce_sum(t, info) is t and parallel.broadcast_json({"a": 1}, info) == {"a": 1}


@pytest.mark.slow
def test_fsdp_two_cpu_ranks_equal_one_process(tmp_path):
    (tmp_path / "netdef.py").write_text(_MODEL)
    (tmp_path / "worker.py").write_text(_WORKER)
    out_file = tmp_path / "w.safetensors"
    env = dict(os.environ, OUT_FILE=str(out_file), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           "--standalone", str(tmp_path / "worker.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["echo"] == {"rank": 0, "text": "héllo"} and res["n_rng"] == 2 and res["sharded"] == "DTensor"

    # the same three steps in one process on the whole batch
    ns: dict = {}
    exec(textwrap.dedent(_MODEL), ns)
    torch.manual_seed(0)
    model = ns["Net"]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y, w = ns["data"]()
    losses = []
    for _ in range(3):
        loss = ns["loss_sum"](model, x, y, w) / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    from safetensors.torch import load_file
    got = load_file(str(out_file))
    # fp32 throughout; the only difference is the summation order of the two ranks' partial sums
    assert losses == pytest.approx(res["losses"], rel=1e-5, abs=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
