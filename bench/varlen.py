"""Packed sequences and KV-cache decoding (issue 28): ``attnkit.softmax_attention_varlen`` and
``attnkit.attention_with_kvcache`` against what a user would write instead.  Full runs only
(nothing under ``--quick``); on a GPU in bfloat16 (the varlen cases causal only there).

**varlen** (:func:`make_varlen_case`): H=8, D=64, float32 (on a GPU bfloat16, causal), a pack of
sequences of seeded random lengths, self-attention (n_i = m_i), causal and not, forward and
forward+backward:

- ``mixed``: 16 sequences of 32..512 tokens (nearly all lengths distinct: one kernel call per
  sequence);
- ``short``: 256 sequences of 8..40 tokens (few distinct lengths, many repeats: one call per
  length).

Peers: torch SDPA over the whole pack with a dense block-diagonal bool mask ``[T, T]`` (the
one-call formulation: it computes every cross-sequence score and masks it), and one call per
sequence in a Python loop -- of ``attnkit.softmax_attention`` (so the ratio is the grouping's
own gain) and of torch SDPA -- each over ``torch.split`` views of the pack.  FLOPs count the
visible pairs within the sequences only (softmax.py's convention, summed over sequences), so
the dense-mask peer's FLOP/s is its useful rate.

On a GPU also the mixed pack's forward+backward with dropout 0.1 (a training step's call: the
one launch against the loops and the masked SDPA, each with its own masks; timed, not compared).

**linear varlen** (:func:`make_linear_varlen_case`, GPU only): ``attnkit.linear_attention_varlen``
over the same packs, bfloat16, causal, against one ``attnkit.linear_attention`` call per sequence.

**kvcache** (:func:`make_kvcache_case`): one decoding step, B=8, Hq=32, Hk=8 (GQA), D=128,
float32 (bfloat16 on a GPU), appending one key / value per batch element (at fixed positions: every timed call
writes the same rows), cache lengths either all ``max_len`` - 1 or distinct (seeded, in
[max_len / 2, max_len)), max_len = 4096, contiguous and paged (block size 256, shuffled block
table); and a sliding-window decode (``window=(512, -1)`` over max_len 4096; on a GPU 1024 of
16384), contiguous and paged, its cost to track the window.  Peers: torch SDPA on the whole
``[B, Hk, max_len, D]`` cache with a key-padding mask (and the window's band in it)
``[B, 1, 1, max_len]`` (the single call a padded batch makes; the new rows are written first as
attention_with_kvcache does), and ``attnkit.softmax_attention`` on the whole cache with the same
padding mask.  Plus one chunked-prefill step: 128 new queries / keys after 2048 cached ones, all
batch elements equal (causal bottom-right), against SDPA with the bottom-right mask ``[128,
2176]``.  GB/s counts the visible K and V bytes (each read once).

Measured 2026 (AMD EPYC, AVX2, 2 cores, torch 2.13 CPU wheel), on a machine shared with other
builds and benchmarks (load average 2-7 on its 2 cores): ratios, not times.  With 2 threads
there, a tiny softmax_attention call took 16 ms instead of 0.13-0.16 ms whenever the load was
high (its parallel region waiting for a descheduled thread), so the sweep was run with
``OMP_NUM_THREADS=1 python -m attnkit bench --family varlen --repeats 5`` and the close calls
re-timed interleaved in one process.  attnkit[cpu] against the peers:

- varlen vs SDPA block-diagonal mask: 9.3x (mixed, fwd) to 54x (short causal, fwd); fwd+bwd
  9.4x-49x.
- varlen vs the attnkit per-sequence loop (interleaved, medians of 7): mixed 1.0x (the same
  calls: every length distinct), fwd+bwd 1.04-1.16x; short (33 calls instead of 256) fwd
  1.13-1.35x, fwd+bwd 1.03-1.3x.  The SDPA per-sequence loop is about as fast as varlen on the
  short pack (0.9-1.07x): attnkit's kernel is slower than SDPA's at n <= 40.
- kvcache decode vs SDPA + key-padding mask: 1.53x (equal lengths), 1.68x (distinct), 1.31x
  (paged, including the gather of the blocks); vs attnkit softmax_attention on the whole cache
  with the padding mask: 1.22x, 1.16x, 0.81x (paged: the gather copies the visible cache once).
- kvcache prefill chunk (Nq = 128 after 2048): 0.81x SDPA with the bottom-right mask, 0.97x
  attnkit with that mask (the kernel at N = 128, M = 2048 is what costs).

Session 27 (Intel Xeon without AMX, 2 threads, `python -m attnkit bench --match kvcache`): the
paged decode step, once the decoding kernel read the blocks in place (no gather), 30.34 ->
11.77 ms, 0.92x -> 2.42x SDPA + key-padding mask, 58 -> 0.05 MiB scratch (contiguous: 11.43 ms).
"""
from __future__ import annotations

