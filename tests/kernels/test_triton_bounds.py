"""Out-of-bounds accesses of the Triton kernels, caught without a GPU (issue 10).

Under ``TRITON_INTERPRET=1`` a kernel's loads and stores go to the real addresses of CPU tensors,
so a tensor flush against a ``PROT_NONE`` page (tests/guarded_memory.py) turns an unmasked
access one element past its end -- or, in the second mode, one element before its start --
into a SIGSEGV.  Here every launcher of kernels/{softmax,linear,sparse,hopfield}.py runs

- on inputs copied into guarded memory *and* with its own buffers (outputs, chunk states,
  partials, deltas: every tensor a torch call creates while it runs) guarded too
  (``GuardedAllocations``), in both modes ("end", "start");
- with every autotune config that the autotuner would try for the shape (``configs_for``),
  passed as ``config=`` -- the interpreter otherwise runs only the first -- on odd small shapes,
  those of the H200 report among them (linear dq: N = M in {1, 7} with D = 16, Dv = 32;
  N = 2049 with D = 32, Dv = 48, swept at N = 129: the same one-row tail; N = 300, D = Dv = 64
  with an initial state);
- in float32 and float16 (the addresses a bfloat16 run touches are the float16 ones).

Under the interpreter a config is just its two tile sizes: num_warps / num_stages mean nothing
there, so configs that differ only in those (or that clamp to the same tiles, as linear's do
on small head dims) are one run; each case names every config it stands for, and
:func:`test_every_config_is_swept` checks that no list entry is left out.  (So for linear
with D = 16, Dv = 32 all 13 entries are one tile, BLOCK_K = 16, BLOCK_V = 32: a fault that
only some of them give on a GPU comes from compiled code -- num_warps / num_stages -- which
the interpreter cannot see; that is compute-sanitizer's job on the GPU.)

Each sweep (a group of cases) runs in child processes (this file run as a script): a fault
kills only the child, the parent records the case that was running -- kernel, config, shape,
guard mode, and the kernel's Python frames that ``faulthandler`` wrote at the fault (the
interpreter runs the ``@triton.jit`` body as Python, so the frame is the faulting ``tl.load``)
-- and restarts the sweep after it.  The sweeps run as many at a time as there are cores
(sized for the 2-core CI machines: about 1 minute, 2 CPU-minutes, measured 1-2 minutes
depending on the machine's load).  So that the harness cannot silently do nothing, every
case also checks that its results equal the unguarded run's bit for bit (the guard only moves
memory), that the launcher's outputs really lie in guarded memory, and the "planted" sweep
checks that an unmasked out-of-range ``tl.load`` in a tiny kernel does fault, in both modes,
on a guarded input and on a launcher's own buffer, while the masked one does not.
"""
from __future__ import annotations

import concurrent.futures
import faulthandler
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if TESTS_DIR not in sys.path:  # when run as a script (the child); pytest already has it
    sys.path.insert(0, TESTS_DIR)

from guarded_memory import MODES, GuardedAllocations, guarded_copy, is_guarded  # noqa: E402

F32, F16 = torch.float32, torch.float16
TILE_MN = ("BLOCK_M", "BLOCK_N")
CHILD_TIMEOUT_S = 600
CHILD = (sys.executable, os.path.abspath(__file__))  # + sweep, first case, progress file

# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One launcher call: ``inputs()`` draws seeded CPU tensors (a dict), ``call(**inputs)``
    runs the launcher(s) and returns a dict of result tensors.  ``expect_fault``: only the
    planted self-checks."""
    sweep: str
    kernel: str
    shape: str
    dtype: torch.dtype
    configs: str
    where: str
    inputs: Callable[[], dict]
    call: Callable[..., dict]
    expect_fault: bool = False
    covers: frozenset = frozenset()

    @property
    def name(self):
        return (f"{self.kernel} | {self.shape} | {str(self.dtype).replace('torch.', '')} | "
                f"config {self.configs} | guard at {self.where}")

    @property
    def key(self):
        """Identifies the unguarded run that the guarded ones are compared with."""
        return self.name.rsplit(" | guard", 1)[0]


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


def _tile(config, names):
    return tuple(config.kwargs[n] for n in names)


def _groups(entries, names):
    """Autotune candidates grouped by the tiles they run with -> [(config, label, covers)].

    ``entries`` [(tag, raw list entry, tiles it runs with)]: the tag names the list and index
    ("linear.chunk#3"); linear clamps its tiles to the head dims, so several entries can run
    the same tiles.  ``config`` is one entry of the group (the launcher does the clamping),
    ``label`` the tiles and the tags, ``covers`` the tags that ran *unclamped* (for
    test_every_config_is_swept)."""
    groups: dict = {}
    for tag, raw, tile in entries:
        groups.setdefault(tile, []).append((tag, raw))
    out = []
    for tile, members in groups.items():
        label = " ".join(f"{n}={v}" for n, v in zip(names, tile)) + \
            " (" + ", ".join(tag for tag, _ in members) + ")"
        covers = frozenset(tag for tag, raw in members if _tile(raw, names) == tile)
        out.append((members[0][1], label, covers))
    return out


def _candidates(family, kind, raw_list, eligible, names):
    """``eligible`` (what configs_for gives: entries of ``raw_list``) as _groups entries."""
    index = {id(c): i for i, c in enumerate(raw_list)}
    return [(f"{family}.{kind}#{index[id(c)]}", c, _tile(c, names)) for c in eligible]


def _paired(per_kernel):
    """For a launcher that takes one config per kernel (fwd, then the backward's pair
    ``(dkdv, dq)``): the i-th group of each kernel's list together, shorter lists wrapping
    around, so that max(len) runs cover every group of every list -> [(configs, label, covers)]."""
    out = []
    for i in range(max(len(g) for g in per_kernel)):
        picked = [g[i % len(g)] for g in per_kernel]
        out.append((tuple(p[0] for p in picked), " + ".join(p[1] for p in picked),
                    frozenset().union(*(p[2] for p in picked))))
    return out


def _expand(sweep, kernel, shape, dtypes, configs, make_inputs, make_call):
    """Cases for every dtype x (config, label, covers) x guard mode.  ``make_inputs(dtype)``
    and ``make_call(config)`` give the Case's callables."""
    return [Case(sweep, kernel, shape, dt, label, where, (lambda dt=dt: make_inputs(dt)),
                 make_call(config), covers=covers)
            for dt in dtypes for config, label, covers in configs for where in MODES]


