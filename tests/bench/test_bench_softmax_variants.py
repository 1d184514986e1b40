"""bench/softmax_variants_gpu.py without a GPU: its cases, row plan, compile tasks, records and
tables on fake timings, the dry run, and the torch (out, lse) its compile children feed the
backward kernels."""
import pytest
import torch

from attnkit.bench import softmax_variants_gpu as g
from attnkit.kernels import softmax as ts
from attnkit.kernels import softmax_hopper as sh


def test_cases_lead_with_the_issue_headline():
    quick, full = g.cases(quick=True), g.cases()
    assert len(quick) == 4 and len(full) == 8
    assert quick == full[:4]
    first = quick[0]
    assert (first["dtype"], first["B"], first["H"], first["N"], first["D"], first["causal"]) == \
        ("bfloat16", 4, 8, 8192, 128, False)
    assert {(c["D"], c["causal"]) for c in quick} == {(128, False), (128, True), (64, False),
                                                      (64, True)}
    assert {c["N"] for c in full} == {8192, 4096}


def test_flops_follow_the_softmax_bench_count():
    full, causal = g.cases(quick=True)[:2]
    fwd = 4.0 * 4 * 8 * 8192 * 8192 * 128
    assert g.case_flops(full, "fwd") == fwd
    assert g.case_flops(full, "bwd") == 2.5 * fwd and g.case_flops(full, "fwd+bwd") == 3.5 * fwd
    # causal: the 8192 * 8193 / 2 pairs at or below the diagonal
    assert g.case_flops(causal, "fwd") == pytest.approx(fwd * 8193 / 16384)


def test_plan_rows_cover_every_variant_and_config():
    full, causal = g.cases(quick=True)[:2]
    plan = g.plan_case(causal, n_configs=2)
    impls = [r["impl"] for r in plan]
    assert impls[:6] == ["SDPA fwd", "SDPA bwd", "SDPA fwd+bwd", "today fwd", "today bwd",
                         "today fwd+bwd"]
    for name, variant in sh.FWD_VARIANTS.items():
        rows = [r for r in plan if r["kind"] == "fwd" and r["variant"] == name]
        assert len(rows) == min(2, len(sh.fwd_configs(128, None, variant))), name
    for name, variant in sh.BWD_VARIANTS.items():
        rows = [r for r in plan if r["kind"] == "bwd" and r["variant"] == name]
        assert len(rows) == min(2, len(sh.bwd_configs(variant, 128))), name
    split = next(r for r in plan if r["kind"] == "bwd" and r["variant"] == "split")
    assert len(split["config"]) == 2 and " / " in split["impl"]  # a (dK/dV, dQ) pair
    core = {r["impl"] for r in plan if r["core"]}
    assert "fwd fma " + g.tile_label(g._config_tuple(sh.fwd_configs(128)[0])) in core
    assert not any(r["kind"] == "fwd" and r["variant"] == "exp" for r in plan if r["core"])
    # the variants that only differ on the diagonal are left out of the full cases
    full_plan = g.plan_case(full, n_configs=1)
    assert not any(r.get("variant") in g.CAUSAL_ONLY for r in full_plan)
    assert any(r.get("variant") == "nosplit" for r in plan)


def test_plan_skips_what_this_triton_lacks(monkeypatch):
    monkeypatch.setattr(sh, "HAS_WARP_SPECIALIZE", False)
    c = g.cases(quick=True)[0]
    plan = g.plan_case(c, n_configs=1)
    ws = [r for r in plan if "ws" in (r.get("variant") or "") and r["kind"] != "fwdbwd"]
    assert ws and all("warp_specialize" in r["skipped"] for r in ws)
    assert not any(r["kind"] == "fwdbwd" and "ws" in r["variant"] for r in plan)
    tasks = g.compile_tasks([c], [plan])
    assert not any("ws" in (t.get("variant") or "") for t in tasks)


def test_compile_tasks_are_one_per_kernel():
    c = g.cases(quick=True)[1]
    plan = g.plan_case(c, n_configs=2)
    tasks = g.compile_tasks([c], [plan])
    keys = [t["key"] for t in tasks]
    assert len(keys) == len(set(keys))
    # persist and persist2 run the same kernel (programs per SM is a launch size)
    persist = [r for r in plan if r.get("variant") in ("persist", "persist2")]
    assert len({g.compile_key(c, r) for r in persist}) == len(persist) // 2
    runnable = [r for r in plan if r["kind"] in ("fwd", "bwd") and not r.get("skipped")]
    variant_tasks = [t for t in tasks if t["kind"] in ("fwd", "bwd")]
    assert len(variant_tasks) == len({g.compile_key(c, r) for r in runnable})
    n_today_fwd = len(ts.configs_for("fwd", 128))
    n_today_bwd = max(len(ts.configs_for("dkdv", 128)), len(ts.configs_for("dq", 128)))
    assert sum(t["kind"] == "today-fwd" for t in tasks) == n_today_fwd
    assert sum(t["kind"] == "today-bwd" for t in tasks) == n_today_bwd
    # the first tasks are the first rows' (a compile cut short keeps the core of case 1)
    assert tasks[0]["kind"] == "fwd" and tasks[0]["variant"] == "base"


