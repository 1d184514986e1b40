"""Sparse attention cases: attnkit.sparse_attention against what a user would run instead.

Peers: torch SDPA with the pattern as a dense boolean mask; FlexAttention (``torch.compile``d)
with a BlockMask built from the same mask; and dense causal SDPA — a different function, shown
for its cost only (the issue's "≥ 4× dense causal" target).  The masks are built here from the
pattern definitions of the foundation issue, independently of ``attnkit.patterns``; the attnkit
runs check once that ``pattern.mask(N)`` agrees.

FLOPs are counted on the kept entries only (effective FLOP/s, the same count for every
implementation): 4·B·H·D·(number of True entries of the mask).

Full sizes (issue 4): B=1, H=8, N=4096, D=64, float32, forward — strided (stride 64, causal),
fixed (stride 64, summary 8, causal) and star (relay 0, radius 1); strided and star also
forward+backward.  ``--quick``: strided, N=1024, stride 32.

CUDA (issue 10, :func:`cuda_cases`): bfloat16, B=1, H=8, N=16384, D=128 — strided(128) forward
against FlexAttention (target >= 3x; ``--quick``: this case only, without the attnkit dense
causal peer, whose causal kernels would be autotuned for it alone), then strided
forward+backward.  (fixed and star stay CPU cases: each new pattern recompiles FlexAttention, and
the GPU sweep has five minutes.)  There FlexAttention gets the pattern as
a ``mask_mod`` computed from the indices (:data:`MASK_MODS`), as a user would write it, rather
than a lookup into the dense mask (which the CPU runs keep, so that their recorded figures stay
comparable); the dense masks are built on the GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .harness import Case, Impl, Unavailable, attnkit_impls, dtype_name, reference_skip, seeded_randn

FAMILY = "sparse"


def strided_mask(n: int, stride: int, causal: bool = True, device=None) -> torch.Tensor:
    """Child et al. 2019: 0 ≤ i−j ≤ stride (|i−j| ≤ stride if not causal) or (i−j) mod stride = 0."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    d = i - j
    local = (d >= 0) & (d <= stride) if causal else d.abs() <= stride
    mask = local | (torch.remainder(d, stride) == 0)
    return mask & (j <= i) if causal else mask