# ---- linear ------------------------------------------------------------------------------------

def _linear_cases(sweep, *, B=1, H=2, N, M=None, D, Dv, causal, fmap="elu", normalize=True,
                  init=False, grads=False, no_grad_out=False, chunk=None, dtypes=(F32, F16),
                  wide_only=False):
    """linear_fwd then linear_bwd (with the forward's out / den), one config for every kernel
    of the call (what ``config=`` does), for every entry of STATE_CONFIGS and CHUNK_CONFIGS
    as the launcher clamps it to the head dims (= every candidate of configs_for).  The
    buffers passed between the kernels do not depend on the config, so one config for all of
    them reaches every (kernel, config) pair the autotuner tries.  ``grads``:
    False, "S,z" (grad_S, grad_z) or "S,z,den" (and grad_den).  ``wide_only``: just the tiles
    with a 128-wide side (for head dims > 64, where they run unclamped)."""
    from attnkit.kernels import linear as kl
    from attnkit.kernels._flash import pow2

    M = N if M is None else M
    names = ("BLOCK_K", "BLOCK_V")
    entries = [(f"linear.{kind}#{i}", c, (min(c.kwargs["BLOCK_K"], pow2(D)),
                                          min(c.kwargs["BLOCK_V"], pow2(Dv))))
               for kind, raw in (("state", kl.STATE_CONFIGS), ("chunk", kl.CHUNK_CONFIGS))
               for i, c in enumerate(raw)]
    shape = (f"B={B} H={H} N={N} M={M} D={D} Dv={Dv} causal={causal} {fmap} "
             f"normalize={normalize} init={init} grads={grads} grad_out={not no_grad_out} "
             f"chunk={chunk or kl.DEFAULT_CHUNK}")

    def inputs(dt):
        g = torch.Generator().manual_seed(N * 1000 + D)
        t = dict(q=_randn(g, B, H, N, D, dtype=dt), k=_randn(g, B, H, M, D, dtype=dt),
                 v=_randn(g, B, H, M, Dv, dtype=dt),
                 go=None if no_grad_out else _randn(g, B, H, N, Dv, dtype=dt))
        if init:  # positive z0 keeps normalize's denominator away from 0
            t.update(s0=torch.randn(B, H, D, Dv, generator=g),
                     z0=torch.rand(B, H, D, generator=g) + 1)
        if grads:
            t.update(gs=torch.randn(B, H, D, Dv, generator=g), gz=torch.randn(B, H, D, generator=g))
        if grads == "S,z,den":
            t.update(gden=torch.randn(B, H, N, generator=g))
        return t

    def make_call(config):
        def call(q, k, v, go, s0=None, z0=None, gs=None, gz=None, gden=None):
            kw = dict(causal=causal, feature_map=fmap, normalize=normalize, eps=1e-3,
                      scale=0.5, initial_state=None if s0 is None else (s0, z0), chunk=chunk,
                      config=config)
            out, S, z, den = kl.linear_fwd(q, k, v, **kw)
            grads_ = kl.linear_bwd(go, q, k, v, grad_S=gs, grad_z=gz, grad_den=gden, out=out,
                                   den=den, **kw)
            return dict(out=out, S=S, z=z, den=den,
                        **dict(zip(("dq", "dk", "dv", "dS0", "dz0"), grads_)))
        return call

    configs = [g for g in _groups(entries, names)
               if not wide_only or "=128" in g[1]]  # (the label names the tiles)
    return _expand(sweep, "linear_fwd + linear_bwd", shape, dtypes, configs, inputs, make_call)


def linear_issue_cases():
    """The shapes of the H200 report (bf16, causal, elu, normalize; here float32 / float16)."""
    return (_linear_cases("linear-issue", N=1, D=16, Dv=32, causal=True)
            + _linear_cases("linear-issue", N=7, D=16, Dv=32, causal=True)
            + _linear_cases("linear-issue", N=300, D=64, Dv=64, causal=True, init=True,
                            grads="S,z", dtypes=(F16,))
            # The report's N = 2049 ends in a one-row chunk after 32 full ones; N = 129 has the same
            # one-row tail after 2: the addresses a tile touches depend on its chunk's position
            # relative to the end, not on how many full chunks came before (N = 513, 8 before,
            # was the sweep's long pole under the interpreter: CI time, session 11).
            + _linear_cases("linear-issue", N=129, D=32, Dv=48, causal=True, dtypes=(F16,)))


