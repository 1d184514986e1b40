"""The benchmark harness (attnkit.bench.harness) and the family files' case definitions.

Tiny cases only: timing arithmetic runs on a fake clock, memory accounting on allocations of
known size, outputs (JSON, table, PNG, CLI) on cases of a few milliseconds.
"""
import json
import math
import os

import pytest
import torch

from attnkit.bench import harness, hopfield, linear, softmax, sparse
from attnkit.bench.harness import Case, Impl, Unavailable

CPU = torch.device("cpu")
MiB = 2**20


class FakeClock:
    """A timer whose time moves only when an implementation 'runs'."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def runner(self, durations):
        """fn(inputs) that takes durations[0], durations[1], ... seconds (cycling)."""
        calls = [0]

        def fn(x):
            self.now += durations[calls[0] % len(durations)]
            calls[0] += 1
            return x["a"] * 2
        return fn


def tiny_inputs(device):
    return {"a": torch.arange(6.0, device=device).reshape(2, 3)}


def fake_case(clock, impls, flops=1e9):
    return Case("softmax", "fake", "fwd", {"N": 3}, flops, tiny_inputs, impls)


# ---------------------------------------------------------------------------------------------
# timing, FLOP/s and ratios


def test_median_flops_and_speedups_on_a_fake_clock():
    clock = FakeClock()
    impls = [
        Impl("attnkit[fast]", "attnkit", fn=clock.runner([0.002])),
        # durations cycle per call: one warmup, then 3, 1, 2 ms... the median of the timed calls is 2 ms
        Impl("attnkit[odd]", "attnkit", fn=clock.runner([0.100, 0.003, 0.001, 0.002])),
        Impl("peer A", "peer", fn=clock.runner([0.008])),
        Impl("peer B", "peer", fn=clock.runner([0.001])),
    ]
    rec = harness.run_case(fake_case(clock, impls), CPU, warmup=1, repeats=3, memory=False, timer=clock)
    rows = {r["impl"]: r for r in rec["results"]}
    assert rows["attnkit[fast]"]["times_s"] == pytest.approx([0.002] * 3)
    assert rows["attnkit[odd]"]["times_s"] == pytest.approx([0.003, 0.001, 0.002])
    assert rows["attnkit[odd]"]["median_s"] == pytest.approx(0.002)
    assert rows["attnkit[odd]"]["min_s"] == pytest.approx(0.001)
    assert rows["peer A"]["flops_per_s"] == pytest.approx(1e9 / 0.008)
    speed = {(r["attnkit"], r["peer"]): r["speedup"] for r in rec["ratios"]}
    assert speed == pytest.approx({
        ("attnkit[fast]", "peer A"): 4.0,
        ("attnkit[fast]", "peer B"): 0.5,
        ("attnkit[odd]", "peer A"): 4.0,
        ("attnkit[odd]", "peer B"): 0.5,
    })
    # displayed in declaration order even though peers run first
    assert [r["impl"] for r in rec["results"]] == ["attnkit[fast]", "attnkit[odd]", "peer A", "peer B"]


def test_max_time_caps_the_repeats_but_not_below_three():
    clock = FakeClock()
    step = lambda: clock.runner([0.5])({"a": torch.ones(1)})  # noqa: E731
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock, max_time=2.0)
    assert len(times) == 4
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock, max_time=0.1)
    assert len(times) == 3
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock)
    assert len(times) == 10
    start = clock.now  # a slow first warmup call is the only one
    times, _ = harness.time_calls(step, CPU, warmup=3, repeats=10, timer=clock, max_time=1.2)
    assert len(times) == 3 and clock.now - start == pytest.approx(0.5 * 4)
    start = clock.now
    times, _ = harness.time_calls(step, CPU, warmup=3, repeats=10, timer=clock, max_time=6.0)
    assert len(times) == 10 and clock.now - start == pytest.approx(0.5 * 13)


def test_short_calls_fill_a_share_of_max_time():
    clock = FakeClock()
    step = lambda: clock.runner([0.001])({"a": torch.ones(1)})  # noqa: E731
    start = clock.now
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock, max_time=2.0)
    # warm up for 2.0 / 40 = 50 ms (50 calls), then time 2.0 / 20 = 100 ms (100 calls)
    assert len(times) == 100
    assert clock.now - start == pytest.approx(0.001 * 150, abs=0.0011)
    # never past the cap, and an exact --repeats (no max_time) stays exact
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock, max_time=60.0)
    assert len(times) == harness.SHORT_CALL_MAX_REPEATS
    times, _ = harness.time_calls(step, CPU, warmup=1, repeats=10, timer=clock)
    assert len(times) == 10


def test_interleaved_rounds_let_the_load_hit_every_impl_alike():
    """A busy stretch while the peer's block runs makes block timing read 3x; the interleaved
    rounds (CPU bench runs) time both at the same load and report 1x, keeping the block figures."""
    clock = FakeClock()
    busy_until = [0.0]  # calls starting before this take 3x

    def runner(base):
        def fn(x):
            clock.now += base * (3 if clock.now < busy_until[0] else 1)
            return x["a"] * 2
        return fn

    impls = [Impl("attnkit[x]", "attnkit", fn=runner(0.001)), Impl("short", "attnkit", fn=runner(0.0005)),
             Impl("peer", "peer", fn=runner(0.001))]
    busy_until[0] = 0.004 * 3  # the peer's warmup and 3 timed calls (it runs first)
    rec = harness.run_case(fake_case(clock, impls), CPU, warmup=1, repeats=3, memory=False, timer=clock,
                           interleave=True)
    rows = {r["impl"]: r for r in rec["results"]}
    assert rows["peer"]["block_median_s"] == pytest.approx(0.003)
    assert rows["peer"]["median_s"] == pytest.approx(0.001)
    assert rows["peer"]["timing"] == "interleaved" and rows["peer"]["repeats"] == 3
    assert rows["peer"]["flops_per_s"] == pytest.approx(1e9 / 0.001)
    speed = {(r["attnkit"], r["peer"]): r["speedup"] for r in rec["ratios"]}
    assert speed == pytest.approx({("attnkit[x]", "peer"): 1.0, ("short", "peer"): 2.0})
    # without interleave the block figures are the ones reported
    busy_until[0] = clock.now + 0.004 * 3
    rec = harness.run_case(fake_case(clock, impls), CPU, warmup=1, repeats=3, memory=False, timer=clock)
    assert {(r["attnkit"], r["peer"]): r["speedup"] for r in rec["ratios"]}[("attnkit[x]", "peer")] == \
        pytest.approx(3.0)
    assert "timing" not in rec["results"][0]


def test_interleave_calls_spread_each_impls_count_over_the_rounds():
    """Rounds = the fewest timed calls of any row; an impl with more timed calls runs that many
    times over per round (its count spread over the rounds), every call timed but a short call's
    first one in each round."""
    clock = FakeClock()
    rows = [{"status": "ok", "times_s": [0.1] * 3, "median_s": 0.1, "flops_per_s": 10.0},
            {"status": "ok", "times_s": [0.005] * 30, "median_s": 0.005, "flops_per_s": 100.0},
            {"status": "skipped"}, None]
    order = []

    def step(name, seconds):
        def call():
            order.append(name)
            clock.now += seconds
        return call

    harness.interleave_rows(rows, [step("slow", 0.05), step("fast", 0.02), None, None], clock)
    # the short calls' block starts with one untimed call (waking the thread pool)
    assert order == (["slow"] + ["fast"] * 11) * 3
    assert rows[0]["times_s"] == pytest.approx([0.05] * 3) and rows[1]["repeats"] == 30
    assert rows[1]["median_s"] == pytest.approx(0.02) and rows[1]["flops_per_s"] == pytest.approx(25.0)
    assert rows[0]["block_times_s"] == [0.1] * 3 and rows[2] == {"status": "skipped"}


def test_skipped_unavailable_and_failing_impls_are_reported_not_raised():
    clock = FakeClock()

    def unavailable(x):
        raise Unavailable("no such thing here")

    def broken(x):
        raise RuntimeError("kernel exploded\nsecond line")

    impls = [
        Impl("attnkit[broken]", "attnkit", fn=broken),
        Impl("attnkit[reference]", "attnkit", fn=clock.runner([0.001]), skip="too big"),
        Impl("attnkit[ok]", "attnkit", fn=clock.runner([0.001])),
        Impl("peer gone", "peer", fn=unavailable),
        Impl("peer declared", "peer", unavailable="needs a GPU"),
        Impl("peer", "peer", fn=clock.runner([0.003])),
    ]
    rec = harness.run_case(fake_case(clock, impls), CPU, warmup=1, repeats=2, memory=False, timer=clock)
    rows = {r["impl"]: r for r in rec["results"]}
    assert rows["attnkit[broken]"]["status"] == "error"
    assert rows["attnkit[broken]"]["reason"] == "RuntimeError: kernel exploded"
    assert rows["attnkit[reference]"]["status"] == "skipped"
    assert rows["peer gone"] == {**rows["peer gone"], "status": "unavailable", "reason": "no such thing here"}
    assert rows["peer declared"]["reason"] == "needs a GPU"
    assert [(r["attnkit"], r["peer"]) for r in rec["ratios"]] == [("attnkit[ok]", "peer")]
    assert rec["ratios"][0]["speedup"] == pytest.approx(3.0)
    table = harness.format_table({"device": "cpu"}, [rec])
    assert "error: RuntimeError: kernel exploded" in table
    assert "skipped: too big" in table
    assert "unavailable: needs a GPU" in table
    assert "3.00x peer" in table


def test_outputs_are_checked_against_the_first_peer():
    impls = [
        Impl("attnkit[off]", "attnkit", fn=lambda x: x["a"] * 2 + 0.5),
        Impl("peer", "peer", fn=lambda x: x["a"] * 2),
        Impl("other function", "peer", fn=lambda x: x["a"] * 0, same_result=False),
    ]
    rec = harness.run_case(fake_case(None, impls), CPU, warmup=1, repeats=1, memory=False)
    rows = {r["impl"]: r for r in rec["results"]}
    assert rows["attnkit[off]"]["max_rel_diff"] == pytest.approx(0.5 / 10.0)
    assert rows["attnkit[off]"]["diff_baseline"] == "peer"
    assert "max_rel_diff" not in rows["other function"]


def test_max_rel_diff_over_tuples():
    a = (torch.tensor([1.0, 2.0]), torch.tensor([4.0]))
    b = (torch.tensor([1.0, 2.5]), torch.tensor([2.0]))
    assert harness.max_rel_diff(a, b) == pytest.approx(1.0)  # |4-2| / 2 beats |2-2.5| / 2.5
    assert harness.max_rel_diff(a, b[:1]) is None


def test_fwd_bwd_returns_gradients_and_does_not_accumulate():
    case = Case("linear", "grad", "fwd+bwd", {}, 1.0, lambda d: {"x": torch.tensor([1.0, -2.0, 3.0])},
                [], grad_inputs=("x",))
    impl = Impl("square", "peer", fn=lambda x: x["x"] ** 2)
    step = harness.prepare(case, impl, case.make_inputs(CPU), CPU)
    out1, grad1 = step()
    out2, grad2 = step()
    g = harness.seeded_randn((3,), torch.float32, CPU, seed=1234)  # the harness's output gradient
    torch.testing.assert_close(out1, torch.tensor([1.0, 4.0, 9.0]))
    torch.testing.assert_close(grad1, 2 * torch.tensor([1.0, -2.0, 3.0]) * g)
    torch.testing.assert_close(grad2, grad1)
    assert grad1 is not grad2


# ---------------------------------------------------------------------------------------------
# memory


def _alloc_known():
    a = torch.empty(MiB, dtype=torch.uint8).fill_(1)
    b = torch.empty(4 * MiB, dtype=torch.uint8).fill_(1)
    del b
    c = torch.empty(2 * MiB, dtype=torch.uint8).fill_(1)
    del c
    return a


def test_allocator_peak_counts_known_allocations_exactly():
    peak, retained = harness.allocator_peak(_alloc_known)
    assert peak == 5 * MiB
    assert retained == MiB


def test_measure_memory_cpu_fields():
    mem = harness.measure_memory(_alloc_known, CPU)
    assert mem["peak_bytes_allocator"] == 5 * MiB
    assert mem["peak_bytes"] >= 5 * MiB
    assert mem["retained_bytes"] == MiB
    assert mem["scratch_bytes"] == mem["peak_bytes"] - MiB


@pytest.mark.skipif(not harness._rss_hwm_available(), reason="needs a resettable VmHWM (/proc/self/clear_refs)")
def test_rss_growth_sees_memory_the_profiler_would_miss():
    # 64 MiB touched and freed inside the call: well above glibc's mmap threshold, so fresh pages.
    def step():
        x = torch.ones(64 * MiB, dtype=torch.uint8)
        del x

    assert harness.rss_peak_growth(step) >= 60 * MiB
    assert harness.rss_peak_growth(lambda: None) < 4 * MiB


# ---------------------------------------------------------------------------------------------
# outputs: JSON, table, PNG, command line


def _tiny_real_cases():
    def mm(x):
        return x["q"] @ x["k"].transpose(-1, -2)

    def make(device):
        return {"q": torch.randn(2, 8, 16, device=device), "k": torch.randn(2, 8, 16, device=device)}

    return [
        Case("softmax", "mm-fwd", "fwd", {"N": 8}, 2.0 * 2 * 8 * 8 * 16, make,
             [Impl("attnkit[fake]", "attnkit", fn=lambda x: torch.einsum("bnd,bmd->bnm", x["q"], x["k"])),
              Impl("torch matmul", "peer", fn=mm)]),
        Case("hopfield", "mm-fwd+bwd", "fwd+bwd", {"N": 8}, 3 * 2.0 * 2 * 8 * 8 * 16, make,
             [Impl("torch matmul", "peer", fn=mm), Impl("peer missing", "peer", unavailable="not here")],
             grad_inputs=("q", "k")),
    ]


def test_json_table_and_png(tmp_path):
    device = CPU
    records = harness.run_sweep(_tiny_real_cases(), device, warmup=1, repeats=3, progress=False)
    meta = harness.make_meta(device, quick=True, warmup=1, repeats=3, families=["softmax", "hopfield"],
                             memory=True, machine={"gemm_float32_gflops": 123.4})
    path = harness.write_json(tmp_path / "bench-cpu.json", meta, records)
    data = json.loads(path.read_text())
    assert set(data) == {"meta", "cases"}
    m = data["meta"]
    for key in ("schema", "date", "device", "device_name", "torch", "attnkit", "threads", "quick", "warmup",
                "repeats", "families", "speedup", "machine", "backends"):
        assert key in m, key
    assert m["device"] == "cpu" and m["schema"] == harness.SCHEMA
    assert m["backends"]["softmax"]["reference"]["usable"] is True
    first = data["cases"][0]
    assert {"family", "name", "label", "mode", "params", "flops", "notes", "results", "ratios"} <= set(first)
    ok = first["results"][0]
    for key in ("impl", "kind", "backend", "status", "reason", "repeats", "median_s", "min_s", "times_s",
                "flops_per_s", "peak_bytes", "peak_bytes_allocator", "retained_bytes", "scratch_bytes"):
        assert key in ok, key
    assert ok["status"] == "ok" and len(ok["times_s"]) == 3
    assert ok["flops_per_s"] == pytest.approx(first["flops"] / ok["median_s"])
    assert ok["retained_bytes"] == 2 * 8 * 8 * 4  # the [2, 8, 8] float32 output
    assert first["results"][0]["max_rel_diff"] < 1e-5
    assert first["ratios"][0]["speedup"] == pytest.approx(
        first["results"][1]["median_s"] / first["results"][0]["median_s"])
    bwd = data["cases"][1]["results"][0]
    assert bwd["retained_bytes"] >= 2 * (2 * 8 * 16 * 4)  # the two input gradients
    assert data["cases"][1]["results"][1]["status"] == "unavailable"

    table = harness.format_table(meta, records)
    assert "softmax/mm-fwd  [fwd]" in table and "hopfield/mm-fwd+bwd  [fwd+bwd]" in table
    assert "attnkit[fake]" in table and "x torch matmul" in table
    assert "unavailable: not here" in table

    png = harness.write_plot(tmp_path / "bench-cpu.png", meta, records)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_writes_json_png_and_prints_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "collect_cases", lambda families, quick, device: _tiny_real_cases()[:1])
    monkeypatch.setattr(harness, "machine_peaks", lambda device: {"gemm_float32_gflops": 1.0})
    from attnkit.__main__ import main

    assert main(["bench", "--family", "softmax", "--quick", "--out", str(tmp_path), "--repeats", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "softmax/mm-fwd" in out and "bench-cpu.json" in out
    data = json.loads((tmp_path / "bench-cpu.json").read_text())
    assert data["meta"]["repeats"] == 2 and data["meta"]["max_time_s"] is None
    assert len(data["cases"][0]["results"][0]["times_s"]) == 2
    assert (tmp_path / "bench-cpu.png").stat().st_size > 0


def test_cli_usage_and_argument_errors(capsys):
    from attnkit.__main__ import main

    assert main([]) == 0
    assert "python -m attnkit bench" in capsys.readouterr().out
    assert main(["frobnicate"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--family", "softmax,nope"])
    assert "unknown nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--repeats", "0"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            main(["bench", "--device", "cuda"])
        assert "no CUDA device" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the family files


def _params(cases):
    return [(c.mode, c.params) for c in cases]


def test_full_cases_match_the_issues():
    sm = _params(softmax.cases(quick=False, device=CPU))
    base = {"B": 1, "H": 8, "N": 4096, "D": 64}
    for mode in ("fwd", "fwd+bwd"):
        for causal in (False, True):
            assert (mode, {**base, "dtype": "float32", "causal": causal}) in sm
    assert ("fwd", {**base, "dtype": "bfloat16", "causal": False}) in sm
    masked = {(m, p["mask"]) for m, p in sm if "mask" in p}
    assert masked == {(m, k) for m in ("fwd", "fwd+bwd") for k in ("padding", "bool", "additive")}
    lin = [p for m, p in _params(linear.cases(quick=False, device=CPU)) if m == "fwd+bwd"]
    assert sorted(p["N"] for p in lin) == [4096, 16384]
    assert all(p["causal"] and p["feature_map"] == "elu" and p["D"] == 64 for p in lin)
    sp = _params(sparse.cases(quick=False, device=CPU))
    assert any(p["pattern"] == "strided(stride=64,causal=True)" and p["N"] == 4096 for _, p in sp)
    assert ("fwd+bwd", "star(relay=0,radius=1)") in {(m, p["pattern"]) for m, p in sp}
    hf = [p for _, p in _params(hopfield.cases(quick=False, device=CPU))]
    assert {"B": 1, "H": 1, "S": 1024, "N": 16384, "D": 64, "steps": 3, "dtype": "float32"} in hf
    assert any(p["S"] == 1 and p["N"] == 262144 for p in hf)
    assert ("fwd+bwd", 256) in {(c.mode, c.params["S"]) for c in hopfield.cases(quick=False, device=CPU)}


def test_reference_is_skipped_for_big_cases_and_says_so():
    big = softmax.make_case(1, 8, 4096, 64, torch.float32, False, "fwd", CPU)
    small = softmax.make_case(1, 8, 1024, 64, torch.float32, False, "fwd", CPU)
    ref_big = [i for i in big.impls if i.name == "attnkit[reference]"]
    ref_small = [i for i in small.impls if i.name == "attnkit[reference]"]
    assert ref_big and "materializes a 512.0 MiB score matrix" in ref_big[0].skip
    assert ref_small and ref_small[0].skip == ""


def test_quick_cases_are_small():
    for module in (softmax, linear, sparse, hopfield):
        for case in module.cases(quick=True, device=CPU):
            assert case.flops < 1e10, case.label


def test_flop_counts():
    assert softmax.visible_pairs(4, 4, causal=True) == 10
    assert softmax.visible_pairs(5, 3, causal=True) == 1 + 2 + 3 + 3 + 3
    assert softmax.visible_pairs(3, 5, causal=True) == 6
    assert softmax.flops(1, 8, 4096, 4096, 64, 64, False, "fwd") == 4 * 8 * 4096**2 * 64
    assert softmax.flops(1, 1, 4, 4, 2, 2, True, "fwd+bwd") == 3.5 * 4 * 10 * 2
    assert linear.flops(1, 8, 4096, 64, 64, "fwd+bwd") == 3 * 4 * 8 * 4096 * 64 * 64
    case = sparse.make_case("strided", {"stride": 4, "causal": True}, 1, 2, 33, 8, torch.float32, "fwd", CPU)
    assert case.flops == 4 * 2 * 8 * int(sparse.strided_mask(33, 4).sum())


def test_sparse_masks_follow_the_definitions():
    n = 29
    for stride in (1, 3, 7):
        for causal in (True, False):
            want = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                for j in range(n):
                    near = 0 <= i - j <= stride if causal else abs(i - j) <= stride
                    ok = near or (i - j) % stride == 0
                    want[i, j] = ok and (j <= i or not causal)
            assert torch.equal(sparse.strided_mask(n, stride, causal), want)
    for stride, summary in ((4, 1), (5, 5), (8, 3)):
        want = torch.tensor([[(i // stride == j // stride or j % stride >= stride - summary) and j <= i
                              for j in range(n)] for i in range(n)])
        assert torch.equal(sparse.fixed_mask(n, stride, summary, causal=True), want)
    for relay in (0, 13, n - 1):
        for radius in (1, 2):
            for cyclic in (False, True):
                sats = [p for p in range(n) if p != relay]
                num = {p: k for k, p in enumerate(sats)}
                want = torch.zeros(n, n, dtype=torch.bool)
                for i in range(n):
                    for j in range(n):
                        if i == relay or j == relay:
                            want[i, j] = True
                        else:
                            d = abs(num[i] - num[j])
                            if cyclic:
                                d = min(d, n - 1 - d)
                            want[i, j] = d <= radius
                assert torch.equal(sparse.star_mask(n, relay, radius, cyclic), want)
                assert torch.equal(sparse.star_mask(n, relay, radius, cyclic, causal=True), want & torch.ones(
                    n, n, dtype=torch.bool).tril())


def test_linear_peers_agree_with_a_loop():
    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    fq, fk = linear.phi(q), linear.phi(k)
    for causal in (True, False):
        want = torch.empty_like(v)
        for i in range(9):
            js = range(i + 1) if causal else range(9)
            w = torch.stack([(fq[..., i, :] * fk[..., j, :]).sum(-1) for j in js], -1)  # [1, 2, |S|]
            vs = torch.stack([v[..., j, :] for j in js], -2)
            want[..., i, :] = (w.unsqueeze(-1) * vs).sum(-2) / (w.sum(-1, keepdim=True) + linear.EPS)
        torch.testing.assert_close(linear.quadratic(q, k, v, causal), want)
        torch.testing.assert_close(linear.cumsum_outer(q, k, v, causal), want)


def test_hopfield_peers_agree_with_the_definition():
    state = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    stored = torch.randn(1, 2, 11, 8, dtype=torch.float64)
    beta = 0.7
    xi = state
    for _ in range(3):
        p = torch.exp(beta * torch.einsum("bhsd,bhnd->bhsn", xi, stored))
        xi = torch.einsum("bhsn,bhnd->bhsd", p / p.sum(-1, keepdim=True), stored)
    torch.testing.assert_close(hopfield.plain_update(state, stored, beta, 3), xi)
    torch.testing.assert_close(hopfield.sdpa_update(state, stored, beta, 3), xi)
    lse = torch.log(torch.exp(beta * torch.einsum("bhsd,bhnd->bhsn", state, stored)).sum(-1))
    # M = max_i |x_i| over the stored patterns of each (batch, head)
    per_head_m = torch.stack([max(stored[0, h, i].norm() for i in range(11)) for h in range(2)]).view(1, 2, 1)
    want = -lse / beta + 0.5 * (state**2).sum(-1) + math.log(11) / beta + 0.5 * per_head_m**2
    torch.testing.assert_close(hopfield.plain_energy(state, stored, beta), want)


def test_flex_failure_is_reported_as_unavailable(monkeypatch):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("inductor cannot build here")

    monkeypatch.setattr(sparse, "_FLEX", {})
    monkeypatch.setattr(torch, "compile", broken_compile)
    case = sparse.make_case("strided", {"stride": 4, "causal": True}, 1, 2, 16, 8, torch.float32, "fwd", CPU)
    case.impls = [i for i in case.impls if i.kind == "peer"]
    rec = harness.run_case(case, CPU, warmup=1, repeats=1, memory=False)
    rows = {r["impl"]: r for r in rec["results"]}
    flex = rows["FlexAttention (BlockMask)"]
    assert flex["status"] == "unavailable"
    assert "inductor cannot build here" in flex["reason"]
    assert rows["torch SDPA (dense mask)"]["status"] == "ok"
    assert rows["torch SDPA (dense causal)"]["status"] == "ok"
    assert "max_rel_diff" not in rows["torch SDPA (dense causal)"]


def test_the_cpu_is_recorded_with_its_vendor_and_isa():
    # Issue 25: the JSON's meta and the printed header say which CPU (vendor, AVX-512, AMX) ran.
    from attnkit._cpuinfo import parse_cpuinfo

    xeon = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8488C\n"
            "flags\t\t: fpu avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile\n\n"
            "processor\t: 1\nmodel name\t: another\n")
    assert parse_cpuinfo(xeon) == {"model": "Intel(R) Xeon(R) Platinum 8488C", "vendor": "Intel",
                                   "isa": ["AVX2", "FMA", "AVX-512F", "AVX-512BW", "AVX-512 BF16",
                                           "AVX-512 FP16", "AMX tile", "AMX BF16"]}
    epyc = "vendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9R45\nflags\t\t: fpu avx2 fma\n"
    assert parse_cpuinfo(epyc)["vendor"] == "AMD" and parse_cpuinfo(epyc)["isa"] == ["AVX2", "FMA"]
    meta = harness.make_meta(torch.device("cpu"), quick=True, warmup=1, repeats=1, families=["softmax"],
                             memory=False, machine=None)
    assert set(meta["cpu"]) == {"model", "vendor", "isa"}
    # the GPU dispatch table's keys (attnkit/_gpu_table.py): none on a CPU run; attnkit's switches
    assert meta["capability"] is None and all(k.startswith("ATTNKIT_") for k in meta["env"])
    assert any(line.startswith("cpu: ") and meta["cpu"]["model"] in line for line in harness.format_header(meta))
    # issue 25: the softmax forward's tile-GEMM path per dtype, chosen at run time
    if meta["cpu_kernels_softmax"]:
        assert any(line.startswith("attnkit cpu softmax: forward, backward and decode tile GEMMs chosen at run time")
                   for line in harness.format_header(meta))


def test_a_brgemm_default_gets_a_native_tiles_row_timed_under_native(monkeypatch):
    """Where the cpu backend's default for the dtype is brgemm (a CPU with AMX), attnkit_impls
    adds ``attnkit[cpu] native tiles``, whose whole timed call -- forward and backward -- runs
    with ATTNKIT_CPU_GEMM=native; the variable is restored after each call."""
    seen = []

    class Record(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("fwd", os.environ.get("ATTNKIT_CPU_GEMM")))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            seen.append(("bwd", os.environ.get("ATTNKIT_CPU_GEMM")))
            return g * 2

    monkeypatch.setattr(harness, "auto_cpu_gemm", lambda family, dtype: "brgemm (AMX, VNNI)")
    monkeypatch.delenv("ATTNKIT_CPU_GEMM", raising=False)
    impls = harness.attnkit_impls("softmax", CPU, lambda backend: lambda x: Record.apply(x["a"]),
                                  dtype=torch.bfloat16)
    names = [i.name for i in impls]
    assert "attnkit[cpu] native tiles" in names and names.index("attnkit[cpu] native tiles") == \
        names.index("attnkit[cpu]") + 1
    forced = impls[names.index("attnkit[cpu] native tiles")]
    assert forced.cpu_gemm == "native" and forced.backend == "cpu"
    case = Case("softmax", "t", "fwd+bwd", {}, 1.0, tiny_inputs, [forced], grad_inputs=("a",))
    harness.prepare(case, forced, case.make_inputs(CPU), CPU)()
    assert seen == [("fwd", "native"), ("bwd", "native")]
    assert "ATTNKIT_CPU_GEMM" not in os.environ
    # a native default, or no dtype given: no second row
    monkeypatch.setattr(harness, "auto_cpu_gemm", lambda family, dtype: "native")
    assert "attnkit[cpu] native tiles" not in [i.name for i in harness.attnkit_impls(
        "softmax", CPU, lambda backend: lambda x: x["a"], dtype=torch.bfloat16)]
    monkeypatch.setattr(harness, "auto_cpu_gemm", lambda family, dtype: "brgemm (AMX, VNNI)")
    assert "attnkit[cpu] native tiles" not in [i.name for i in harness.attnkit_impls(
        "softmax", CPU, lambda backend: lambda x: x["a"])]


def test_auto_cpu_gemm_reads_the_auto_choice(monkeypatch):
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")  # a forced path is not what auto picks
    from attnkit import _dispatch

    if not hasattr(_dispatch.native(), "cpu_gemm_path"):
        pytest.skip("attnkit._C is not built")
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "auto")
    want = _dispatch.native().cpu_gemm_path("bfloat16")
    monkeypatch.setenv("ATTNKIT_CPU_GEMM", "native")
    assert harness.auto_cpu_gemm("softmax", torch.bfloat16) == want
    assert os.environ["ATTNKIT_CPU_GEMM"] == "native"
    assert harness.auto_cpu_gemm("no such family", torch.bfloat16) == ""