def fixed_mask(n: int, stride: int, summary: int = 1, causal: bool = True, device=None) -> torch.Tensor:
    """Same block (⌊i/stride⌋ = ⌊j/stride⌋) or a summary column (j mod stride ≥ stride − summary)."""
    i = torch.arange(n, device=device).unsqueeze(1)
    j = torch.arange(n, device=device).unsqueeze(0)
    mask = (i // stride == j // stride) | (j % stride >= stride - summary)
    return mask & (j <= i) if causal else mask


def star_mask(n: int, relay: int = 0, radius: int = 1, cyclic: bool = False, causal: bool = False,
              device=None) -> torch.Tensor:
    """Star transformer: satellites see satellites within ``radius`` (numbered without the relay)
    and the relay; the relay sees everything."""
    pos = torch.arange(n, device=device)
    sat = pos - (pos > relay).long()  # satellite number of each non-relay position
    dist = (sat.unsqueeze(1) - sat.unsqueeze(0)).abs()
    if cyclic:
        dist = torch.minimum(dist, (n - 1) - dist)
    is_relay = pos == relay
    mask = (dist <= radius) & ~is_relay.unsqueeze(1) & ~is_relay.unsqueeze(0)
    mask |= is_relay.unsqueeze(0) | is_relay.unsqueeze(1)
    if causal:
        mask &= pos.unsqueeze(0) <= pos.unsqueeze(1)
    return mask


# pattern name (also its attnkit.patterns factory) -> the bench's own mask builder
PATTERNS = {"strided": strided_mask, "fixed": fixed_mask, "star": star_mask}


# FlexAttention mask_mods of the same patterns: mod(b, h, q_idx, kv_idx) -> bool, written with
# tensor operations only, so they also evaluate on broadcast index grids (the tests compare them
# with the mask builders above that way).

def strided_mod(n: int, stride: int, causal: bool = True):
    def mod(b, h, q, kv):
        d = q - kv
        local = ((d >= 0) & (d <= stride)) if causal else (d.abs() <= stride)
        keep = local | (torch.remainder(d, stride) == 0)
        return (keep & (kv <= q)) if causal else keep
    return mod


def fixed_mod(n: int, stride: int, summary: int = 1, causal: bool = True):
    def mod(b, h, q, kv):
        keep = (q // stride == kv // stride) | (torch.remainder(kv, stride) >= stride - summary)
        return (keep & (kv <= q)) if causal else keep
    return mod


def star_mod(n: int, relay: int = 0, radius: int = 1, cyclic: bool = False, causal: bool = False):
    def mod(b, h, q, kv):
        sq, skv = q - (q > relay).to(q.dtype), kv - (kv > relay).to(kv.dtype)  # satellite numbers
        dist = (sq - skv).abs()
        if cyclic:
            dist = torch.minimum(dist, (n - 1) - dist)
        rq, rkv = q == relay, kv == relay
        keep = ((dist <= radius) & ~rq & ~rkv) | rq | rkv
        return (keep & (kv <= q)) if causal else keep
    return mod


MASK_MODS = {"strided": strided_mod, "fixed": fixed_mod, "star": star_mod}


def _inputs(b, h, n, d, dtype, seed, mask_fn):
    def make(device):
        device = torch.device(device)
        # Built where it is used: a 16384² mask takes seconds to build on the CPU (int64 index
        # grids of 2 GiB), milliseconds on a GPU.
        mask = mask_fn(n, device=device) if device.type == "cuda" else mask_fn(n).to(device)
        return {
            "q": seeded_randn((b, h, n, d), dtype, device, seed),
            "k": seeded_randn((b, h, n, d), dtype, device, seed + 1),
            "v": seeded_randn((b, h, n, d), dtype, device, seed + 2),
            "mask": mask,
        }
    return make


# attnkit.patterns' own masks are checked against the bench's at this size at most (the
# definitions do not depend on N; building an N² mask on the CPU at N = 16384 takes seconds).
PATTERN_CHECK_N = 4096


def _attnkit(kind: str, kwargs: dict):
    def call(backend):
        state = {}

        def fn(x):
            import attnkit

            if "pattern" not in state:
                pattern = getattr(attnkit.patterns, kind)(**kwargs)
                n = x["q"].shape[-2]
                if n <= PATTERN_CHECK_N:
                    ours = x["mask"]
                else:
                    n = PATTERN_CHECK_N
                    ours = PATTERNS[kind](n, **kwargs, device=x["mask"].device)
                theirs = pattern.mask(n).to(ours.device)
                if not torch.equal(theirs.reshape(-1, n, n)[0], ours):
                    raise RuntimeError(f"attnkit.patterns.{kind}(**{kwargs}).mask({n}) differs from the "
                                       "bench's construction from the issue's definition")
                state["pattern"] = pattern
            return attnkit.sparse_attention(x["q"], x["k"], x["v"], state["pattern"], backend=backend)
        return fn
    return call


def _sdpa_masked(x):
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=x["mask"])


def _sdpa_causal(x):
    return F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True)


def _attnkit_causal(x):
    import attnkit

    return attnkit.softmax_attention(x["q"], x["k"], x["v"], is_causal=True)


_FLEX: dict = {}


def _compiled_flex():
    """torch.compile(flex_attention), built once per process; Unavailable if it cannot be."""
    if "fn" not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            _FLEX["fn"] = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except Exception as exc:  # noqa: BLE001 - any failure means "not available here"
            _FLEX["fn"] = exc
    if isinstance(_FLEX["fn"], Exception):
        raise Unavailable(f"FlexAttention cannot be set up here: {type(_FLEX['fn']).__name__}: {_FLEX['fn']}")
    return _FLEX["fn"]