def linear_variant_cases():
    """Non-causal (M != N), initial state, grad_S / grad_z / grad_den, no grad_out, relu and
    identity, normalize off, chunk 16, head dims that are not powers of two, M = 0."""
    return (_linear_cases("linear-variants", N=7, M=13, D=24, Dv=40, causal=False, init=True,
                          grads="S,z,den")
            + _linear_cases("linear-variants", N=65, D=16, Dv=16, causal=True, fmap="relu",
                            normalize=False, init=True, grads="S,z,den")
            + _linear_cases("linear-variants", N=33, D=20, Dv=8, causal=True,
                            fmap="identity", normalize=False, chunk=16, grads="S,z,den")
            + _linear_cases("linear-variants", B=2, H=1, N=70, M=129, D=32, Dv=64,
                            causal=False, no_grad_out=True, grads="S,z,den", dtypes=(F16,))
            + _linear_cases("linear-variants", N=5, M=0, D=16, Dv=16, causal=False, init=True,
                            dtypes=(F32,))
            # head dims > 64: the 128-wide tiles run unclamped
            + _linear_cases("linear-variants", H=1, N=9, D=72, Dv=100, causal=True, chunk=16,
                            dtypes=(F32,), wide_only=True))


# ---- softmax -----------------------------------------------------------------------------------

def _softmax_cases(sweep, *, B=1, H=2, Hk=None, N, M, D, Dv, causal, mask=None, dropout=0.0,
                   dtypes=(F32, F16)):
    """softmax_fwd then softmax_bwd (config pair (dkdv, dq)) for every tile of the fwd, dkdv
    and dq lists; ``mask``: None, "bool" (broadcast [1, 1, N, M], read through stride 0) or
    "additive" (full [B, H, N, M])."""
    from attnkit.kernels import softmax as ksm

    Hk = H if Hk is None else Hk
    configs = _paired([_groups(_candidates("softmax", kind, ksm._CONFIG_LISTS[kind],
                                            ksm.configs_for(kind, D, Dv), TILE_MN), TILE_MN)
                       for kind in ("fwd", "dkdv", "dq")])
    shape = (f"B={B} H={H} Hk={Hk} N={N} M={M} D={D} Dv={Dv} causal={causal} mask={mask} "
             f"dropout={dropout}")

    def inputs(dt):
        g = torch.Generator().manual_seed(N * 1000 + M)
        t = dict(q=_randn(g, B, H, N, D, dtype=dt), k=_randn(g, B, Hk, M, D, dtype=dt),
                 v=_randn(g, B, Hk, M, Dv, dtype=dt), go=_randn(g, B, H, N, Dv, dtype=dt))
        if mask == "bool":
            t["mask"] = torch.rand(1, 1, N, M, generator=g) < 0.7
        elif mask == "additive":
            bias = torch.randn(B, H, N, M, generator=g)
            t["mask"] = bias.masked_fill(torch.rand(B, H, N, M, generator=g) < 0.2, -float("inf"))
        return t

    def make_call(config):
        fwd_cfg, dkdv_cfg, dq_cfg = config

        def call(q, k, v, go, mask=None):
            out, lse = ksm.softmax_fwd(q, k, v, mask, 0.4, causal, dropout, 7, config=fwd_cfg)
            dq, dk, dv = ksm.softmax_bwd(go, q, k, v, out, lse, mask, 0.4, causal, dropout, 7,
                                         config=(dkdv_cfg, dq_cfg))
            return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        return call

    return _expand(sweep, "softmax_fwd + softmax_bwd", shape, dtypes, configs, inputs, make_call)


def softmax_cases():
    """GQA + broadcast bool mask + dropout, N = M = 1 causal, N > 128 with an additive mask
    and head dims that are not powers of two; and the dropout keep-mask kernel (not tuned)."""
    from attnkit.kernels import softmax as ksm

    def keep_call():
        return dict(keep=ksm.dropout_keep_mask(1, 2, 7, 13, 0.3, 5, "cpu"))

    keep = [Case("softmax", "dropout_keep_mask", "B=1 H=2 N=7 M=13", torch.bool, "(not tuned)",
                 where, dict, keep_call) for where in MODES]
    return (_softmax_cases("softmax", H=4, Hk=2, N=7, M=13, D=16, Dv=32, causal=False,
                           mask="bool", dropout=0.25)
            + _softmax_cases("softmax", N=1, M=1, D=16, Dv=32, causal=True)
            + _softmax_cases("softmax", H=2, Hk=1, N=130, M=67, D=24, Dv=40, causal=True,
                             mask="additive", dtypes=(F16,))
            + keep)


# ---- packed sequences (VARLEN builds) -----------------------------------------------------------

# Lengths 0 and 1, a sequence over several chunks / tiles, the pack ending in a short one: the
# packed tensors' ends are the last sequence's, so a tile read or written past a sequence's end
# faults there (past an inner sequence it would land in the next one: the bit-for-bit tests in
# tests/kernels/test_*_triton_varlen.py catch that).
VARLEN_Q = [5, 0, 1, 70, 3]
VARLEN_K = [9, 4, 0, 33, 2]


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _linear_varlen_cases(*, H=2, D=24, Dv=40, causal, chunk=16, dtypes=(F32, F16)):
    """linear_varlen_fwd then linear_varlen_bwd over VARLEN_Q, one config for every kernel of
    the call, for every clamped entry of STATE_CONFIGS and CHUNK_CONFIGS (as _linear_cases)."""
    from attnkit.kernels import linear as kl
    from attnkit.kernels._flash import pow2

    names = ("BLOCK_K", "BLOCK_V")
    entries = [(f"linear.{kind}#{i}", c, (min(c.kwargs["BLOCK_K"], pow2(D)), min(c.kwargs["BLOCK_V"], pow2(Dv))))
               for kind, raw in (("state", kl.STATE_CONFIGS), ("chunk", kl.CHUNK_CONFIGS)) for i, c in enumerate(raw)]
    total = sum(VARLEN_Q)

    def inputs(dt):
        g = torch.Generator().manual_seed(total + D)
        return dict(q=_randn(g, total, H, D, dtype=dt), k=_randn(g, total, H, D, dtype=dt),
                    v=_randn(g, total, H, Dv, dtype=dt), go=_randn(g, total, H, Dv, dtype=dt),
                    cu=_offsets(VARLEN_Q))

    def make_call(config):
        def call(q, k, v, go, cu):
            kw = dict(causal=causal, feature_map="elu", normalize=True, eps=1e-3, scale=0.5, chunk=chunk,
                      config=config)
            out, S, z, den = kl.linear_varlen_fwd(q, k, v, cu, max(VARLEN_Q), **kw)
            dq, dk, dv = kl.linear_varlen_bwd(go, q, k, v, cu, max(VARLEN_Q), out=out, den=den, **kw)
            return dict(out=out, S=S, z=z, den=den, dq=dq, dk=dk, dv=dv)
        return call

    shape = f"lengths={VARLEN_Q} H={H} D={D} Dv={Dv} causal={causal} chunk={chunk}"
    return _expand("varlen", "linear_varlen_fwd + linear_varlen_bwd", shape, dtypes, _groups(entries, names), inputs,
                   make_call)