import itertools
import random

import torch
import torch.nn.functional as F

from .harness import Case, Impl, attnkit_impls, seeded_randn
from .softmax import visible_pairs

FAMILY = "varlen"
H, D = 8, 64
REFERENCE_SKIP = "the reference is for checking, not speed"


def _lengths(kind: str) -> list[int]:
    rng = random.Random(28)
    if kind == "mixed":
        return [rng.randint(32, 512) for _ in range(16)]
    return [rng.randint(8, 40) for _ in range(256)]


def _varlen_inputs(lengths, dtype, seed):
    def make(device):
        total = sum(lengths)
        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
        return {
            "q": seeded_randn((total, H, D), dtype, device, seed),
            "k": seeded_randn((total, H, D), dtype, device, seed + 1),
            "v": seeded_randn((total, H, D), dtype, device, seed + 2),
            "cu": cu,
            # [T, T] block-diagonal (and causal) mask for the dense peer, built outside the timing.
            "mask": None,
        }
    return make


def _block_diagonal(cu: torch.Tensor, causal: bool) -> torch.Tensor:
    lengths = (cu[1:] - cu[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths)
    mask = seq[:, None] == seq[None, :]
    if causal:
        mask &= torch.ones_like(mask).tril()
    return mask


def make_varlen_case(kind: str, causal: bool, mode: str, device: torch.device, dtype=torch.float32,
                     seed: int = 0, dropout_p: float = 0.0) -> Case:
    """``dropout_p``: every implementation drops with it (its own random masks: the outputs are
    not compared, only timed)."""
    lengths = _lengths(kind)
    longest = max(lengths)
    base = _varlen_inputs(lengths, dtype, seed)

    def make(device):
        x = base(device)
        x["mask"] = _block_diagonal(x["cu"], causal)
        return x

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.softmax_attention_varlen(x["q"], x["k"], x["v"], x["cu"], x["cu"], longest, longest,
                                                    dropout_p=dropout_p, is_causal=causal, backend=backend)
        return fn

    def loop(attend):
        def fn(x):
            sizes = (x["cu"][1:] - x["cu"][:-1]).tolist()
            parts = [t.split(sizes) for t in (x["q"], x["k"], x["v"])]
            outs = [attend(*(p.transpose(0, 1).unsqueeze(0) for p in seq))[0].transpose(0, 1)
                    for seq in zip(*parts)]
            return torch.cat(outs)
        return fn

    def dense(x):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (x["q"], x["k"], x["v"]))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=x["mask"], dropout_p=dropout_p)[0].transpose(0, 1)

    def attnkit_one(q, k, v):
        import attnkit

        return attnkit.softmax_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)

    impls = attnkit_impls("softmax", device, call, dtype=dtype, reference_skip_reason=REFERENCE_SKIP)
    impls += [
        Impl("torch SDPA block-diagonal mask", "peer", fn=dense),
        Impl("attnkit softmax_attention per-sequence loop", "peer", fn=loop(attnkit_one)),
        Impl("torch SDPA per-sequence loop", "peer",
             fn=loop(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal))),
    ]
    if dropout_p > 0.0:
        # (the cpu and cuda kernels have no dropout: the routing would send them to the reference)
        impls = [impl for impl in impls if impl.backend not in ("cpu", "cuda")]
        for impl in impls:
            impl.same_result = False
    pairs = sum(visible_pairs(n, n, causal) for n in lengths)
    flops = 4.0 * H * D * pairs * (3.5 if mode == "fwd+bwd" else 1.0)
    name = f"varlen-{kind}-{'causal' if causal else 'full'}-T{sum(lengths)}-seqs{len(lengths)}"
    if dtype != torch.float32:
        name += f"-{str(dtype).replace('torch.', '')}"
    if dropout_p > 0.0:
        name += f"-dropout{dropout_p:g}"
    params = {"H": H, "D": D, "T": sum(lengths), "sequences": len(lengths), "distinct_lengths": len(set(lengths)),
              "max_len": longest, "dtype": str(dtype).replace("torch.", ""), "causal": causal, "dropout_p": dropout_p}
    return Case(FAMILY, name, mode, params, flops, make, impls,
                grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else (),
                priority=0 if device.type == "cpu" else GPU_PRIORITY)


