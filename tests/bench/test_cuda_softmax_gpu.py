"""bench/cuda_softmax_gpu.py without a GPU: arguments, plan, FLOP count, table, and the clean exit
without CUDA.  (Loaded from its file: it is a script, also run as `python bench/cuda_softmax_gpu.py`.)"""
import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "bench" / "cuda_softmax_gpu.py"
spec = importlib.util.spec_from_file_location("cuda_softmax_gpu", PATH)
g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)


def test_defaults_are_the_issue_cases():
    args = g.parse_args([])
    assert args.variants == ["default", "stream", "fused", "sm90", "sm90-pingpong", "sm90-simple", "sm90-atomic",
                             "sm90-persistent"]
    assert args.d == [128, 64] and args.n == 8192
    cs = g.cases(args)
    assert [(c["D"], c["causal"]) for c in cs] == [(128, False), (128, True), (64, False), (64, True)]
    assert all((c["dtype"], c["B"], c["H"], c["N"], c["M"]) == ("bfloat16", 4, 8, 8192, 8192) for c in cs)


def test_variant_environments():
    # (ATTNKIT_CUDA_SOFTMAX_BWD, ATTNKIT_CUDA_SM90) of each child: the Hopper variants keep the
    # default backward variable and switch the Hopper kernels' loop; the others leave them off.
    assert g.variant_env("default") == ("default", "0") and g.variant_env("fused") == ("fused", "0")
    assert g.variant_env("sm90") == ("default", "1") and g.variant_env("sm90-pingpong") == ("default", "pingpong")
    assert g.variant_env("sm90-simple") == ("default", "simple")
    assert g.variant_env("sm90-atomic") == ("default", "atomic")
    assert g.variant_env("sm90-persistent") == ("default", "persistent")


def test_unknown_variant_is_refused():
    with pytest.raises(SystemExit):
        g.parse_args(["--variants", "default,nope"])


def test_flops():
    c = dict(B=4, H=8, N=8192, M=8192, D=128, causal=False)
    fwd = 4.0 * 4 * 8 * 8192 * 8192 * 128
    assert g.flops(c, "fwd") == fwd and g.flops(c, "bwd") == 2.5 * fwd and g.flops(c, "fwd+bwd") == 3.5 * fwd
    assert g.flops(dict(c, causal=True), "fwd") == pytest.approx(fwd * 8193 / 16384)


def test_dry_run_prints_every_row(capsys):
    assert g.main(["--dry-run", "--variants", "default,fused", "--d", "128"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("  ")]
    assert len(rows) == 2 * 2 * 2 * 3  # variants x (causal, not) x (sdpa, cuda) x modes
    assert "cuda[fused] | fwd+bwd" in out and "ATTNKIT_CUDA_SOFTMAX_BWD=default|fused" in out


def test_table_flags_bad_rows():
    recs = [dict(variant="stream", case="c", impl="cuda[stream]", mode="bwd", ms=1.5, tflops=100.0, x_sdpa=0.5,
                 err=0.5, bad=True),
            dict(variant="stream", case="c", impl="-", mode="-", note="deadline: not run")]
    table = g.format_table(recs).splitlines()
    assert table[1].endswith("BAD") and "deadline: not run" in table[2]


def test_rel_err():
    torch = pytest.importorskip("torch")
    ref = torch.tensor([1.0, -2.0])
    assert g.rel_err(ref + 0.02, ref) == pytest.approx(0.01)
    assert g.rel_err(torch.tensor([float("nan"), 0.0]), ref) == float("inf")


def test_exits_cleanly_without_cuda(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("has CUDA: this test checks the clean exit of a machine without one")
    assert g.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out