def _softmax_varlen_cases(*, H=4, Hk=2, D=24, Dv=40, causal, dtypes=(F32, F16)):
    """softmax_varlen_fwd then softmax_varlen_bwd over (VARLEN_Q, VARLEN_K), GQA, a window and
    softcap, for every tile of the fwd, dkdv and dq lists (as _softmax_cases)."""
    from attnkit.kernels import softmax as ksm

    configs = _paired([_groups(_candidates("softmax", kind, ksm._CONFIG_LISTS[kind], ksm.configs_for(kind, D, Dv),
                                           TILE_MN), TILE_MN) for kind in ("fwd", "dkdv", "dq")])
    total_q, total_k = sum(VARLEN_Q), sum(VARLEN_K)

    def inputs(dt):
        g = torch.Generator().manual_seed(total_q * 1000 + total_k)
        return dict(q=_randn(g, total_q, H, D, dtype=dt), k=_randn(g, total_k, Hk, D, dtype=dt),
                    v=_randn(g, total_k, Hk, Dv, dtype=dt), go=_randn(g, total_q, H, Dv, dtype=dt),
                    cu_q=_offsets(VARLEN_Q), cu_k=_offsets(VARLEN_K), sinks=torch.randn(H, generator=g))

    def make_call(config):
        fwd_cfg, dkdv_cfg, dq_cfg = config

        def call(q, k, v, go, cu_q, cu_k, sinks):
            args = (cu_q, cu_k, max(VARLEN_Q), max(VARLEN_K), 0.4, causal)
            options = dict(window_left=20, window_right=3, softcap=5.0)
            out, lse = ksm.softmax_varlen_fwd(q, k, v, *args, fwd_cfg, sinks=sinks, **options)
            dq, dk, dv = ksm.softmax_varlen_bwd(go, q, k, v, out, lse, *args, (dkdv_cfg, dq_cfg), **options)
            return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        return call

    shape = f"lengths_q={VARLEN_Q} lengths_k={VARLEN_K} H={H} Hk={Hk} D={D} Dv={Dv} causal={causal} window softcap sinks"
    return _expand("varlen", "softmax_varlen_fwd + softmax_varlen_bwd", shape, dtypes, configs, inputs, make_call)


def varlen_cases():
    """The packed-sequence launchers: linear causal and not, softmax causal (float16 only: the
    float32 addresses are the same rows, twice the bytes -- the linear cases run both)."""
    return (_linear_varlen_cases(causal=True) + _linear_varlen_cases(causal=False, dtypes=(F16,))
            + _softmax_varlen_cases(causal=True, dtypes=(F16,)))


# ---- sparse ------------------------------------------------------------------------------------

def _sparse_inputs(B, H, Nq, Nk, D, Dv, seed):
    def inputs(dt):
        g = torch.Generator().manual_seed(seed)
        return dict(q=_randn(g, B, H, Nq, D, dtype=dt), k=_randn(g, B, H, Nk, D, dtype=dt),
                    v=_randn(g, B, H, Nk, Dv, dtype=dt), go=_randn(g, B, H, Nq, Dv, dtype=dt),
                    delta=torch.randn(B, H, Nq, generator=g))
    return inputs


