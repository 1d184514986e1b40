"""The CPU sweep (bench/sweep.py): its grid, which implementations it times, the interleaved
timing and the table."""
import time

import pytest
import torch

from attnkit.bench import sweep

CPU = torch.device("cpu")


def test_grid_covers_every_family_and_times_attnkit_against_peers_only():
    cases = sweep.grid(sweep.FAMILIES, CPU)
    assert {c.family for c in cases} == {"softmax", "linear", "sparse", "hopfield"}
    assert any("decode" in c.name for c in cases)
    for case in cases:
        names = [impl.name for impl in sweep.contenders(case)]
        assert names.count(sweep.ATTNKIT) == 1, case.label
        assert "attnkit[reference]" not in names
        assert len(names) >= 2, case.label  # at least one peer to compare with
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        sweep.grid(["nope"], CPU)


def test_interleaved_medians_follow_each_steps_own_cost():
    def sleeper(s):
        return lambda: time.sleep(s)
    med = sweep.interleaved({"fast": sleeper(0.001), "slow": sleeper(0.004)}, seconds=0.05)
    assert med["fast"] == pytest.approx(0.001, abs=0.002)
    assert med["slow"] == pytest.approx(0.004, abs=0.002)
    assert med["slow"] > med["fast"]


def test_run_reports_the_strongest_peer_and_the_losers():
    cases = [c for c in sweep.grid(["linear"], CPU) if c.mode == "fwd" and c.params["N"] == 256]
    recs = sweep.run(cases, CPU, seconds=0.02, log=lambda s: None)
    (rec,) = recs
    peers = {k: v for k, v in rec["medians_s"].items() if k != sweep.ATTNKIT}
    assert rec["peer"] == min(peers, key=peers.get)
    assert rec["ratio"] == pytest.approx(peers[rec["peer"]] / rec["medians_s"][sweep.ATTNKIT])
    fake = dict(rec, ratio=0.5)
    text = sweep.table([rec, fake])
    assert "slower than the strongest peer: " + fake["case"] in text


def test_spread_table_reads_the_bench_json_and_flags_cases_over_the_limit(tmp_path):
    import json

    from attnkit.bench import spread

    def bench_json(path, ms_a, ms_b):
        rows = lambda ms: [{"impl": "attnkit[cpu]", "status": "ok", "median_s": ms / 1e3},  # noqa: E731
                           {"impl": "torch SDPA", "status": "ok", "median_s": 1.0}]
        path.write_text(json.dumps({"cases": [
            {"label": "softmax/a", "mode": "fwd", "results": rows(ms_a)},
            {"label": "softmax/b", "mode": "fwd+bwd", "results": rows(ms_b)},
        ]}))
        return path

    runs = [spread.medians(bench_json(tmp_path / f"{i}.json", a, b))
            for i, (a, b) in enumerate([(10.0, 2.0), (11.0, 2.6), (10.5, 2.2)])]
    # The SDPA rows carry no "kind": "peer", so only attnkit's medians are read.
    assert runs[0] == {"softmax/a [fwd]": {"attnkit[cpu]": 0.010}, "softmax/b [fwd+bwd]": {"attnkit[cpu]": 0.002}}
    text = spread.table(runs)
    assert "| softmax/a [fwd] | 10 11 10.5 | 10% |" in text
    assert "| softmax/b [fwd+bwd] | 2 2.6 2.2 | 30% |" in text
    assert text.endswith("over 15%: softmax/b [fwd+bwd]")


def test_spread_control_reports_the_strongest_peers_spread_and_the_ratios(tmp_path):
    """--peers: the peer fastest over all processes is the control, and when it moves with
    attnkit the ratio's spread is small while both medians spread widely."""
    import json

    from attnkit.bench import spread

    def bench_json(path, ours, sdpa, flex, copy):
        rows = [{"impl": "attnkit[cpu]", "kind": "attnkit", "status": "ok", "median_s": ours},
                {"impl": "SDPA", "kind": "peer", "status": "ok", "median_s": sdpa},
                {"impl": "Flex", "kind": "peer", "status": "ok", "median_s": flex},
                {"impl": "attnkit[reference]", "kind": "attnkit", "status": "ok", "median_s": 0.001}]
        path.write_text(json.dumps({"meta": {"machine": {"copy_gb_per_s": copy}},
                                    "cases": [{"label": "decode", "mode": "fwd", "results": rows}]}))
        return path

    paths = [bench_json(tmp_path / "0.json", 1.0, 2.0, 9.0, 50.0),
             bench_json(tmp_path / "1.json", 1.5, 3.0, 1.0, 33.0),   # Flex wins once, SDPA overall
             bench_json(tmp_path / "2.json", 1.2, 2.4, 9.0, 41.0)]
    runs = [spread.medians(p) for p in paths]
    assert set(runs[0]["decode [fwd]"]) == {"attnkit[cpu]", "SDPA", "Flex"}
    assert spread.strongest_peer(runs, "decode [fwd]") == "SDPA"
    text = spread.table(runs, peers=True)
    assert "| decode [fwd] | 1e+03 1.5e+03 1.2e+03 | 50% | SDPA | 50% | 0% |" in text
    assert [spread.copy_bandwidth(p) for p in paths] == [50.0, 33.0, 41.0]
