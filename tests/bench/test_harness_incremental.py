"""The streaming side of ``python -m attnkit bench`` (attnkit.bench.live and the harness's
sweep hooks): each case printed as it finishes, the JSON rewritten after every implementation,
``--deadline`` (and the watchdog behind ``--grace``), Ctrl-C, a lost CUDA context, targets, case
selection, and the GPU case lists and peers that can be checked without a GPU.

Tiny cases only: implementations that sleep a few tens of milliseconds or compute a matmul.
"""
import json
import os
import subprocess
import sys
import textwrap
import time
import types

import pytest
import torch

from attnkit.bench import harness, hopfield, linear, live, softmax, sparse
from attnkit.bench.harness import Case, Impl

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


def _inputs(device):
    return {"a": torch.ones(4, device=device)}


def sleepy_case(name, seconds, family="softmax", hook=None):
    """A case whose attnkit and peer implementations each take ``seconds`` per call; ``hook()``
    runs in the attnkit implementation's first call."""
    calls = []

    def ours(x):
        if hook is not None and not calls:
            hook()
        calls.append(1)
        time.sleep(seconds)
        return x["a"] * 2

    def peer(x):
        time.sleep(seconds)
        return x["a"] * 2

    return Case(family, name, "fwd", {"N": 4}, 1e6, _inputs,
                [Impl("attnkit[fake]", "attnkit", fn=ours), Impl("peer", "peer", fn=peer)])


def run_cli(monkeypatch, tmp_path, cases, *extra):
    monkeypatch.setattr(harness, "collect_cases", lambda families, quick, device: cases)
    monkeypatch.setattr(harness, "machine_peaks", lambda device: {"copy_gb_per_s": 10.0})
    from attnkit.__main__ import main

    return main(["bench", "--quick", "--out", str(tmp_path), "--repeats", "1", "--warmup", "1",
                 "--no-progress", "--no-memory", *extra])


def read_json(tmp_path, device="cpu"):
    return json.loads((tmp_path / f"bench-{device}.json").read_text())


# ---------------------------------------------------------------------------------------------
# streaming: printed and written case by case


def test_each_case_is_printed_and_written_before_the_next_one_runs(monkeypatch, tmp_path, capsys):
    seen = {}

    def look():  # runs inside the second case, while it is being measured
        seen["stdout"] = capsys.readouterr().out
        seen["json"] = read_json(tmp_path)

    cases = [sleepy_case("first", 0.001), sleepy_case("second", 0.001, hook=look)]
    assert run_cli(monkeypatch, tmp_path, cases) == 0
    assert "softmax/first  [fwd]" in seen["stdout"] and "softmax/second  [fwd]" not in seen["stdout"]
    assert "[2/2] softmax/second [fwd] ..." in seen["stdout"]  # announced before it runs
    assert seen["json"]["meta"]["status"] == "running"
    assert [c["name"] for c in seen["json"]["cases"]] == ["first", "second"]
    # the second case's record is there already, partial: its peer ran, attnkit is pending
    rows = {r["impl"]: r["status"] for r in seen["json"]["cases"][1]["results"]}
    assert rows == {"attnkit[fake]": "pending", "peer": "ok"}
    assert seen["json"]["meta"]["cases_planned"] == ["softmax/first [fwd]", "softmax/second [fwd]"]

    out = capsys.readouterr().out
    assert "softmax/second  [fwd]" in out and "bench-cpu.json" in out
    data = read_json(tmp_path)
    assert data["meta"]["status"] == "complete" and data["meta"]["not_run"] == []
    assert [c["name"] for c in data["cases"]] == ["first", "second"]
    assert all(c["wall_s"] > 0 for c in data["cases"])
    assert (tmp_path / "bench-cpu.png").stat().st_size > 0
    assert not list(tmp_path.glob("*.tmp"))