def make_linear_varlen_case(kind: str, mode: str, device: torch.device, dtype=torch.bfloat16, seed: int = 0) -> Case:
    """``attnkit.linear_attention_varlen`` (causal, elu, normalized) over the pack of
    :func:`make_varlen_case`: on the triton backend one launch per kernel (session 31), against
    one ``attnkit.linear_attention`` call per sequence (what the grouped path did for distinct
    lengths).  FLOPs: the chunked form's 4 H D Dv per token (state and output products;
    ~2.5x with the backward)."""
    lengths = _lengths(kind)
    base = _varlen_inputs(lengths, dtype, seed)

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.linear_attention_varlen(x["q"], x["k"], x["v"], x["cu"], causal=True, backend=backend)
        return fn

    def loop(x):
        import attnkit

        sizes = (x["cu"][1:] - x["cu"][:-1]).tolist()
        parts = [t.split(sizes) for t in (x["q"], x["k"], x["v"])]
        return torch.cat([attnkit.linear_attention(*(p.transpose(0, 1).unsqueeze(0) for p in seq),
                                                   causal=True)[0].transpose(0, 1) for seq in zip(*parts)])

    impls = attnkit_impls("linear", device, call, dtype=dtype, reference_skip_reason=REFERENCE_SKIP)
    impls.append(Impl("attnkit linear_attention per-sequence loop", "peer", fn=loop))
    flops = 4.0 * H * D * D * sum(lengths) * (2.5 if mode == "fwd+bwd" else 1.0)
    name = f"linear-varlen-{kind}-causal-T{sum(lengths)}-seqs{len(lengths)}-{str(dtype).replace('torch.', '')}"
    params = {"H": H, "D": D, "T": sum(lengths), "sequences": len(lengths), "distinct_lengths": len(set(lengths)),
              "max_len": max(lengths), "dtype": str(dtype).replace("torch.", ""), "causal": True,
              "feature_map": "elu"}
    return Case(FAMILY, name, mode, params, flops, base, impls,
                grad_inputs=("q", "k", "v") if mode == "fwd+bwd" else (), priority=GPU_PRIORITY)


# ---- KV cache --------------------------------------------------------------------------------

KV_B, KV_HQ, KV_HK, KV_D, KV_MAX = 8, 32, 8, 128, 4096
GPU_PRIORITY = 20  # bench/options.py's EXTRA (not imported: the families' modules stay apart)
BLOCK = 256


