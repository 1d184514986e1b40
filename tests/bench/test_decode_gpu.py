"""bench/decode_gpu.py's records and table on fake timings (no GPU needed)."""
from attnkit.bench import decode_gpu as g


def test_table_from_fake_timings():
    shape = g.shapes(quick=True)[0]  # bfloat16 GQA N=1 M=8192: K/V = 268.4 MB
    nbytes = g.kv_bytes(shape)
    assert nbytes == 2 * 8 * 8 * 8192 * 128 * 2
    best, bad = g.config_label(16, 128, 4, 3, 5), g.config_label(16, 256, 8, 2, 5)
    rows = [{"impl": "copy K/V", "kind": "copy", "seconds": 2 * nbytes / 3000e9},  # 3000 GB/s
            {"impl": "SDPA", "kind": "sdpa", "seconds": 2e-4},
            {"impl": best, "kind": "decode", "seconds": 1e-4, "max_err": 1e-3},
            {"impl": bad, "kind": "decode", "seconds": 5e-5, "max_err": 0.5},  # wrong: not best
            {"impl": g.config_label(16, 64, 2, 2, 5), "kind": "decode",
             "skipped": "shape time limit"}]
    rec = g.finish_record(shape, rows, machine_copy_gbps=2900.0)
    text = g.format_table({"device_name": "fake", "sms": 132, "copy_gb_per_s": 2900.0}, [rec])
    assert rec["best"] == best and rec["target"] is True and rec["ref_copy_gbps"] == 3000.0
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(best))
    assert line.split()[5:9] == ["0.1000", "2684", "89.5", "2.00"] and "best" in line
    assert "BAD err 5.00e-01" in text and "shape time limit" in text
    assert "targets met: 1 of 1" in text