def _fake_rows(c):
    fwd_flops = g.case_flops(c, "fwd")
    sdpa_fwd = fwd_flops / 680e12  # SDPA at 680 TFLOP/s
    rows = [{"kind": "sdpa", "mode": "fwd", "impl": "SDPA fwd", "seconds": sdpa_fwd},
            {"kind": "sdpa", "mode": "bwd", "impl": "SDPA bwd", "seconds": 2.5 * sdpa_fwd},
            {"kind": "sdpa", "mode": "fwd+bwd", "impl": "SDPA fwd+bwd",
             "seconds": 3.5 * sdpa_fwd},
            {"kind": "today", "mode": "fwd", "impl": "today fwd", "seconds": sdpa_fwd / 0.73,
             "err": 4e-3},
            {"kind": "fwd", "mode": "fwd", "impl": "fwd fma 128x64 w8 s3", "variant": "fma",
             "seconds": sdpa_fwd / 0.95, "err": 4e-3, "lse_err": 1e-6},
            {"kind": "fwd", "mode": "fwd", "impl": "fwd tma 128x64 w8 s3", "variant": "tma",
             "seconds": sdpa_fwd / 1.5, "err": 0.4},  # fast but wrong: BAD, never best
            {"kind": "fwd", "mode": "fwd", "impl": "fwd ws 128x64 w8 s3", "variant": "ws",
             "error": "compile child: CompilationError: boom"},
            {"kind": "bwd", "mode": "bwd", "impl": "bwd atomic 64x128 w8 s2",
             "variant": "atomic", "seconds": 2.5 * sdpa_fwd / 0.7, "err": 1e-2},
            {"kind": "fwdbwd", "mode": "fwd+bwd", "impl": "fwd+bwd atomic",
             "variant": "atomic", "seconds": 3.5 * sdpa_fwd / 0.75,
             "fwd": "fwd fma 128x64 w8 s3"},
            {"kind": "fwd", "mode": "fwd", "impl": "fwd exp 128x64 w8 s3", "variant": "exp",
             "skipped": "case time share"}]
    return rows


def test_record_and_tables_from_fake_timings():
    c = g.cases(quick=True)[0]
    rec = g.finish_record(c, _fake_rows(c))
    rows = {r["impl"]: r for r in rec["rows"]}
    assert rows["SDPA fwd"]["tflops"] == pytest.approx(680.0)
    assert rows["fwd fma 128x64 w8 s3"]["vs_sdpa"] == pytest.approx(0.95)
    assert rows["fwd tma 128x64 w8 s3"]["bad"] and not rows["fwd fma 128x64 w8 s3"]["bad"]
    assert rec["best"] == {"fwd": "fwd fma 128x64 w8 s3", "bwd": "bwd atomic 64x128 w8 s2",
                           "fwd+bwd": "fwd+bwd atomic"}
    assert rec["targets"] == {"fwd": True, "fwd+bwd": False}
    text = g.format_case(rec)
    line = next(ln for ln in text.splitlines() if "fwd fma 128x64" in ln)
    assert line.split()[5:8] == [f"{rows['fwd fma 128x64 w8 s3']['ms']:.3f}", "646.0", "0.95"]
    assert "best" in line and "lse 1e-06" in line
    assert "BAD" in next(ln for ln in text.splitlines() if "fwd tma" in ln)
    assert "compile child: CompilationError: boom" in text and "case time share" in text
    assert "with fwd fma 128x64 w8 s3" in next(ln for ln in text.splitlines()
                                               if "fwd+bwd atomic" in ln)
    summary = g.format_summary([rec, rec])
    assert "fwd 0.95x ok (today 0.73x" in summary and "fwd+bwd 0.75x MISS" in summary
    matrix = next(ln for ln in summary.splitlines() if ln.strip().startswith("fwd fma"))
    assert matrix.split()[2:] == ["0.95", "0.95"]
    assert next(ln for ln in summary.splitlines()
                if ln.strip().startswith("fwd tma")).split()[2:] == ["BAD", "BAD"]