def _cache_lengths(equal: bool, max_len: int) -> list[int]:
    if equal:
        return [max_len - 1] * KV_B
    rng = random.Random(29)
    return [rng.randrange(max_len // 2, max_len) for _ in range(KV_B)]


def _kv_inputs(lengths, nq, paged, max_len, dtype, seed, window=None):
    def make(device):
        b = len(lengths)
        x = {
            "q": seeded_randn((b, KV_HQ, nq, KV_D), dtype, device, seed),
            "k": seeded_randn((b, KV_HK, nq, KV_D), dtype, device, seed + 1),
            "v": seeded_randn((b, KV_HK, nq, KV_D), dtype, device, seed + 2),
            "k_cache": seeded_randn((b, KV_HK, max_len, KV_D), dtype, device, seed + 3),
            "v_cache": seeded_randn((b, KV_HK, max_len, KV_D), dtype, device, seed + 4),
            "seqlens": torch.tensor(lengths, dtype=torch.int32, device=device),
        }
        # The key-padding mask of the single-call peers: batch element b sees its first L_b keys
        # (bottom-right causal for several queries; with a window only the last `window` + 1
        # keys up to each query's position).
        visible = torch.tensor(lengths, device=device)[:, None] + nq
        pos = torch.arange(max_len, device=device)
        row = torch.arange(nq, device=device)
        last = visible[:, :, None] - nq + row[None, :, None]  # [B, Nq, 1]: each query's position
        mask = pos[None, None, :] <= last
        if window is not None:
            mask &= pos[None, None, :] >= last - window
        x["mask"] = mask.unsqueeze(1)
        if paged:
            blocks = max_len // BLOCK
            perm = torch.randperm(b * blocks, generator=torch.Generator().manual_seed(seed))
            table = perm.view(b, blocks).to(torch.int32).to(device)
            for name in ("k_cache", "v_cache"):
                pages = torch.empty(b * blocks, KV_HK, BLOCK, KV_D, dtype=dtype, device=device)
                pages[table.long().flatten()] = x[name].unflatten(2, (blocks, BLOCK)).transpose(1, 2).flatten(0, 1)
                x[name + "_pages"] = pages
            x["table"] = table
        return x
    return make


def make_kvcache_case(nq: int, equal: bool, paged: bool, device: torch.device, max_len: int = KV_MAX,
                      dtype=torch.float32, seed: int = 0, window: int | None = None) -> Case:
    # Decoding: one new row after L_b - 1 cached ones; prefill: nq new rows filling the cache.
    # window: a sliding window of that many keys left of each query (Mistral-style; attnkit takes
    # window=(window, -1), the peers the equivalent dense mask).
    lengths = [max_len - nq] * KV_B if nq > 1 else _cache_lengths(equal, max_len)
    suffix = "_pages" if paged else ""
    options = {} if window is None else {"window": (window, -1)}

    def call(backend):
        def fn(x):
            import attnkit

            return attnkit.attention_with_kvcache(
                x["q"], x["k_cache" + suffix], x["v_cache" + suffix], x["k"], x["v"], cache_seqlens=x["seqlens"],
                block_table=x.get("table"), enable_gqa=True, backend=backend, **options)
        return fn

    def write(x):
        for b, n in enumerate(lengths):
            x["k_cache"][b, :, n:n + nq] = x["k"][b]
            x["v_cache"][b, :, n:n + nq] = x["v"][b]

    def sdpa(x):
        write(x)
        return F.scaled_dot_product_attention(x["q"], x["k_cache"], x["v_cache"], attn_mask=x["mask"],
                                              enable_gqa=True)

    def padded(x):
        import attnkit

        write(x)
        return attnkit.softmax_attention(x["q"], x["k_cache"], x["v_cache"], attn_mask=x["mask"], enable_gqa=True)

    impls = attnkit_impls("softmax", device, call, dtype=dtype, reference_skip_reason=REFERENCE_SKIP)
    impls += [Impl("torch SDPA + key-padding mask", "peer", fn=sdpa),
              Impl("attnkit softmax_attention + key-padding mask", "peer", fn=padded)]
    visible = [n + nq for n in lengths]
    if window is None:
        pairs = sum(visible_pairs(nq, m, False) - (nq * (nq - 1)) // 2 for m in visible)
        read = sum(visible)
    else:  # query i (position L - nq + i) sees min(position, window) + 1 keys
        pairs = sum(min(m - nq + i, window) + 1 for m in visible for i in range(nq))
        read = sum(min(m, window + nq) for m in visible)
    esize = torch.empty((), dtype=dtype).element_size()
    what = "prefill" if nq > 1 else "decode"
    name = (f"kvcache-{what}-Nq{nq}-{'equal' if equal else 'distinct'}-{'paged' if paged else 'contiguous'}"
            f"{'' if window is None else f'-window{window}'}-max{max_len}-Hq{KV_HQ}-Hk{KV_HK}-D{KV_D}"
            f"{'' if dtype == torch.float32 else '-' + str(dtype).replace('torch.', '')}")
    params = {"B": KV_B, "H": KV_HQ, "Hk": KV_HK, "N": nq, "max_len": max_len, "D": KV_D,
              "dtype": str(dtype).replace("torch.", ""), "lengths": "equal" if equal else "distinct", "paged": paged,
              "causal": nq > 1, "window": window}
    # On a GPU the sweep runs the target cases first (bench/options.py's EXTRA: no target here).
    return Case(FAMILY, name, "fwd", params, 4.0 * KV_HQ * KV_D * pairs,
                _kv_inputs(lengths, nq, paged, max_len, dtype, seed, window), impls,
                bytes=2.0 * KV_HK * KV_D * esize * read, priority=0 if device.type == "cpu" else GPU_PRIORITY)


def cases(quick: bool, device: torch.device) -> list[Case]:
    if quick:
        return []
    out = []
    if device.type == "cpu":
        for kind in ("mixed", "short"):
            for causal in (False, True):
                for mode in ("fwd", "fwd+bwd"):
                    out.append(make_varlen_case(kind, causal, mode, device))
    else:
        # On a GPU, bfloat16: the triton backend runs the pack in one launch per kernel (session
        # 30), against the per-sequence loops (a launch per sequence) and the dense-mask SDPA.
        for kind in ("mixed", "short"):
            for mode in ("fwd", "fwd+bwd"):
                out.append(make_varlen_case(kind, True, mode, device, dtype=torch.bfloat16))
        # Dropout in the one launch (session 31; the grouped path before): a training step's call.
        out.append(make_varlen_case("mixed", True, "fwd+bwd", device, dtype=torch.bfloat16, dropout_p=0.1))
        # Linear attention's pack in one launch per kernel too (session 31).
        for kind in ("mixed", "short"):
            for mode in ("fwd", "fwd+bwd"):
                out.append(make_linear_varlen_case(kind, mode, device))
    # The decoding cases on a GPU too (the triton backend's split-KV kernel, a paged cache read in
    # place, a window's keys only), in bfloat16 there, the dtype served.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for equal, paged in ((True, False), (False, False), (False, True)):
        out.append(make_kvcache_case(1, equal, paged, device, dtype=dtype))
    # Sliding-window decoding (issue 28: the cost tracks the window): 512 keys of a 4096-key cache
    # (a GPU: 1024 of 16384), contiguous and paged.
    window_len, window = (KV_MAX, 512) if device.type == "cpu" else (4 * KV_MAX, 1024)
    for paged in (False, True):
        out.append(make_kvcache_case(1, False, paged, device, max_len=window_len, dtype=dtype, window=window))
    if device.type == "cpu":
        out.append(make_kvcache_case(128, True, False, device, max_len=2048 + 128))
    return out
