"""The fuzz checks can fail: each one, fed a result that breaks the rule it enforces (a dropped
NaN, a stray NaN, an error past the tolerance), raises.  A fuzz test whose checks accept
anything would pass whatever the kernels do."""
import pytest

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (requirements.txt)")
import torch

from attnkit_testing import F64
from fuzzing import base_support, check_exact, check_grad_with_specials, check_v_mode, make_input, tolerance

NAN = float("nan")


def _ref():
    ref = torch.randn(2, 3, 5, 4, dtype=F64)
    ref[0, 1, 2] = NAN  # a poisoned row
    return ref


def test_check_exact_accepts_a_faithful_result():
    ref = _ref()
    out = ref.float()
    required = torch.isnan(ref).all(-1, keepdim=True)
    check_exact("out", out, ref, tolerance(torch.float32, ref), required)


def test_check_exact_catches_a_dropped_nan():
    ref = _ref()
    out = torch.nan_to_num(ref.float(), nan=0.0)  # the bug of issue 15: NaN row -> 0
    with pytest.raises(AssertionError, match="NaN / inf dropped"):
        check_exact("out", out, ref, 1.0, torch.isnan(ref).all(-1, keepdim=True))
    with pytest.raises(AssertionError, match="NaN pattern differs"):
        check_exact("out", out, ref, 1.0)


def test_check_exact_catches_a_stray_nan_and_an_inf():
    ref = _ref()
    out = ref.float().clone()
    out[1, 0, 0, 0] = NAN
    with pytest.raises(AssertionError, match="NaN pattern differs"):
        check_exact("out", out, ref, 1.0)
    out = ref.float().clone()
    out[1, 0, 0, 0] = float("inf")
    with pytest.raises(AssertionError, match=r"\+inf pattern differs"):
        check_exact("out", out, ref, 1.0)


def test_check_exact_catches_an_error_past_the_float32_rule():
    ref = torch.randn(3, 7, dtype=F64)
    out = (ref * (1 + 1e-4)).float()  # 5x the float32 rule (2e-5 relative)
    with pytest.raises(AssertionError, match="max error"):
        check_exact("out", out, ref, tolerance(torch.float32, ref))


def test_rows_without_keys_must_be_zero_or_nan():
    ref = torch.zeros(2, 3, dtype=F64)
    loose = torch.tensor([True, False])[:, None]
    check_exact("out", torch.tensor([[NAN] * 3, [0.0] * 3]), ref, 0.0, zero_or_nan=loose)
    with pytest.raises(AssertionError, match="neither 0 nor NaN"):
        check_exact("out", torch.tensor([[1.0] * 3, [0.0] * 3]), ref, 0.0, zero_or_nan=loose)


def test_check_v_mode_catches_a_lost_column_and_a_stray_one():
    clean = torch.randn(4, 3, dtype=F64)
    required = torch.zeros(4, 3, dtype=torch.bool)
    required[:2, 1] = True  # rows 0, 1 see the NaN of column 1
    allowed = torch.tensor([False, True, False])  # hidden rows may get 0 · NaN in that column
    out = clean.clone()
    out[:3, 1] = NAN  # row 2 too (a hidden row of the same tile): allowed
    check_v_mode("out", out, clean, 1e-12, required, allowed)
    lost = out.clone()
    lost[0, 1] = 0.5
    with pytest.raises(AssertionError, match="dropped"):
        check_v_mode("out", lost, clean, 1e-12, required, allowed)
    stray = out.clone()
    stray[3, 0] = NAN
    with pytest.raises(AssertionError, match="no row sees a special value"):
        check_v_mode("out", stray, clean, 1e-12, required, allowed)


def test_check_grad_with_specials():
    ref = torch.tensor([[NAN, 1.0], [2.0, 3.0]], dtype=F64)
    allowed = torch.tensor([[False, True], [False, False]])
    check_grad_with_specials("dq", torch.tensor([[NAN, NAN], [2.0, 3.0]]), ref, 1e-6, allowed)
    with pytest.raises(AssertionError, match="non-finite at 1 entries"):
        check_grad_with_specials("dq", torch.tensor([[NAN, 1.0], [NAN, 3.0]]), ref, 1e-6, allowed)
    with pytest.raises(AssertionError, match="max error"):
        check_grad_with_specials("dq", torch.tensor([[NAN, 1.0], [2.5, 3.0]]), ref, 1e-6, allowed)


def test_base_support_follows_the_views():
    """An entry of a transposed / expanded view maps back to the base entries that feed it."""
    gen = torch.Generator().manual_seed(0)
    t = make_input((2, 5, 3), "transposed", gen, torch.float32, "cpu")
    e = make_input((2, 5, 3), "expanded", gen, torch.float32, "cpu")
    mask = torch.zeros(2, 5, 3, dtype=torch.bool)
    mask[1, 4, 0] = True
    (st, se) = base_support([t, e], [t.base.double(), e.base.double()], [mask, mask])
    assert st.shape == (2, 3, 5) and st.nonzero().tolist() == [[1, 0, 4]]
    assert se.shape == (2, 1, 3) and se.nonzero().tolist() == [[1, 0, 0]]