def test_dry_run_prints_the_plan_and_no_gpu_is_a_clean_exit(capsys):
    assert g.main(["--dry-run", "--quick", "--configs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("SDPA fwd [core]") == 4 and "compile tasks:" in out
    if not torch.cuda.is_available():
        assert g.main(["--quick"]) == 0
        assert "no CUDA device" in capsys.readouterr().out


@pytest.mark.parametrize("causal", [False, True])
def test_compile_children_out_and_lse(causal):
    from attnkit.reference.softmax import softmax_attention_reference

    q, k, v = (torch.randn(1, 2, 9, 16, dtype=torch.float64) for _ in range(3))
    out, lse = g._torch_out_lse(q.float(), k.float(), v.float(), causal)
    ref_out, ref_lse = softmax_attention_reference(q, k, v, is_causal=causal, return_lse=True)
    torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_run_case_end_to_end_on_the_interpreter():
    # The timed process's logic (checks into NaN-filled buffers, the best forward feeding the
    # backward rows, the fwd+bwd rows, skips) on a tiny float32 case in the Triton interpreter,
    # with a few rows of each kind and the host clock.
    import argparse

    c = {"dtype": "float32", "B": 1, "H": 2, "N": 48, "D": 16, "causal": True}
    plan = g.plan_case(c, n_configs=1)
    keep = {"SDPA fwd", "SDPA bwd", "SDPA fwd+bwd", "today fwd", "today bwd", "today fwd+bwd"}
    rows = [r for r in plan if r["impl"] in keep
            or r.get("variant") in ("fma", "tma", "split", "atomic")]
    rows.append(dict(next(r for r in plan if r.get("variant") == "tma_reduce"
                          and r["kind"] == "bwd"), skipped="not here"))
    args = argparse.Namespace(repeats=1, max_time=1e-3)
    compiled = {g.compile_key(c, r): "CompilationError: boom" for r in rows
                if r.get("variant") == "tma" and r["kind"] == "fwd"}
    lines = []
    raw = g.run_case(c, rows, torch.device("cpu"), args, compiled, deadline=float("inf"),
                     share_s=1e9, log=lines.append)
    rec = g.finish_record(c, raw)
    by = {r["impl"]: r for r in rec["rows"]}
    assert len(lines) == len(raw) == len(rows)
    for r in rec["rows"]:
        checked = r["kind"] in ("fwd", "bwd") or (r["kind"] == "today" and r["mode"] != "fwd+bwd")
        if checked and r.get("variant") not in ("tma_reduce", "tma"):
            assert r.get("seconds") and r["err"] < 1e-4, r  # float32 against SDPA
            assert not r["bad"]
    fwd = next(r for r in rec["rows"] if r["kind"] == "fwd" and r["variant"] == "fma")
    assert fwd["lse_err"] < 1e-5
    tma = next(r for r in rec["rows"] if r["kind"] == "fwd" and r["variant"] == "tma")
    assert tma["error"] == "compile child: CompilationError: boom" and "seconds" not in tma
    both = [r for r in rec["rows"] if r["kind"] == "fwdbwd"]
    assert {r["variant"] for r in both} >= {"split", "atomic"}
    for r in both:
        if r["variant"] in ("split", "atomic"):
            assert r.get("seconds") and r["fwd"] == fwd["impl"]
    assert by["bwd tma_reduce " + g.tile_label(
        next(r for r in rows if r.get("variant") == "tma_reduce")["config"])]["skipped"]
    assert rec["best"]["fwd"] == fwd["impl"]


def test_precompile_restarts_a_child_that_died():
    # one child: its first task kills it (as a compiler abort would), the task is recorded as
    # failed and a fresh child runs the rest (here on the CPU, in the Triton interpreter)
    c = {"dtype": "float32", "B": 1, "H": 1, "N": 32, "D": 16, "causal": False}
    row = next(r for r in g.plan_case(c, 1) if r.get("variant") == "fma")
    tasks = [{"key": "dies", "kind": "_exit", "code": 7},
             dict(row, case=c, n=32, key="runs"),
             {"key": "fails", "kind": "fwd", "variant": "no such variant", "case": c, "n": 32,
              "config": row["config"]}]
    lines = []
    results = g.precompile(tasks, jobs=1, timeout_s=300, log=lines.append)
    assert results["dies"] == "compile child died (exit code 7)"
    assert results["runs"] is None
    assert results["fails"].startswith("KeyError")
    assert any("exit code 7" in ln for ln in lines)


def test_summary_takes_a_correct_config_after_a_bad_one_of_the_same_variant():
    # The H200 run of session 15 had tma_ws BAD in one config and not in the next: the summary
    # compared the float with the "BAD" marker and raised TypeError.
    c = g.cases(quick=True)[0]
    rows = _fake_rows(c)
    sdpa_fwd = next(r["seconds"] for r in rows if r["impl"] == "SDPA fwd")
    rows.append({"kind": "fwd", "mode": "fwd", "impl": "fwd tma 128x128 w8 s3", "variant": "tma",
                 "seconds": sdpa_fwd / 0.8, "err": 4e-3, "lse_err": 1e-6})
    summary = g.format_summary([g.finish_record(c, rows)])
    line = next(ln for ln in summary.splitlines() if ln.strip().startswith("fwd tma"))
    assert line.split()[2:] == ["0.80"]