def _merged(lse):
    """A merged lse for the backward: the part's own, raised a little (more parts), and finite
    on the rows the part does not reach (other parts do)."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse + 0.5)


def _range_cases(sweep, part_name, view, lo, hi, *, B=1, H=2, Nq, Nk, D, Dv, dtypes=(F32, F16)):
    """sparse_range_fwd then sparse_range_bwd of one range part, every tile of the range lists."""
    from attnkit.kernels import sparse as ks

    configs = _paired([_groups(_candidates("sparse", f"range_{kind}",
                                            ks._CONFIG_LISTS[f"range_{kind}"],
                                            ks.configs_for(f"range_{kind}", D, Dv), TILE_MN),
                               TILE_MN) for kind in ("fwd", "dkdv", "dq")])
    shape = (f"{part_name}: view={list(view)} lo={list(lo)} hi={list(hi)} B={B} H={H} Nq={Nq} "
             f"Nk={Nk} D={D} Dv={Dv}")

    def make_call(config):
        fwd_cfg, dkdv_cfg, dq_cfg = config

        def call(q, k, v, go, delta):
            out, lse = ks.sparse_range_fwd(q, k, v, view, lo, hi, 0.3, config=fwd_cfg)
            dq, dk, dv = ks.sparse_range_bwd(go, q, k, v, _merged(lse), delta, view, lo, hi, 0.3,
                                             config=(dkdv_cfg, dq_cfg))
            return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        return call

    return _expand(sweep, "sparse_range_fwd + sparse_range_bwd", shape, dtypes, configs,
                   _sparse_inputs(B, H, Nq, Nk, D, Dv, Nq * 100 + Nk), make_call)


def _block_cases(sweep, *, B=1, H=2, Hl, nb, block, causal, D, Dv, dtypes=(F32, F16)):
    """block_sparse_fwd then block_sparse_bwd on a random layout (one query block row empty),
    every tile that configs_for allows for the block."""
    from attnkit import patterns
    from attnkit.kernels import sparse as ks

    configs = _paired([_groups(_candidates("sparse", f"block_{kind}",
                                            ks._CONFIG_LISTS[f"block_{kind}"],
                                            ks.configs_for(f"block_{kind}", D, Dv, block),
                                            TILE_MN), TILE_MN)
                       for kind in ("fwd", "dkdv", "dq")])
    N = nb * block
    shape = (f"B={B} H={H} layout heads={Hl} nb={nb} block={block} N={N} D={D} Dv={Dv} "
             f"causal={causal}")
    g = torch.Generator().manual_seed(block)
    layout = torch.rand(Hl, nb, nb, generator=g) < 0.6
    layout[:, torch.arange(nb), torch.arange(nb)] = True
    layout[0, nb - 1] = False  # the last query block row attends nothing: 0 / -inf
    lists = patterns.block_layout(layout, block, causal=causal).index_lists()
    base_inputs = _sparse_inputs(B, H, N, N, D, Dv, N)

    def inputs(dt):
        t = base_inputs(dt)
        t.update(zip(("row_ptr", "col_idx", "col_ptr", "row_idx"), lists))
        return t

    def make_call(config):
        fwd_cfg, dkdv_cfg, dq_cfg = config

        def call(q, k, v, go, delta, row_ptr, col_idx, col_ptr, row_idx):
            out, lse = ks.block_sparse_fwd(q, k, v, row_ptr, col_idx, block, causal, 0.3,
                                           config=fwd_cfg)
            dq, dk, dv = ks.block_sparse_bwd(go, q, k, v, _merged(lse), delta, row_ptr, col_idx,
                                             col_ptr, row_idx, block, causal, 0.3,
                                             config=(dkdv_cfg, dq_cfg))
            return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
        return call

    return _expand(sweep, "block_sparse_fwd + block_sparse_bwd", shape, dtypes, configs, inputs,
                   make_call)


def sparse_cases():
    """Every range part of strided(4) (causal and not) and fixed(8, summary 3) at N = 37, a
    part whose groups share keys (the accumulating dK/dV path), and block layouts with blocks
    65 (every block config fits; 65 = one row past a 64-tile), 24 and 3."""
    from attnkit.ops import sparse as ops_sparse

    n = 37
    band_causal = ops_sparse.strided_parts(n, 4, True)[0]
    band, columns_before, columns_after = ops_sparse.strided_parts(n, 4, False)
    cases = _range_cases("sparse", "strided(4) causal band", *band_causal, Nq=n, Nk=n, D=16,
                         Dv=24)
    cases += _range_cases("sparse", "strided(4) band", *band, H=1, Nq=n, Nk=n, D=24, Dv=16,
                          dtypes=(F16,))
    cases += _range_cases("sparse", "strided(4) columns before", *columns_before, H=1, Nq=n,
                          Nk=n, D=16, Dv=24, dtypes=(F32,))
    cases += _range_cases("sparse", "strided(4) columns after", *columns_after, H=1, Nq=n,
                          Nk=n, D=16, Dv=24, dtypes=(F16,))
    own, summary = ops_sparse.fixed_parts(n, 8, 3, False)
    n_sum = len(ops_sparse.fixed_summary_positions(n, 8, 3))
    cases += _range_cases("sparse", "fixed(8, 3) own block", *own, Nq=n, Nk=n, D=16, Dv=16,
                          dtypes=(F16,))
    for i, part in enumerate(summary):
        cases += _range_cases("sparse", f"fixed(8, 3) summary part {i}", *part, H=1, Nq=n,
                              Nk=n_sum, D=16, Dv=16, dtypes=(F32,))
    cases += _range_cases("sparse", "groups share keys", [3, 1, 3, 0, 1], [0, 1, 1, 0],
                          [5, 1, 2, 0], H=1, Nq=30, Nk=20, D=16, Dv=16, dtypes=(F32,))
    cases += _range_cases("sparse", "n=1", (1, 0, 1, 0, 1), (-8, 1, 1, 0), (0, 1, 1, 0), Nq=1,
                          Nk=1, D=16, Dv=32, dtypes=(F16,))
    cases += _block_cases("sparse", Hl=2, nb=2, block=65, causal=True, D=16, Dv=24,
                          dtypes=(F16,))
    cases += _block_cases("sparse", Hl=1, nb=3, block=24, causal=False, D=16, Dv=16,
                          dtypes=(F32,))
    cases += _block_cases("sparse", Hl=2, nb=5, block=3, causal=True, D=20, Dv=16)
    return cases


# ---- hopfield ----------------------------------------------------------------------------------

def _hopfield_inputs(B, H, S, N, D, Dv):
    def inputs(dt):
        g = torch.Generator().manual_seed(S * 1000 + N)
        stored = _randn(g, B, H, N, D, dtype=dt)
        state = (stored[:, :, :S] if S <= N else _randn(g, B, H, S, D, dtype=dt)) \
            + 0.3 * _randn(g, B, H, S, D, dtype=dt)
        return dict(state=state.contiguous(), stored=stored,
                    values=None if Dv is None else _randn(g, B, H, N, Dv, dtype=dt))
    return inputs


def _hopfield_update_cases(*, B=1, H=2, S, N, D, Dv, steps, tol, final_state, dtypes=(F32, F16)):
    """The fused update with every tile of configs_for(dmax, S)."""
    from attnkit.kernels import hopfield as kh

    from attnkit.kernels._flash import pow2
    names = ("BLOCK_S", "BLOCK_N")
    dmax = max(pow2(D), pow2(D if Dv is None else Dv))
    configs = _groups(_candidates("hopfield", "update", kh.UPDATE_CONFIGS,
                                  kh.configs_for(dmax, S), names), names)
    shape = (f"fused: B={B} H={H} S={S} N={N} D={D} Dv={Dv} steps={steps} tol={tol} "
             f"final_state={final_state}")

    def make_call(config):
        def call(state, stored, values):
            out, states, lse, applied = kh.hopfield_update_fwd(
                state, stored, values, 0.7, steps, tol, final_state, split=False, config=config)
            return dict(out=out, states=states, lse=lse, applied=applied)
        return call

    return _expand("hopfield", "hopfield_update_fwd", shape, dtypes, configs,
                   _hopfield_inputs(B, H, S, N, D, Dv), make_call)


def _hopfield_split_cases(*, B=1, H=2, S, N, D, Dv, steps, tol, final_state, split_rows,
                          dtypes=(F32, F16)):
    """The split-N path (fixed tiles; the chunk length ``split_rows`` is its only knob)."""
    from attnkit.kernels import hopfield as kh

    shape = (f"split-N: B={B} H={H} S={S} N={N} D={D} Dv={Dv} steps={steps} tol={tol} "
             f"final_state={final_state} split_rows={split_rows}")

    def call(state, stored, values):
        out, states, lse, applied = kh.hopfield_update_fwd(
            state, stored, values, 0.7, steps, tol, final_state, split=True,
            split_rows=split_rows)
        return dict(out=out, states=states, lse=lse, applied=applied)

    return _expand("hopfield", "hopfield_update_fwd", shape, dtypes,
                   [(None, "(not tuned: BLOCK_S=16 BLOCK_N=64)", frozenset())],
                   _hopfield_inputs(B, H, S, N, D, Dv), lambda _c: call)


def _hopfield_energy_cases(*, B=1, H=2, S, N, D, dtypes=(F32, F16)):
    """The energy with its default tiles and every update tile (it takes any BLOCK_S/BLOCK_N)."""
    from attnkit.kernels import hopfield as kh

    names = ("BLOCK_S", "BLOCK_N")
    # (tags "energy.update#i": the update list's tiles run by the energy kernel)
    configs = [(None, "default (BLOCK_S=64 BLOCK_N=64)", frozenset())] + _groups(
        _candidates("energy", "update", kh.UPDATE_CONFIGS, kh.UPDATE_CONFIGS, names), names)

    def make_call(config):
        def call(state, stored, values):
            energy, lse = kh.hopfield_energy_fwd(state, stored, 0.7, config=config)
            return dict(energy=energy, lse=lse)
        return call

    return _expand("hopfield", "hopfield_energy_fwd", f"B={B} H={H} S={S} N={N} D={D}", dtypes,
                   configs, _hopfield_inputs(B, H, S, N, D, None), make_call)


def hopfield_cases():
    return (_hopfield_update_cases(S=7, N=13, D=16, Dv=24, steps=3, tol=1e-3, final_state=True)
            + _hopfield_update_cases(S=70, N=100, D=20, Dv=None, steps=2, tol=None,
                                     final_state=False, dtypes=(F16,))
            + _hopfield_update_cases(S=1, N=1, D=16, Dv=None, steps=1, tol=None,
                                     final_state=False)
            + _hopfield_split_cases(S=5, N=130, D=16, Dv=24, steps=3, tol=1e-3, final_state=True,
                                    split_rows=64)
            + _hopfield_split_cases(S=16, N=64, D=24, Dv=None, steps=2, tol=None,
                                    final_state=False, split_rows=128)
            + _hopfield_split_cases(S=3, N=200, D=16, Dv=8, steps=2, tol=None,
                                    final_state=False, split_rows=128, dtypes=(F16,))
            + _hopfield_energy_cases(S=70, N=13, D=24))


# ---- planted: the harness's own check ----------------------------------------------------------

PLANTED_N, PLANTED_BLOCK = 1000, 16


@triton.jit
def _planted_kernel(X, Y, n, offset, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """Y[:BLOCK] = X[offset : offset + BLOCK], the load masked to [0, n) or not."""
    offs = offset + tl.arange(0, BLOCK)
    if MASKED:
        x = tl.load(X + offs, mask=(offs >= 0) & (offs < n), other=0.0)
    else:
        x = tl.load(X + offs)
    tl.store(Y + tl.arange(0, BLOCK), x)


def _planted_launcher(x, offset, masked):
    """A launcher like the real ones: ``x`` None = read a buffer it allocates itself."""
    if x is None:
        x = torch.arange(PLANTED_N, dtype=F32)
    y = torch.empty(PLANTED_BLOCK, dtype=F32)
    wrap_triton(_planted_kernel)[(1,)](x, y, PLANTED_N, offset, MASKED=masked,
                                       BLOCK=PLANTED_BLOCK)
    return dict(y=y)


def planted_cases():
    """A tile one element past the end ("end") / one element before the start ("start") of a
    1000-element buffer -- a guarded input or the launcher's own buffer: unmasked must fault,
    masked must not (and must read the in-range elements)."""
    cases = []
    for source in ("input", "launcher buffer"):
        for where in MODES:
            offset = PLANTED_N - PLANTED_BLOCK + 1 if where == "end" else -1
            for masked in (True, False):
                def inputs(source=source):
                    return dict(x=torch.arange(PLANTED_N, dtype=F32) if source == "input" else None)

                def call(x, offset=offset, masked=masked):
                    return _planted_launcher(x, offset, masked)

                cases.append(Case("planted", f"planted {'masked' if masked else 'UNMASKED'} load",
                                  f"{source}, offset {offset}, n={PLANTED_N}", F32, "-", where,
                                  inputs, call, expect_fault=not masked))
    return cases


SWEEPS = {  # name -> case builder; the most expensive first (they start first)
    "linear-issue": linear_issue_cases,
    "linear-variants": linear_variant_cases,
    "sparse": sparse_cases,
    "softmax": softmax_cases,
    "varlen": varlen_cases,
    "hopfield": hopfield_cases,
    "planted": planted_cases,
}

# ----------------------------------------------------------------------------------------------
# the child: run a sweep from case ``start`` on, reporting progress line by line
# ----------------------------------------------------------------------------------------------


def _same(a, b):
    """Bit-for-bit equal values (NaN = NaN), dtypes and shapes."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _run_case(case, baseline):
    """Run ``case`` guarded; compare with the unguarded run (``baseline``: key -> results).
    Returns None or what is wrong."""
    if case.key not in baseline:
        baseline[case.key] = case.call(**case.inputs())
    expected = baseline[case.key]
    inputs = {k: v if v is None else guarded_copy(v, case.where)
              for k, v in case.inputs().items()}
    with GuardedAllocations(case.where) as mode:
        got = case.call(**inputs)
    problems = []
    if mode.count == 0:
        problems.append("no allocation was routed into guarded memory")
    for name, t in got.items():
        if t.numel() and not is_guarded(t):
            problems.append(f"output {name} is not in guarded memory")
        if not _same(t, expected[name]):
            diff = (t.double() - expected[name].double()).abs().nan_to_num(float("inf"))
            problems.append(f"{name} differs from the unguarded run ({int((diff > 0).sum())} "
                            f"entries, max |diff| {diff.max().item():.3g})")
    return "; ".join(problems) or None