def test_deadline_stops_starting_cases_and_still_writes_json_and_plot(monkeypatch, tmp_path, capsys):
    cases = [sleepy_case(f"c{i}", 0.15) for i in range(6)]  # ~0.6 s per case (warmup + timed, two impls)
    assert run_cli(monkeypatch, tmp_path, cases, "--deadline", "0.5") == 0
    out = capsys.readouterr().out
    data = read_json(tmp_path)
    done = [c["name"] for c in data["cases"]]
    assert 1 <= len(done) < 6
    assert all(c["results"][0]["status"] == "ok" for c in data["cases"])  # a started case is finished
    assert data["meta"]["status"] == "deadline" and data["meta"]["deadline_s"] == 0.5
    assert data["meta"]["not_run"] == [f"softmax/c{i} [fwd]" for i in range(len(done), 6)]
    assert "deadline: 0.5 s" in out and "deadline of 0.5 s reached" in out
    assert f"{6 - len(done)} case(s) not run" in out
    assert (tmp_path / "bench-cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_interrupt_writes_what_was_measured(monkeypatch, tmp_path, capsys):
    def ctrl_c():
        raise KeyboardInterrupt

    cases = [sleepy_case("ok", 0.001), sleepy_case("stopped", 0.001, hook=ctrl_c), sleepy_case("never", 0.001)]
    assert run_cli(monkeypatch, tmp_path, cases) == 130
    data = read_json(tmp_path)
    assert data["meta"]["status"] == "interrupted"
    assert data["meta"]["not_run"] == ["softmax/stopped [fwd]", "softmax/never [fwd]"]
    # the interrupted case's partial record (its peer's row) is kept
    assert [c["name"] for c in data["cases"]] == ["ok", "stopped"]
    assert "interrupted at" in capsys.readouterr().out
    assert (tmp_path / "bench-cpu.png").exists()


WATCHDOG_SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from attnkit.bench import harness
    from attnkit.bench.harness import Case, Impl

    def stuck(x):
        time.sleep(30)  # a case that overruns deadline + grace (a hung compile, say)

    def quick(x):
        return x["a"] + 1

    make = lambda device: {"a": torch.ones(2)}
    cases = [Case("softmax", "fine", "fwd", {}, 1.0, make, [Impl("peer", "peer", fn=quick)]),
             Case("softmax", "stuck", "fwd", {}, 1.0, make,
                  [Impl("peer", "peer", fn=quick), Impl("attnkit[slow]", "attnkit", fn=stuck)]),
             Case("softmax", "later", "fwd", {}, 1.0, make, [Impl("peer", "peer", fn=quick)])]
    harness.collect_cases = lambda families, quick, device: cases
    harness.machine_peaks = lambda device: {}
    sys.exit(harness.main(["--out", sys.argv[1], "--deadline", "1", "--grace", "1", "--repeats", "1",
                           "--warmup", "1", "--no-progress", "--no-memory"]))
""")


def test_watchdog_abandons_a_case_that_overruns_the_deadline(tmp_path):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert time.perf_counter() - start < 25  # not the stuck call's 30 s
    assert proc.returncode == live.EXIT_ABANDONED, proc.stdout + proc.stderr
    assert "softmax/stuck [fwd] still running: abandoned" in proc.stdout
    data = read_json(tmp_path)
    assert data["meta"]["status"] == "abandoned"
    assert data["meta"]["not_run"] == ["softmax/stuck [fwd]", "softmax/later [fwd]"]
    assert [c["name"] for c in data["cases"]] == ["fine", "stuck"]  # the stuck case's peer row is kept
    assert {r["impl"]: r["status"] for r in data["cases"][1]["results"]} == {"peer": "ok", "attnkit[slow]": "pending"}
    assert (tmp_path / "bench-cpu.png").exists()


def test_a_lost_cuda_context_ends_the_sweep(monkeypatch):
    def broken(x):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(harness, "cuda_context_error", lambda device: "illegal memory access")
    cases = [Case("softmax", "crash", "fwd", {}, 1.0, _inputs,
                  [Impl("attnkit[bad]", "attnkit", fn=broken), Impl("attnkit[next]", "attnkit", fn=lambda x: x["a"]),
                   Impl("peer", "peer", fn=lambda x: x["a"])]),
             sleepy_case("after", 0.0)]
    records = harness.run_sweep(cases, CPU, warmup=1, repeats=1, memory=False, progress=False)
    assert len(records) == 1 and "illegal memory access" in records[0]["aborted"]
    rows = {r["impl"]: r for r in records[0]["results"]}
    assert rows["peer"]["status"] == "ok"  # peers run first
    assert rows["attnkit[bad]"]["status"] == "error" and "context is lost" in rows["attnkit[bad]"]["reason"]
    assert rows["attnkit[next]"]["status"] == "skipped"
    assert "ABORTED" in harness.format_table({"device": "cuda"}, records)


def test_failing_inputs_are_a_row_error_not_a_crash():
    def no_memory(device):
        raise RuntimeError("CUDA out of memory. Tried to allocate 64 GiB")

    case = Case("softmax", "huge", "fwd", {}, 1.0, no_memory, [Impl("peer", "peer", fn=lambda x: x)])
    rec = harness.run_case(case, CPU, warmup=1, repeats=1, memory=False)
    assert rec["results"][0]["status"] == "error"
    assert "making the inputs failed: RuntimeError: CUDA out of memory" in rec["results"][0]["reason"]


def test_backend_unavailable_is_reported_as_unavailable():
    from attnkit import BackendUnavailableError

    def refuse(x):
        raise BackendUnavailableError("the cuda kernels take float16 / bfloat16")

    case = Case("softmax", "f32", "fwd", {}, 1.0, _inputs,
                [Impl("attnkit[cuda]", "attnkit", fn=refuse), Impl("peer", "peer", fn=lambda x: x["a"])])
    rec = harness.run_case(case, CPU, warmup=1, repeats=1, memory=False)
    assert rec["results"][0]["status"] == "unavailable"
    assert rec["results"][0]["reason"] == "the cuda kernels take float16 / bfloat16"


# ---------------------------------------------------------------------------------------------
# targets and bandwidth


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def takes(self, seconds):
        def fn(x):
            self.now += seconds
            return x["a"] * 2
        return fn


def test_targets_are_checked_and_shown():
    clock = Clock()
    case = Case("softmax", "t", "fwd", {}, 1e9, _inputs,
                [Impl("attnkit[a]", "attnkit", fn=clock.takes(0.001), backend="a"),
                 Impl("attnkit[b]", "attnkit", fn=clock.takes(0.004), backend="b"),
                 Impl("attnkit[c]", "attnkit", unavailable="not here", backend="c"),
                 Impl("peer", "peer", fn=clock.takes(0.003))],
                targets={"peer": 1.0})
    rec = harness.run_case(case, CPU, warmup=1, repeats=3, memory=False, timer=clock)
    got = {t["attnkit"]: (t["got"], t["met"]) for t in rec["targets"]}
    assert got["attnkit[a]"] == (pytest.approx(3.0), True)
    assert got["attnkit[b]"] == (pytest.approx(0.75), False)
    assert got["attnkit[c]"] == (None, None)
    table = harness.format_table({"device": "cpu"}, [rec])
    assert "target: attnkit[a] speedup vs peer >= 1x: 3.00x: met" in table
    assert "target: attnkit[b] speedup vs peer >= 1x: 0.75x: MISSED" in table
    assert "target: attnkit[c] speedup vs peer >= 1x: not measured" in table


def test_bandwidth_is_reported_against_the_copy_bandwidth():
    clock = Clock()
    case = Case("hopfield", "bw", "fwd", {}, 1e6, _inputs,
                [Impl("attnkit[x]", "attnkit", fn=clock.takes(0.002), backend="x"),
                 Impl("peer", "peer", fn=clock.takes(0.004))],
                bytes=1.6e9, copy_fraction_target=0.7)
    rec = harness.run_case(case, CPU, warmup=1, repeats=3, memory=False, timer=clock,
                           machine={"copy_gb_per_s": 1000.0})
    ours = rec["results"][0]
    assert ours["bytes_per_s"] == pytest.approx(0.8e12)
    assert ours["copy_fraction"] == pytest.approx(0.8)
    assert rec["targets"] == [{"attnkit": "attnkit[x]", "what": "fraction of the copy bandwidth", "want": 0.7,
                               "got": pytest.approx(0.8), "met": True}]
    table = harness.format_table({"device": "cuda"}, [rec])
    assert "GB/s" in table and "TFLOP/s" in table and " 800 " in table
    assert "80% of the copy bandwidth" in table
    assert "target: attnkit[x] fraction of the copy bandwidth >= 70%: 80%: met" in table


# ---------------------------------------------------------------------------------------------
# case selection


def test_match_skip_impl_and_list(monkeypatch, tmp_path, capsys):
    cases = [sleepy_case("alpha", 0.0), sleepy_case("beta", 0.0, family="sparse")]
    picked = harness.select_cases(cases, "sparse/", "^peer$")
    assert [c.name for c in picked] == ["beta"]
    assert picked[0].impls[1].skip.startswith("left out by --skip-impl")
    assert harness.select_cases(cases, r"\[fwd\]", None) == cases

    assert run_cli(monkeypatch, tmp_path, [sleepy_case("alpha", 0.0), sleepy_case("beta", 0.0)], "--list") == 0
    out = capsys.readouterr().out
    assert "1. softmax/alpha [fwd]" in out and "attnkit[fake]" in out
    assert not (tmp_path / "bench-cpu.json").exists()

    assert run_cli(monkeypatch, tmp_path, [sleepy_case("alpha", 0.0), sleepy_case("beta", 0.0)],
                   "--match", "beta") == 0
    assert [c["name"] for c in read_json(tmp_path)["cases"]] == ["beta"]


def test_cli_rejects_bad_deadline_and_regex(capsys):
    for args in (["--deadline", "0"], ["--match", "("]):
        with pytest.raises(SystemExit):
            harness.main(args)
    assert "not a regular expression" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the GPU case lists, built here without a GPU


@pytest.fixture
def no_gpu(monkeypatch):
    """What building the GPU cases asks of the GPU: the N² mask that sparse.count_kept builds
    on the device (a stand-in count here), and the memory budget (an H100's 80 GB)."""
    monkeypatch.setattr(sparse, "count_kept", lambda kind, kwargs, n, device: 1000)
    monkeypatch.setattr(harness, "memory_budget", lambda device: 40 * 2**30)


def _targets(case):
    return case.targets, case.copy_fraction_target


def test_cuda_quick_cases_are_the_targets(no_gpu):
    quick = {m.FAMILY: m.cases(quick=True, device=CUDA) for m in (softmax, sparse, linear, hopfield)}
    assert quick["linear"] == []  # its autotuning (and fla's) alone would take the quick run's minute
    sm = quick["softmax"]
    assert [(c.mode, c.params["B"], c.params["H"], c.params["N"], c.params["D"], c.params["dtype"],
             c.params["causal"]) for c in sm] == [("fwd", 4, 8, 8192, 128, "bfloat16", False),
                                                   ("fwd+bwd", 4, 8, 8192, 128, "bfloat16", False)]
    assert [c.targets for c in sm] == [{"torch SDPA": 1.0}, {"torch SDPA": 0.9}]
    (sp,) = quick["sparse"]
    assert sp.params["pattern"] == "strided(stride=128,causal=True)" and sp.params["N"] == 16384
    assert sp.targets == {"FlexAttention (BlockMask)": 3.0}
    assert "attnkit dense causal" not in [i.name for i in sp.impls]
    (hf,) = quick["hopfield"]
    assert (hf.params["S"], hf.params["N"], hf.copy_fraction_target) == (1, 2**20, 0.7)
    assert hf.bytes == 2**20 * 64 * 2
    assert "attnkit softmax per step" not in [i.name for i in hf.impls]
    # the cheapest target first, the one whose compile time is least known (FlexAttention) last
    order = [f"{c.label} [{c.mode}]" for c in harness.collect_cases(harness.FAMILIES, quick=True, device=CUDA)]
    assert order == ["hopfield/update-S1-N1048576-D64-steps1-bfloat16 [fwd]",
                     "softmax/full-bfloat16-N8192-D128 [fwd]", "softmax/full-bfloat16-N8192-D128 [fwd+bwd]",
                     "sparse/strided(stride=128,causal=True)-bfloat16-N16384-D128 [fwd]"]
    # every attnkit backend that cannot run here is simply absent; the reference is never timed on CUDA
    for cases in quick.values():
        for case in cases:
            for impl in case.impls:
                if impl.backend == "reference":
                    assert impl.skip


def test_cuda_full_cases_start_with_the_quick_ones(no_gpu):
    for module in (softmax, sparse, linear, hopfield):
        quick = [(c.name, c.mode) for c in module.cases(quick=True, device=CUDA)]
        full = [(c.name, c.mode) for c in module.cases(quick=False, device=CUDA)]
        assert len(full) > len(quick) and full[:len(quick)] == quick, module.FAMILY
    quick = harness.collect_cases(harness.FAMILIES, quick=True, device=CUDA)
    full = harness.collect_cases(harness.FAMILIES, quick=False, device=CUDA)
    assert [c.label for c in full[:len(quick)]] == [c.label for c in quick]
    # fla's forward next, its backward last (its autotuning is the sweep's longest compile)
    assert f"{full[len(quick)].label} [{full[len(quick)].mode}]" == "linear/causal-elu-bfloat16-N16384-D64 [fwd]"
    assert [f"{c.label} [{c.mode}]" for c in full[-2:]] == ["linear/causal-elu-bfloat16-N16384-D64 [fwd+bwd]",
                                                            "linear/causal-elu-bfloat16-N4096-D64 [fwd+bwd]"]
    assert {c.priority for c in full[len(quick) + 1:-2]} == {20}
    lin = linear.cases(quick=False, device=CUDA)
    assert all(c.params["dtype"] == "bfloat16" and c.params["causal"] for c in lin)
    assert all(any(i.name == "flash-linear-attention chunk" and not i.skip for i in c.impls) for c in lin)


def test_fla_missing_is_unavailable_with_the_install_line(monkeypatch, no_gpu):
    monkeypatch.setattr(linear, "fla_missing", lambda: "flash-linear-attention is not installed: pip ...")
    case = linear.cases(quick=False, device=CUDA)[0]
    fla = next(i for i in case.impls if i.name == "flash-linear-attention chunk")
    assert fla.unavailable.startswith("flash-linear-attention is not installed")


def test_mask_mods_match_the_mask_builders():
    n = 37
    i = torch.arange(n).unsqueeze(1)
    j = torch.arange(n).unsqueeze(0)
    cases = [("strided", {"stride": s, "causal": c}) for s in (1, 4, 7) for c in (True, False)]
    cases += [("fixed", {"stride": s, "summary": m, "causal": c}) for s, m in ((4, 1), (8, 3)) for c in (True, False)]
    cases += [("star", {"relay": r, "radius": rad, "cyclic": cyc, "causal": c})
              for r in (0, 17, n - 1) for rad in (1, 2) for cyc in (False, True) for c in (False, True)]
    for kind, kwargs in cases:
        mod = sparse.MASK_MODS[kind](n, **kwargs)
        got = mod(0, 0, i, j).expand(n, n)
        assert torch.equal(got, sparse.PATTERNS[kind](n, **kwargs)), (kind, kwargs)


def test_seeded_randn_is_not_zero_and_reproducible():
    a = harness.seeded_randn((64, 64), torch.bfloat16, CPU, 3)
    b = harness.seeded_randn((64, 64), torch.bfloat16, CPU, 3)
    assert torch.equal(a, b) and a.float().std() > 0.5


# ---------------------------------------------------------------------------------------------
# the flash-linear-attention peer's layout, against a stand-in for fla


def _fake_fla(monkeypatch):
    """A pure-PyTorch chunk_linear_attn with fla's signature and [B, T, H, D] layout."""
    def chunk_linear_attn(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=True,
                          cu_seqlens=None):
        assert q.shape[1] > q.shape[2], "fla takes [B, T, H, D]: time before heads"
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # -> [B, H, T, D]
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores * torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        out = scores @ v
        if normalize:
            out = out / (scores.sum(-1, keepdim=True) + 1e-10)
        return out.transpose(1, 2), None

    mod = types.ModuleType("fla.ops.linear_attn")
    mod.chunk_linear_attn = chunk_linear_attn
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", mod)


@pytest.mark.parametrize("mode", ["fwd", "fwd+bwd"])
def test_fla_peer_layout(monkeypatch, mode):
    _fake_fla(monkeypatch)
    make = linear._inputs(1, 3, 40, 8, 8, torch.float64, 0)
    fla_fn, note = linear._fla_chunk(mode)
    assert "[B, T, H, D]" in note
    case = Case("linear", "fla", mode, {}, 1.0, make,
                [Impl("fla", "attnkit", fn=fla_fn),
                 Impl("cumsum outer", "peer", fn=lambda x: linear.cumsum_outer(x["q"], x["k"], x["v"], True))],
                grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else ())
    rec = harness.run_case(case, CPU, warmup=2, repeats=2, memory=False)
    row = rec["results"][0]
    assert row["status"] == "ok", row["reason"]
    assert row["max_rel_diff"] < 1e-6  # eps 1e-6 against 1e-10 only


def test_fla_import_failure_is_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla.ops.linear_attn", None)  # import raises ImportError
    fla_fn, _ = linear._fla_chunk("fwd")
    case = Case("linear", "fla", "fwd", {}, 1.0, linear._inputs(1, 1, 8, 4, 4, torch.float32, 0),
                [Impl("fla", "peer", fn=fla_fn)])
    row = harness.run_case(case, CPU, warmup=1, repeats=1, memory=False)["results"][0]
    assert row["status"] == "unavailable" and linear.FLA_IMPORT in row["reason"]


# ---------------------------------------------------------------------------------------------
# a lost CUDA context: the cases left continue in a child process (attnkit.bench.respawn)


def test_child_argv_selects_exactly_the_cases_left(monkeypatch):
    from attnkit.bench import respawn

    args = harness.build_parser().parse_args(["--device", "cuda", "--quick", "--deadline", "50", "--repeats", "3",
                                              "--skip-impl", "Flex"])
    keys = ["linear/causal-elu-bfloat16-N16384-D64 [fwd+bwd]", "sparse/strided(stride=128,causal=True)-x [fwd]"]
    argv = respawn.child_argv(args, keys, {keys[0]: ["attnkit[triton]"]}, 20.5, {"copy_gb_per_s": 3000.0}, 2)
    assert argv[1:4] == ["-m", "attnkit", "bench"]
    child = harness.build_parser().parse_args(argv[4:])
    assert child.child and child.quick and child.respawns == 2 and child.deadline == 20.5
    assert child.repeats == 3 and child.skip_impl == "Flex"
    assert json.loads(child.machine_json) == {"copy_gb_per_s": 3000.0}
    assert child.skip_in_case == [f"{keys[0]}=attnkit[triton]"]
    cases = [sleepy_case(n, 0.0, family=f) for f, n in (("linear", "causal-elu-bfloat16-N16384-D64"),
                                                        ("linear", "causal-elu-bfloat16-N1638-D64"),
                                                        ("sparse", "strided(stride=128,causal=True)-x"))]
    cases[0].mode = "fwd+bwd"
    picked = harness.select_cases(cases, child.match, None)
    assert [c.name for c in picked] == ["causal-elu-bfloat16-N16384-D64", "strided(stride=128,causal=True)-x"]
    harness.skip_in_cases(picked, child.skip_in_case)
    assert [bool(i.skip) for i in picked[0].impls] == [False, False]  # sleepy_case's attnkit is "attnkit[fake]"


def test_a_lost_context_continues_in_a_child_and_merges(monkeypatch, tmp_path, capsys):
    from attnkit.bench import respawn

    def broken(x):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    crash = Case("linear", "crash", "fwd", {}, 1e6, _inputs,
                 [Impl("attnkit[bad]", "attnkit", fn=broken, backend="bad"),
                  Impl("attnkit[good]", "attnkit", fn=lambda x: x["a"], backend="good"),
                  Impl("peer", "peer", fn=lambda x: x["a"])], targets={"peer": 1.0})
    cases = [sleepy_case("before", 0.0), crash, sleepy_case("after", 0.0, family="hopfield")]
    monkeypatch.setattr(harness, "cuda_context_error", lambda device: "illegal memory access")
    seen = {}

    def fake_child(argv, out_dir, timeout, device_type):
        """What the child would measure: the crashed case less attnkit[bad], then the last case."""
        seen["argv"] = argv
        child = harness.build_parser().parse_args(argv[4:])
        picked = harness.select_cases([sleepy_case("before", 0.0), crash, sleepy_case("after", 0.0, "hopfield")],
                                      child.match, None)
        assert [c.name for c in picked] == ["crash", "after"]
        ok = lambda x: x["a"]  # noqa: E731
        redo = Case("linear", "crash", "fwd", {}, 1e6, _inputs,
                    [Impl("attnkit[bad]", "attnkit", fn=ok, backend="bad",
                          skip="lost the CUDA context in the previous process"),
                     Impl("attnkit[good]", "attnkit", fn=ok, backend="good"), Impl("peer", "peer", fn=ok)])
        recs = [harness.run_case(c, CPU, warmup=1, repeats=1, memory=False) for c in (redo, picked[1])]
        print("child printed its cases")
        return 0, {"meta": {"status": "complete", "not_run": []}, "cases": recs}

    monkeypatch.setattr(respawn, "run_child", fake_child)
    assert run_cli(monkeypatch, tmp_path, cases, "--deadline", "100") == 0
    out = capsys.readouterr().out
    assert "illegal memory access: the 2 case(s) from linear/crash [fwd] on continue in a fresh process" in out
    assert "child printed its cases" in out
    data = read_json(tmp_path)
    assert data["meta"]["status"] == "complete"
    assert [c["name"] for c in data["cases"]] == ["before", "crash", "after"]
    rows = {r["impl"]: r for r in data["cases"][1]["results"]}
    assert rows["attnkit[bad]"]["status"] == "error" and "illegal memory access" in rows["attnkit[bad]"]["reason"]
    assert rows["attnkit[good]"]["status"] == "ok" and rows["peer"]["status"] == "ok"
    assert {(r["attnkit"], r["peer"]) for r in data["cases"][1]["ratios"]} == {("attnkit[good]", "peer")}
    assert [t["attnkit"] for t in data["cases"][1]["targets"]] == ["attnkit[bad]", "attnkit[good]"]
    assert "measured in a fresh process" in data["cases"][1]["notes"][-1]
    assert data["meta"]["restarts"][0]["after"] == "linear/crash [fwd]"
    assert "--deadline" in seen["argv"] and "--respawns" in seen["argv"]
    assert (tmp_path / "bench-cpu.png").exists()


def test_no_respawn_when_told_not_to(monkeypatch, tmp_path, capsys):
    from attnkit.bench import respawn

    def broken(x):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(harness, "cuda_context_error", lambda device: "illegal memory access")
    monkeypatch.setattr(respawn, "run_child", lambda *a: pytest.fail("no child wanted"))
    cases = [Case("linear", "crash", "fwd", {}, 1.0, _inputs, [Impl("attnkit[bad]", "attnkit", fn=broken)]),
             sleepy_case("after", 0.0)]
    assert run_cli(monkeypatch, tmp_path, cases, "--respawns", "0") == 4
    data = read_json(tmp_path)
    assert data["meta"]["status"] == "aborted" and data["meta"]["not_run"] == ["softmax/after [fwd]"]
    assert "stopped: CUDA context lost" in capsys.readouterr().out


def test_the_crashed_impl_is_left_out_of_its_family_and_mode():
    from attnkit.bench import respawn

    aborted = {"family": "linear", "mode": "fwd+bwd",
               "results": [{"impl": "attnkit[triton]", "status": "error"}, {"impl": "peer", "status": "ok"}]}
    def case(family, name, mode):
        return Case(family, name, mode, {}, 1.0, _inputs, [], grad_inputs=("a",) if mode == "fwd+bwd" else ())

    left = [case("linear", "a", "fwd+bwd"), case("linear", "b", "fwd+bwd"), case("linear", "c", "fwd"),
            case("sparse", "d", "fwd+bwd")]
    assert respawn.skips_after_crash(aborted, left) == {"linear/a [fwd+bwd]": ["attnkit[triton]"],
                                                       "linear/b [fwd+bwd]": ["attnkit[triton]"]}