def _flex(mask_mod=None):
    """FlexAttention with a BlockMask from ``mask_mod``, or else from a lookup into the case's
    dense mask (built, and compiled, on the first call, which is a warmup call)."""
    state = {}

    def fn(x):
        flex, create_block_mask = _compiled_flex()
        if "block_mask" in state:
            return flex(x["q"], x["k"], x["v"], block_mask=state["block_mask"])
        dense = x["mask"]
        n = dense.shape[-1]
        try:
            mod = mask_mod if mask_mod is not None else (lambda b, h, i, j: dense[i, j])
            block_mask = create_block_mask(mod, None, None, n, n, device=str(dense.device))
            out = flex(x["q"], x["k"], x["v"], block_mask=block_mask)
        except Exception as exc:  # noqa: BLE001 - torch.compile of flex may fail on a machine
            msg = str(exc).strip().splitlines()
            raise Unavailable(f"torch.compile(flex_attention) failed here: {type(exc).__name__}: "
                              f"{msg[0] if msg else ''}") from exc
        state["block_mask"] = block_mask
        return out

    return fn


def count_kept(kind: str, kwargs: dict, n: int, device: torch.device) -> int:
    """The number of True entries of the pattern's N×N mask, counted where the case runs (on
    the CPU the 16384² strided mask takes ~10 s to build; on a GPU, milliseconds)."""
    device = torch.device(device)
    mask = PATTERNS[kind](n, **kwargs, device=device if device.type == "cuda" else None)
    return int(mask.sum())


def make_case(kind: str, kwargs: dict, b: int, h: int, n: int, d: int, dtype: torch.dtype, mode: str,
              device: torch.device, seed: int = 0, targets: dict | None = None,
              dense_attnkit: bool = True, priority: int = 0) -> Case:
    """``dense_attnkit``: also time attnkit's own dense causal kernel (the issue's ">= 4x dense
    causal" comparison)."""
    mask_fn = PATTERNS[kind]
    cuda = torch.device(device).type == "cuda"
    kept = count_kept(kind, kwargs, n, device)
    size = torch.empty((), dtype=dtype).element_size()
    impls = attnkit_impls(FAMILY, device, _attnkit(kind, kwargs),
                          dtype=dtype, reference_skip_reason=reference_skip(b * h * n * n * size, device, dtype))
    impls.append(Impl("torch SDPA (dense mask)", "peer", fn=_sdpa_masked))
    flex = Impl("FlexAttention (BlockMask)", "peer", fn=_flex(MASK_MODS[kind](n, **kwargs) if cuda else None),
                note="mask_mod from the indices" if cuda else "")
    if mode == "fwd+bwd" and device.type == "cpu":
        flex.unavailable = "FlexAttention has no backward on CPU (torch raises NotImplementedError)"
    impls.append(flex)
    impls.append(Impl("torch SDPA (dense causal)", "peer", fn=_sdpa_causal, same_result=False,
                      note="dense causal, not the pattern: cost comparison only"))
    if dense_attnkit:
        impls.append(Impl("attnkit dense causal", "peer", fn=_attnkit_causal, same_result=False,
                          note="our dense causal softmax kernel: the issue's >= 4x target"))
    args = ",".join(f"{k}={v}" for k, v in kwargs.items())
    name = f"{kind}({args})-{dtype_name(dtype)}-N{n}-D{d}"
    params = {"B": b, "H": h, "N": n, "D": d, "dtype": dtype_name(dtype), "pattern": f"{kind}({args})",
              "density": round(kept / (n * n), 5)}
    return Case(FAMILY, name, mode, params, 4.0 * b * h * d * kept * (3.5 if mode == "fwd+bwd" else 1.0),
                _inputs(b, h, n, d, dtype, seed, lambda m, device=None: mask_fn(m, **kwargs, device=device)),
                impls, grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else (), targets=dict(targets or {}),
                priority=priority)


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        return cuda_cases(quick, device)
    if quick:
        return [make_case("strided", {"stride": 32, "causal": True}, 1, 8, 1024, 64, torch.float32, "fwd", device)]
    out = [
        make_case("strided", {"stride": 64, "causal": True}, 1, 8, 4096, 64, torch.float32, "fwd", device),
        make_case("fixed", {"stride": 64, "summary": 8, "causal": True}, 1, 8, 4096, 64, torch.float32, "fwd",
                  device),
        make_case("star", {"relay": 0, "radius": 1}, 1, 8, 4096, 64, torch.float32, "fwd", device),
        make_case("strided", {"stride": 64, "causal": True}, 1, 8, 4096, 64, torch.float32, "fwd+bwd", device),
        # training with the star pattern: its own backward kernel since session 8 (the composed
        # path's was 36.7 ms here)
        make_case("star", {"relay": 0, "radius": 1}, 1, 8, 4096, 64, torch.float32, "fwd+bwd", device),
        # bfloat16 (issue 25: "sparse keeps its lead in bfloat16"; on a CPU with AMX the tile
        # GEMMs take brgemm by default, and a "native tiles" row runs beside it)
        make_case("strided", {"stride": 64, "causal": True}, 1, 8, 4096, 64, torch.bfloat16, "fwd", device),
        make_case("strided", {"stride": 64, "causal": True}, 1, 8, 4096, 64, torch.bfloat16, "fwd+bwd", device),
    ]
    return out