def child_main(sweep, start, progress_path):
    """Run cases ``start..`` of ``sweep``; append one JSON line per event to progress_path, and
    let faulthandler write the Python stack to progress_path + '.fault' on a fault."""
    torch.set_num_threads(1)
    import triton_interpreter_nested_calls  # as tests/conftest.py installs it (a script: no conftest)

    triton_interpreter_nested_calls.install()
    fault_file = open(progress_path + ".fault", "a")
    faulthandler.enable(file=fault_file, all_threads=False)
    cases = SWEEPS[sweep]()
    baseline: dict = {}
    fd = os.open(progress_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)

    def report(**event):
        os.write(fd, (json.dumps(event) + "\n").encode())

    for i in range(start, len(cases)):
        report(event="start", i=i)
        t0 = time.perf_counter()
        try:
            error = _run_case(cases[i], baseline)
        except Exception as exc:  # noqa: BLE001 - reported as this case's failure
            error = f"{type(exc).__name__}: {exc}"
        report(event="done", i=i, error=error, seconds=round(time.perf_counter() - t0, 3))
    os.close(fd)


# ----------------------------------------------------------------------------------------------
# the parent: run a sweep to the end, restarting after each fault
# ----------------------------------------------------------------------------------------------


KERNELS_DIR = os.path.join(os.path.dirname(TESTS_DIR), "kernels") + os.sep


