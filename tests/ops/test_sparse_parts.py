"""The decomposition of attnkit.ops.sparse: the range parts of each pattern partition its mask.

softmax over the union of disjoint key sets is the LSE-merge of the parts, so the kernels' result
is exact only if every kept entry is in exactly one part and no part adds an entry.  Checked on
masks built from the part semantics (reference.sparse.range_part_mask), against pattern.mask.
"""
import pytest
import torch

from attnkit import patterns
from attnkit.ops import sparse as ops
from attnkit.reference.sparse import range_part_mask


def _assert_partition(masks, want):
    total = torch.zeros_like(want, dtype=torch.int64)
    for m in masks:
        total += m.long()
    assert (total <= 1).all(), "parts overlap: an entry would be counted twice"
    assert torch.equal(total.bool(), want), "the parts do not cover exactly the pattern"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 2, 33, 300])
@pytest.mark.parametrize("s", [1, 2, 3, 7, 64])
def test_strided_parts_partition_the_mask(n, s, causal):
    parts = ops.strided_parts(n, s, causal)
    masks = [range_part_mask(n, n, *p) for p in parts]
    _assert_partition(masks, patterns.strided(s, causal).mask(n))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [1, 33, 300])
@pytest.mark.parametrize("l, c", [(1, 1), (4, 1), (4, 4), (7, 3), (64, 8)])
def test_fixed_parts_partition_the_mask(n, l, c, causal):
    own, summary = ops.fixed_parts(n, l, c, causal)
    pos = ops.fixed_summary_positions(n, l, c)
    masks = [range_part_mask(n, n, *own)]
    for p in summary:
        gathered = range_part_mask(n, pos.numel(), *p)  # [n, summary keys]
        m = torch.zeros(n, n, dtype=torch.bool)
        m[:, pos] = gathered
        masks.append(m)
    _assert_partition(masks, patterns.fixed(l, c, causal).mask(n))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cyclic", [True, False])
@pytest.mark.parametrize("radius", [1, 2, 3])
@pytest.mark.parametrize("n, relay", [(1, 0), (2, 1), (5, 2), (8, 0), (33, 16), (40, 39), (60, 30)])
def test_star_parts_partition_the_mask_outside_the_patched_rows(n, relay, radius, cyclic, causal):
    # Rows not patched: the position band and the relay's key, disjoint, are exactly the row.
    want = patterns.star(relay, radius, cyclic, causal).mask(n)
    band = range_part_mask(n, n, *ops.star_band_part(radius, causal))
    col = torch.zeros(n, n, dtype=torch.bool)
    rows = torch.arange(n)
    col[rows > relay if causal else rows != relay, relay] = True
    keep = torch.ones(n, dtype=torch.bool)
    patched = ops.star_patched_rows(n, relay, radius, cyclic)
    keep[patched] = False
    _assert_partition([band[keep], col[keep]], want[keep])
    assert patched.numel() <= 4 * radius + 6
    # and the patched rows are recomputed from exactly their rows of the mask
    assert torch.equal(patterns.star(relay, radius, cyclic, causal).mask_rows(patched, n), want[patched])
