"""economics: the seed's napkin arithmetic, finite depth, the inverse τ → α, bad input, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from draftport import economics as eco
from draftport.verbs import economics as econ_verb
from draftport.cli import main as cli_main
from draftport.errors import DraftportError

SEED = ["--cycle-ms", "30", "--accept-len", "2.0", "--baseline-tok-s", "82", "--target-tok-s", "150"]


def run_json(capsys, argv):
    assert cli_main(["economics", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out)  # exactly one JSON object on stdout, nothing else


def test_seed_unbounded(capsys):
    d = run_json(capsys, SEED)
    assert round(d["tok_s"], 1) == 66.7
    assert round(d["break_even_accept_len"], 2) == 2.46
    assert d["required_accept_len"] == pytest.approx(4.5)
    assert d["required_alpha"] == pytest.approx(7 / 9, abs=1e-12)  # 1/(1−α) = 4.5
    assert round(d["required_alpha"], 3) == 0.778
    assert d["alpha"] == pytest.approx(0.5, abs=1e-12)  # 1/(1−α) = 2
    assert d["speedup"] == pytest.approx(2.0 / 0.030 / 82)
    assert d["reachable"] is True
    assert d["cycle_ms"] == 30.0
    assert d["depth"] is None


def test_seed_depth3_unreachable(capsys):
    d = run_json(capsys, [*SEED, "--depth", "3"])
    assert d["reachable"] is False  # a 3-step chain gives τ ≤ 4 < 4.5
    assert d["min_depth"] == 4
    assert "required_alpha" not in d  # no α reaches it: left out, not null or NaN
    assert round(d["tok_s"], 1) == 66.7  # the rest of the answer is unchanged
    # α for τ = 2 at depth 3: 1 + α + α² + α³ = 2
    a = d["alpha"]
    assert 1 + a + a * a + a ** 3 == pytest.approx(2.0, abs=1e-12)


def test_finite_depth_reachable_matches_brentq():
    for depth, tau in [(1, 1.7), (3, 3.2), (5, 2.0), (7, 7.9), (64, 40.0)]:
        a = eco.alpha_for_accept_len(tau, depth)
        ref = brentq(lambda x: sum(x ** i for i in range(depth + 1)) - tau, 0.0, 1.0, xtol=1e-15)
        assert a == pytest.approx(ref, abs=1e-10)
        assert eco.accept_len_from_alpha(a, depth) == pytest.approx(tau, rel=1e-12)


def test_chain_depth_table():
    """A chain cut at d accepts min(a, d): τ_d adds the per-position acceptances up to d; the verify of
    d + 1 tokens lies on the line between the 1-token step and the measured k + 1; d drafter steps."""
    rows = eco.chain_depth_table([0.5, 0.25, 0.1], decode_ms=2.0, verify_ms=2.3, draft_ms=0.2, overhead_ms=0.1)
    assert [r["depth"] for r in rows] == [1, 2, 3]
    assert [r["accept_len"] for r in rows] == pytest.approx([1.5, 1.75, 1.85])
    assert [r["cycle_ms"] for r in rows] == pytest.approx([2.1 + 0.2 + 0.1, 2.2 + 0.4 + 0.1, 2.3 + 0.6 + 0.1])
    assert rows[-1]["tok_s"] == pytest.approx(eco.tok_per_s(1.85, eco.cycle_time_ms(2.3, 0.2, 3, 0.1)))
    assert max(rows, key=lambda r: r["tok_s"])["depth"] == 2   # 625 vs 648 vs 617 tok/s: the third draft costs more than it brings
    assert eco.chain_depth_table([], 2.0, 2.3, 0.2) == []


def test_closed_form_edges():
    assert eco.accept_len_from_alpha(0.0, 3) == 1.0
    assert eco.accept_len_from_alpha(1.0, 3) == 4.0
    assert eco.accept_len_from_alpha(0.5, None) == 2.0
    assert eco.accept_len_from_alpha(0.5, 2) == pytest.approx(1.75)
    assert eco.accept_len_from_alpha(1 - 1e-12, 3) == pytest.approx(4.0, rel=1e-9)  # no cancellation
    assert eco.alpha_for_accept_len(4.0, 3) == 1.0  # exactly k+1: every draft accepted
    assert eco.alpha_for_accept_len(4.0001, 3) is None
    assert eco.alpha_for_accept_len(0.8, 3) == 0.0  # goal met without any accepted draft
    assert [eco.min_depth_for(t) for t in (0.5, 1.0, 1.5, 4.0, 4.5, 5.0)] == [0, 0, 1, 3, 4, 4]


def test_goal_below_one_token_a_cycle(capsys):
    d = run_json(capsys, ["--cycle-ms", "10", "--target-tok-s", "50", "--depth", "2"])
    assert d["required_accept_len"] == pytest.approx(0.5)
    assert d["required_alpha"] == 0.0 and d["reachable"] is True and d["min_depth"] == 0


def test_verify_form_and_what_if(capsys):
    d = run_json(capsys, ["--verify-ms", "24", "--draft-ms", "1.5", "--overhead-ms", "1.5", "--depth", "3",
                          "--accept-len", "2.5", "--baseline-tok-s", "82"])
    assert d["cycle_ms"] == pytest.approx(24 + 3 * 1.5 + 1.5)
    assert d["tok_s"] == pytest.approx(2.5 / 0.030)
    rows = d["what_if"]
    assert [r["verify_ms"] for r in rows] == pytest.approx([24 * f for f in econ_verb.WHAT_IF_FACTORS])
    for r in rows:  # only the verify pass changes; draft and overhead stay
        assert r["cycle_ms"] == pytest.approx(r["verify_ms"] + 6.0)
        assert r["tok_s"] == pytest.approx(2.5 / (r["cycle_ms"] / 1000))
        assert r["break_even_accept_len"] == pytest.approx(82 * r["cycle_ms"] / 1000)
        assert r["speedup"] == pytest.approx(r["tok_s"] / 82)
    measured = rows[econ_verb.WHAT_IF_FACTORS.index(1.0)]
    assert measured["tok_s"] == pytest.approx(d["tok_s"])
    assert "required_accept_len" not in d and "reachable" not in d  # no goal given


def test_only_what_inputs_allow(capsys):
    d = run_json(capsys, ["--cycle-ms", "30"])
    assert set(d) == {"cycle_ms", "depth", "what_if"}
    assert all(set(r) == {"verify_ms", "cycle_ms"} for r in d["what_if"])


@pytest.mark.parametrize("argv, needle", [
    (["--cycle-ms", "30", "--accept-len", "0.9"], "--accept-len"),
    (["--cycle-ms", "0"], "--cycle-ms"),
    (["--cycle-ms", "-5"], "--cycle-ms"),
    (["--cycle-ms", "nan"], "--cycle-ms"),
    (["--verify-ms", "0", "--draft-ms", "1", "--depth", "3"], "--verify-ms"),
    (["--verify-ms", "20", "--draft-ms", "-1", "--depth", "3"], "--draft-ms"),
    (["--verify-ms", "20", "--draft-ms", "1", "--depth", "3", "--overhead-ms", "-1"], "--overhead-ms"),
    (["--cycle-ms", "30", "--verify-ms", "20"], "not both"),
    (["--cycle-ms", "30", "--overhead-ms", "2"], "not both"),
    (["--verify-ms", "20", "--draft-ms", "1"], "--depth"),
    (["--verify-ms", "20", "--depth", "3"], "--draft-ms"),
    ([], "no cycle time"),
    (["--cycle-ms", "30", "--depth", "0"], "--depth"),
    (["--cycle-ms", "30", "--baseline-tok-s", "0"], "--baseline-tok-s"),
    (["--cycle-ms", "30", "--target-tok-s", "-1"], "--target-tok-s"),
    (["--cycle-ms", "30", "--depth", "3", "--accept-len", "4.5"], "at most 4"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, needle):
    """A value out of its flag's range is the parser's error (cli.Number), a combination the config's: both one
    line, exit 2; the config refuses the same values when built directly."""
    try:
        rc = cli_main(["economics", *argv])
    except SystemExit as exc:   # the parser's exit
        rc = exc.code
    assert rc == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("draftport") and "\n" not in err and needle in err
    with pytest.raises(DraftportError):
        econ_verb.compute(econ_verb.EconomicsConfig(**_cfg_kwargs(argv)))


def _cfg_kwargs(argv):
    """The flags as config fields, without the parser (whose range types refuse some of them first)."""
    return {flag[2:].replace("-", "_"): int(value) if flag == "--depth" else float(value)
            for flag, value in zip(argv[::2], argv[1::2])}


def test_human_output_tables(capsys):
    assert cli_main(["economics", *SEED, "--depth", "3"]) == 0
    out = capsys.readouterr().out
    assert "66.7" in out and "2.46" in out and "4.50" in out
    assert "what if" in out and "break-even" in out
    for factor in econ_verb.WHAT_IF_FACTORS:  # one what-if row per verify time
        assert f"{30 * factor:.2f}" in out


def test_subprocess_json_without_torch():
    code = ("import sys; import draftport.cli as c; rc = c.main(['economics', *sys.argv[1:]]);"
            "assert 'torch' not in sys.modules and 'scipy' not in sys.modules, 'heavy import';"
            "sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, *SEED, "--depth", "3", "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["reachable"] is False and d["min_depth"] == 4
    proc = subprocess.run([sys.executable, "-m", "draftport", "economics", "--cycle-ms", "-1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1


# ---------------------------------------------------------------------------------------------
# Properties.

alphas = st.floats(min_value=0.0, max_value=0.999, allow_nan=False)
depths = st.one_of(st.none(), st.integers(min_value=1, max_value=40))


@settings(max_examples=200, deadline=None)
@given(a1=alphas, a2=alphas, depth=depths)
def test_tau_increasing_in_alpha(a1, a2, depth):
    lo, hi = sorted((a1, a2))
    assert eco.accept_len_from_alpha(lo, depth) <= eco.accept_len_from_alpha(hi, depth) + 1e-12


@settings(max_examples=200, deadline=None)
@given(a=alphas, depth=depths)
def test_inverse_round_trip(a, depth):
    tau = eco.accept_len_from_alpha(a, depth)
    back = eco.alpha_for_accept_len(tau, depth)
    assert eco.accept_len_from_alpha(back, depth) == pytest.approx(tau, rel=1e-9)
    if depth is None or a < 0.99:  # α is well determined where τ(α) is not flat
        assert back == pytest.approx(a, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(a=alphas, depth=st.integers(min_value=1, max_value=40))
def test_deeper_chain_never_worse(a, depth):
    t = eco.accept_len_from_alpha(a, depth)
    assert t <= eco.accept_len_from_alpha(a, depth + 1) + 1e-12
    assert t <= eco.accept_len_from_alpha(a, None) + 1e-12
    assert t <= depth + 1 + 1e-12


@settings(max_examples=200, deadline=None)
@given(c1=st.floats(1.0, 500.0), c2=st.floats(1.0, 500.0), tau=st.floats(1.0, 9.0),
       b=st.floats(1.0, 1000.0))
def test_rates_monotone_in_cycle_time(c1, c2, tau, b):
    fast, slow = sorted((c1, c2))
    assert eco.tok_per_s(tau, fast) >= eco.tok_per_s(tau, slow)
    assert eco.break_even_accept_len(b, fast) <= eco.break_even_accept_len(b, slow)
    # at exactly break-even τ, speculation matches the baseline
    assert eco.speedup(eco.break_even_accept_len(b, fast), fast, b) == pytest.approx(1.0)


@settings(max_examples=100, deadline=None)
@given(tau=st.floats(1.0, 30.0), depth=st.integers(1, 40))
def test_reachability_consistent_with_min_depth(tau, depth):
    a = eco.alpha_for_accept_len(tau, depth)
    assert (a is not None) == (tau <= depth + 1)
    assert (depth >= eco.min_depth_for(tau)) == (tau <= depth + 1)


# ---------------------------------------------------------------------------------- the capture store

def test_kimi_k25_store_arithmetic():
    """Kimi-K2.5 (hidden 7168), three aux layers and the final state: ≈ 57 KB a token in bf16, so 500k samples
    of 1k tokens are ≈ 29 TB; fp8 halves the states and adds a scale per state."""
    bpt = eco.bytes_per_token(3, 7168)
    assert bpt == 2 * 4 * 7168 + 5 == 57_349
    assert eco.bytes_per_token(3, 7168, "fp8") == 4 * 7168 + 4 * 4 + 5
    assert eco.store_bytes(100_000, 1000, 3, 7168) == 100_000 * 1000 * bpt
    assert round(eco.store_bytes(500_000, 1000, 3, 7168) / 1e12, 1) == 28.7
    assert round(eco.store_bytes(500_000, 1000, 3, 7168, "fp8") / 1e12, 1) == 14.3
    # a smaller store dtype is smaller whatever the shape
    for n, h in ((1, 64), (3, 640), (4, 12288)):
        assert eco.bytes_per_token(n, h, "fp8") < eco.bytes_per_token(n, h) == 2 * (n + 1) * h + 5


def test_what_the_disk_allows():
    assert eco.capture_choice(10, 5, None) == "bf16"
    assert eco.capture_choice(10, 5, 10) == "bf16"
    assert eco.capture_choice(10, 5, 9) == "fp8"
    assert eco.capture_choice(10, 5, 4) == "online"
    assert eco.online_target_passes(3) == 3


def test_economics_store_question(capsys):
    d = run_json(capsys, ["--hidden-size", "7168", "--disk-tb", "20", "--epochs", "3"])["store"]
    assert d["bytes_per_token"] == {"bf16": 57_349, "fp8": 28_693}
    assert [(r["samples"], r["choice"]) for r in d["rows"]] == [(100_000, "bf16"), (500_000, "fp8")]
    assert d["rows"][1]["bf16_bytes"] == 500_000 * 1000 * 57_349 and d["online_target_passes"] == 3
    d = run_json(capsys, ["--hidden-size", "7168", "--samples", "2M", "--tokens-per-sample", "2000",
                          "--disk-tb", "100"])["store"]
    assert d["rows"] == [{"samples": 2_000_000, "tokens": 4_000_000_000, "bf16_bytes": 4e9 * 57_349,
                          "fp8_bytes": 4e9 * 28_693, "choice": "online"}]
    both = run_json(capsys, SEED + ["--hidden-size", "640"])  # beside the speed figures
    assert round(both["tok_s"], 1) == 66.7 and both["store"]["bytes_per_token"]["bf16"] == 2 * 4 * 640 + 5
    assert cli_main(["economics", "--hidden-size", "7168"]) == 0
    assert "28.7 TB" in capsys.readouterr().out