def _kernel_frames(fault_text):
    """The frames of a faulthandler dump that lie in kernels/ (innermost first: the faulting
    tl.load / tl.store line of the @triton.jit function, then its callers up to the
    launcher), else every frame."""
    lines = [ln.strip() for ln in fault_text.splitlines() if ln.strip().startswith("File")]
    ours = [ln for ln in lines if KERNELS_DIR in ln]
    return "\n      ".join(ours or lines)


def _signal_name(rc):
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"exit status {rc}"


def run_sweep(sweep):
    """-> (failures: [str], cases run).  A case fails when it faults (unless planted to),
    raises, or differs from its unguarded run; a planted fault that does not happen fails too."""
    cases = SWEEPS[sweep]()
    failures, done, start = [], 0, 0
    env = dict(os.environ, TRITON_INTERPRET="1")
    with tempfile.TemporaryDirectory(prefix=f"bounds-{sweep}-") as tmp:
        while start < len(cases):
            progress = os.path.join(tmp, f"from{start}.jsonl")
            open(progress, "w").close()
            open(progress + ".fault", "w").close()
            try:
                proc = subprocess.run([*CHILD, sweep, str(start), progress], env=env,
                                      capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
                rc, stderr = proc.returncode, proc.stderr
            except subprocess.TimeoutExpired:
                rc, stderr = None, "timed out"
            events = [json.loads(ln) for ln in open(progress) if ln.strip()]
            started = [e["i"] for e in events if e["event"] == "start"]
            for e in events:
                if e["event"] != "done":
                    continue
                done += 1
                case = cases[e["i"]]
                if case.expect_fault:
                    failures.append(f"planted out-of-bounds access did NOT fault (the harness "
                                    f"is blind): {case.name}" + (f" ({e['error']})" if e["error"]
                                                                 else ""))
                elif e["error"]:
                    failures.append(f"{case.name}: {e['error']}")
            finished = {e["i"] for e in events if e["event"] == "done"}
            crashed = [i for i in started if i not in finished]
            if rc == 0 and not crashed:
                break
            if not crashed:  # died before its first case: nothing more will run
                failures.append(f"child for sweep {sweep} from case {start} failed ({rc}): "
                                f"{stderr[-2000:]}")
                break
            i = crashed[0]
            what = _signal_name(rc) if rc is not None else f"timeout after {CHILD_TIMEOUT_S} s"
            if not cases[i].expect_fault or rc not in (-signal.SIGSEGV, -signal.SIGBUS):
                frames = _kernel_frames(open(progress + ".fault").read())
                failures.append(f"{what} in {cases[i].name}\n      {frames}")
            done += 1
            start = i + 1
    return failures, done


# ----------------------------------------------------------------------------------------------
# the tests
# ----------------------------------------------------------------------------------------------


class _Sweeps:
    """run_sweep in a thread pool (each child is single-threaded): ``start`` queues a sweep,
    ``result`` waits for it (queueing it first if needed)."""

    def __init__(self, workers):
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        self.futures = {}

    def start(self, name):
        if name not in self.futures:
            self.futures[name] = self.pool.submit(run_sweep, name)

    def result(self, name):
        self.start(name)
        return self.futures[name].result()


@pytest.fixture(scope="module")
def sweeps(request):
    """All sweeps selected in this session start at once, as many at a time as there are
    cores, the most expensive first -- so the two cores of a CI machine both work.  Under
    pytest-xdist (each worker sees every collected item) each test runs just its own."""
    selected = {item.callspec.params["sweep"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")
                and "sweep" in item.callspec.params}
    runner = _Sweeps(max(1, min(len(selected), os.cpu_count() or 1)))
    if not hasattr(request.config, "workerinput"):
        for name in SWEEPS:
            if name in selected:
                runner.start(name)
    yield runner
    runner.pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("sweep", [name for name in SWEEPS if name != "planted"])
def test_no_out_of_bounds_access(sweep, sweeps):
    """Every case of the sweep runs to the end in both guard modes, without a fault, with
    results equal to the unguarded run's."""
    failures, ran = sweeps.result(sweep)
    total = len(SWEEPS[sweep]())
    assert ran == total, f"{sweep}: ran {ran} of {total} cases"
    assert not failures, f"{len(failures)} of {ran} cases of sweep {sweep!r} failed:\n  - " + \
        "\n  - ".join(failures)


@pytest.mark.parametrize("sweep", ["planted"])
def test_planted_out_of_bounds_access_faults(sweep, sweeps):
    """The harness sees what it must: an unmasked load one element past the end / before the
    start of a guarded input or a launcher's own buffer faults; the masked one does not."""
    failures, ran = sweeps.result(sweep)
    assert ran == len(SWEEPS[sweep]())
    assert not failures, "\n".join(failures)


def test_every_config_is_swept():
    """Every entry of every autotune list runs unclamped and unfiltered in some case (so no
    config is only ever seen shrunk to a small head dim or block)."""
    from attnkit.kernels import hopfield as kh
    from attnkit.kernels import linear as kl
    from attnkit.kernels import softmax as ksm
    from attnkit.kernels import sparse as ks

    lists = {"linear.state": kl.STATE_CONFIGS, "linear.chunk": kl.CHUNK_CONFIGS,
             "hopfield.update": kh.UPDATE_CONFIGS, "energy.update": kh.UPDATE_CONFIGS}
    lists.update({f"softmax.{k}": v for k, v in ksm._CONFIG_LISTS.items()})
    lists.update({f"sparse.{k}": v for k, v in ks._CONFIG_LISTS.items()})
    wanted = {f"{name}#{i}" for name, raw in lists.items() for i in range(len(raw))}
    covered = frozenset().union(*(c.covers for build in SWEEPS.values() for c in build()))
    assert wanted <= covered, f"never run unclamped: {sorted(wanted - covered)}"


def test_sweep_cases_are_named_uniquely():
    for name, build in SWEEPS.items():
        names = [c.name for c in build()]
        assert names and len(set(names)) == len(names), f"{name}: no cases or duplicate names"


if __name__ == "__main__":  # the child process
    child_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])