FLEX_TARGET = {"FlexAttention (BlockMask)": 3.0}  # issue 10: >= 3x FlexAttention on the GPU
EXTRA = 20  # Case.priority of the GPU cases no issue names as a target: after all the targets


def cuda_cases(quick: bool, device: torch.device) -> list[Case]:
    """The GPU sweep (bfloat16, B=1, H=8, N=16384, D=128), the target case first."""
    bf16, n = torch.bfloat16, 16384
    strided = {"stride": 128, "causal": True}
    out = [make_case("strided", strided, 1, 8, n, 128, bf16, "fwd", device, targets=FLEX_TARGET,
                     dense_attnkit=not quick, priority=3)]
    if quick:
        return out
    out.append(make_case("strided", strided, 1, 8, n, 128, bf16, "fwd+bwd", device, priority=EXTRA))
    return out


# ----------------------------------------------------------------------------------------------
# The README's table of pattern densities and connectivity: python -m attnkit.bench.sparse --table
# ----------------------------------------------------------------------------------------------

def _local_global_layout(nb: int) -> torch.Tensor:
    """Block layout: the diagonal and its two neighbours, plus a global first row and column."""
    eye = torch.eye(nb, dtype=torch.bool)
    lay = eye | eye.roll(1, 1) | eye.roll(-1, 1)
    lay[:, 0] = True
    lay[0, :] = True
    return lay[None]


def pattern_table(ns=(256, 1024, 4096)) -> str:
    """Markdown: density and connectivity().layers_to_full of a few patterns at each n."""
    from attnkit import patterns

    rows = [
        ("strided(8)", lambda n: patterns.strided(8)),
        ("strided(64)", lambda n: patterns.strided(64)),
        ("strided(√n)", lambda n: patterns.strided(int(n ** 0.5))),
        ("strided(64, causal=False)", lambda n: patterns.strided(64, causal=False)),
        ("fixed(64, summary=8)", lambda n: patterns.fixed(64, 8)),
        ("fixed(64, summary=1, causal=False)", lambda n: patterns.fixed(64, 1, causal=False)),
        ("star(0, radius=1)", lambda n: patterns.star(0, 1)),
        ("star(n//2, radius=2, cyclic=True)", lambda n: patterns.star(n // 2, 2, cyclic=True)),
        ("star(0, radius=1, causal=True)", lambda n: patterns.star(0, 1, causal=True)),
        ("block_layout(local+global, 64)", lambda n: patterns.block_layout(_local_global_layout(n // 64), 64)),
    ]
    lines = ["| pattern | " + " | ".join(f"density n={n}" for n in ns) + " | "
             + " | ".join(f"layers_to_full n={n}" for n in ns) + " |",
             "|---|" + "---|" * (2 * len(ns))]
    for name, make in rows:
        dens = [f"{make(n).density(n):.4f}" for n in ns]
        full = [str(patterns.connectivity(make(n), n).layers_to_full) for n in ns]
        lines.append(f"| `{name}` | " + " | ".join(dens) + " | " + " | ".join(full) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if "--table" in sys.argv:
        print(pattern_table())
    else:
        print("usage: python -m attnkit.bench.sparse --table   (benchmarks: python -m attnkit bench --family sparse)")