def test_autotuning_switch_is_off_in_tests_and_scoped():
    # tests/conftest.py turns autotuning off (ATTNKIT_TRITON_AUTOTUNE=0) so that numerics tests
    # compile one config per kernel; autotuning(True) turns it on for one block only.
    from attnkit.kernels._flash import autotuning, autotuning_enabled

    assert autotuning_enabled() == (os.environ["ATTNKIT_TRITON_AUTOTUNE"] != "0")
    before = autotuning_enabled()
    with autotuning(not before):
        assert autotuning_enabled() is (not before)
    assert autotuning_enabled() is before


@pytest.mark.autotune
def test_the_autotune_marker_turns_autotuning_on():
    from attnkit.kernels._flash import autotuning_enabled

    assert autotuning_enabled()


def test_a_fixed_config_launch_skips_configs_that_run_out_of_resources(monkeypatch):
    # With autotuning off, a GPU launch runs the first candidate that compiles (the autotuner
    # skips an OutOfResources config; a fixed-config launch must too), and remembers it.
    from triton.runtime.errors import OutOfResources

    from attnkit.kernels import _flash

    tried = []

    def fake_launch(kernel, config, grid, args, consts, names):
        tried.append(config)
        if config in ("too big", "also too big"):
            raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(_flash, "_launch_with", fake_launch)
    monkeypatch.setattr(_flash, "_FIRST_FITTING", {})
    configs = ["too big", "also too big", "fits", "unused"]
    _flash._launch_first_fitting("kernel", configs, None, (), {"D": 256}, None)
    assert tried == ["too big", "also too big", "fits"]
    tried.clear()
    _flash._launch_first_fitting("kernel", configs, None, (), {"D": 256}, None)
    assert tried == ["fits"]
    with pytest.raises(OutOfResources):
        _flash._launch_first_fitting("kernel", ["too big"], None, (), {"D": 128}, None)
