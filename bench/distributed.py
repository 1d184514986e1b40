"""Context-parallel attention (attnkit.distributed): measurements and a scaling model.

Run: ``python -m attnkit.bench.distributed [--part cpu,bf16,model] [--n 16384] [--rounds 3]
[--markdown]``.  A standalone script (not wired into ``python -m attnkit bench``).

1. ``cpu`` -- gloo world of 2 against one process, at N = 16384 (B=1, H=4, D=64, float32),
   causal and not, forward and forward+backward.  Both use the same cores: the one process
   runs with every core's thread (2 here), each of the 2 ranks with half.  They run in the same
   two spawned processes, interleaved by rounds (rank 0 times the one-process call while rank 1
   waits at a barrier; then both time the ring, barrier to barrier), so the load of a shared
   machine hits them alike.  Reported: medians, the overhead ``t(ring) / t(one process) - 1``,
   each rank's time spent blocked in communication waits (``count_p2p``: the transfers that
   compute did not hide) and the bytes each rank sent.
2. ``bf16`` -- why the running output is float32: one process, keys split into W blocks (the
   partial results a W-rank ring merges), merged with attnkit's float32 running output against
   a running output kept in bfloat16; error against float64, for W = 1 .. 64.
3. ``model`` -- a model of ring attention on GPUs past the ones at hand: from a measured
   single-device attention throughput and a link bandwidth, the block size (tokens per rank)
   from which the K/V transfer hides behind the block kernel, and the efficiency at 8 to 1024
   ranks.  Every input is a command-line option; the defaults and their sources are listed in
   :data:`MODEL_DEFAULTS` and printed with the table.
4. With two or more CUDA devices (``--part gpu``): the measured NCCL scaling efficiency at
   1, 2, 4, 8 ranks, weak scaling at ``--tokens-per-gpu`` (not run yet: no multi-GPU machine).
"""
from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import attnkit
import torch
import torch.distributed as dist
from attnkit import distributed as cp

# ----------------------------------------------------------------------------------------------
# 1. CPU: gloo world of 2 against one process
# ----------------------------------------------------------------------------------------------


def _seeded(shape, seed, dtype, device):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype).to(device)


def _cases(b, h, n, d, dtype, device):
    q, k, v = (_seeded((b, h, n, d), s, dtype, device) for s in (1, 2, 3))
    go = _seeded((b, h, n, d), 4, dtype, device)
    return q, k, v, go


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _call(fn, q, k, v, go, backward):
    if backward:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = fn(q, k, v)
        out.backward(go)
    else:
        with torch.no_grad():
            fn(q, k, v)


def _compare_job(rank, world, b, h, n, d, rounds, threads_total, device_kind, single):
    """Per round and case: the one-process call on rank 0 (all threads; others wait), then
    the ring on every rank; returns {case: {"single": [s], "ring": [s], "wait": [s], ...}}."""
    device = torch.device("cuda", rank) if device_kind == "cuda" else torch.device("cpu")
    threads_rank = max(1, threads_total // world)
    dtype = torch.bfloat16 if device_kind == "cuda" else torch.float32
    q, k, v, go = _cases(b, h, n, d, dtype, device)
    results = {}
    cases = [(causal, backward) for causal in (False, True) for backward in (False, True)]
    for causal, backward in cases:
        idx = cp.shard_indices(n, rank, world, causal).to(device)
        lq, lk, lv, lgo = (t.index_select(2, idx) for t in (q, k, v, go))

        def ring(q_, k_, v_, causal=causal):
            return cp.ring_attention(q_, k_, v_, causal=causal, seq_len=n)

        def whole(q_, k_, v_, causal=causal):
            return attnkit.softmax_attention(q_, k_, v_, is_causal=causal)

        rec = {"single": [], "ring": [], "wait": [], "sent_bytes": 0}
        for r in range(rounds + 1):  # round 0 warms up
            if single and rank == 0:
                torch.set_num_threads(threads_total)
                _sync(device)
                t0 = time.perf_counter()
                _call(whole, q, k, v, go, backward)
                _sync(device)
                if r:
                    rec["single"].append(time.perf_counter() - t0)
            torch.set_num_threads(threads_rank)
            dist.barrier()
            with cp.count_p2p() as log:
                _sync(device)
                t0 = time.perf_counter()
                _call(ring, lq, lk, lv, lgo, backward)
                _sync(device)
                dist.barrier()
                elapsed = time.perf_counter() - t0
            if r:
                rec["ring"].append(elapsed)
                rec["wait"].append(log.wait_seconds())
                rec["sent_bytes"] = sum(e.nbytes for e in log.events if e.op == "send")
        results[("causal" if causal else "full") + (" fwd+bwd" if backward else " fwd")] = rec
    return results


def run_cpu(n, rounds, heads=4, head_dim=64, world=2):
    threads = torch.get_num_threads()
    print(f"\n## CPU: gloo world of {world} vs one process -- B=1 H={heads} N={n} D={head_dim} "
          f"float32, {threads} threads in all (one process: {threads}; each rank: "
          f"{max(1, threads // world)}); medians of {rounds} interleaved rounds\n")
    per_rank = cp.run_local_world(_compare_job, world,
                                  (1, heads, n, head_dim, rounds, threads, "cpu", True),
                                  timeout_s=3600, collective_timeout_s=600,
                                  threads_per_rank=max(1, threads // world))
    print("| case | one process ms | ring W=2 ms | overhead | rank waits ms (max) "
          "| sent per rank MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for case in per_rank[0]:
        single = statistics.median(per_rank[0][case]["single"])
        ring = statistics.median(per_rank[0][case]["ring"])
        wait = max(statistics.median(r[case]["wait"]) for r in per_rank)
        sent = max(r[case]["sent_bytes"] for r in per_rank) / 1e6
        rows.append((case, single, ring))
        print(f"| {case} | {single * 1e3:.0f} | {ring * 1e3:.0f} | {ring / single - 1:+.1%} | "
              f"{wait * 1e3:.1f} | {sent:.1f} |")
    return rows


# ----------------------------------------------------------------------------------------------
# 2. bfloat16: float32 running output against a bfloat16 one
# ----------------------------------------------------------------------------------------------


def run_bf16(n=4096, heads=4, head_dim=64, worlds=(1, 2, 4, 8, 16, 32, 64)):
    q, k, v = (_seeded((1, heads, n, head_dim), s, torch.bfloat16, "cpu") for s in (5, 6, 7))
    exact = attnkit.softmax_attention(q.double(), k.double(), v.double())
    scale = exact.abs().max()
    print(f"\n## bfloat16 merge error -- one process, keys in W blocks, N={n} H={heads} "
          f"D={head_dim}; max |error| / max |out| against float64\n")
    print("| W (blocks) | float32 running output (attnkit) | bfloat16 running output |")
    print("| --- | --- | --- |")
    rows = []
    for w in worlds:
        bounds = [round(i * n / w) for i in range(w + 1)]
        acc_out = acc_lse = None
        naive_out = naive_lse = None
        for a, b in itertools.pairwise(bounds):
            out_b, lse_b = attnkit.softmax_attention(q, k[:, :, a:b], v[:, :, a:b],
                                                     return_lse=True)
            if acc_out is None:
                acc_out, acc_lse = out_b.float(), lse_b.clone()
                naive_out, naive_lse = out_b.clone(), lse_b.clone()
                continue
            cp._merge_(acc_out, acc_lse, out_b, lse_b)
            merged, naive_lse2 = naive_out.float(), naive_lse.clone()
            cp._merge_(merged, naive_lse2, out_b, lse_b)
            naive_out, naive_lse = merged.to(torch.bfloat16), naive_lse2
        ours = ((acc_out.to(torch.bfloat16).double() - exact).abs().max() / scale).item()
        naive = ((naive_out.double() - exact).abs().max() / scale).item()
        rows.append((w, ours, naive))
        print(f"| {w} | {ours:.2e} | {naive:.2e} |")
    return rows


# ----------------------------------------------------------------------------------------------
# 3. the GPU model
# ----------------------------------------------------------------------------------------------

# Defaults of the model, each with where it comes from.  Measured ones are bench/RESULTS.md's
# 2026-11-26 GPU figures (attnkit's Triton kernels, bfloat16, B=4 H=8 N=8192 D=128); the link
# figures are assumptions (nominal bandwidths times an assumed 80% achieved by point-to-point
# transfers, and assumed per-exchange latencies), not measurements.
MODEL_DEFAULTS = {
    "flops_fwd": (503.0e12, "measured: H100 attnkit triton forward, 503.0 TFLOP/s"),
    "flops_fwdbwd": (411.0e12, ("measured: H100 attnkit triton forward+backward, 411.0 TFLOP/s "
                                "(3.5x the forward FLOPs)")),
    "causal_ratio": (435.9 / 496.0, ("measured: H200 causal / non-causal forward throughput "
                                     "(435.9 / 496.0), applied to the causal diagonal block")),
    "hbm": (2975e9, "measured: H100 copy bandwidth 2975 GB/s (read + write), for the merge"),
    "nvlink": (450e9 * 0.8, "assumed: NVLink 4 (H100 SXM) 450 GB/s per direction x 0.8"),
    "ib": (50e9 * 0.8, "assumed: one 400 Gb/s InfiniBand NIC per GPU, 50 GB/s x 0.8"),
    "lat_nvlink": (10e-6, "assumed: 10 us per exchange within a node"),
    "lat_ib": (25e-6, "assumed: 25 us per exchange across nodes"),
    "gpus_per_node": (8, ("assumed: 8 GPUs per node; a ring of more than 8 crosses nodes, and "
                          "every step waits for its slowest (InfiniBand) link")),
}


def _link(w, p):
    """(bandwidth B/s, latency s) of the slowest link in a ring of w GPUs."""
    return (p["nvlink"], p["lat_nvlink"]) if w <= p["gpus_per_node"] else (p["ib"], p["lat_ib"])


def _bwd_rate(p):
    """The backward's own throughput: fwd+bwd counts 3.5x the forward FLOPs (bench/softmax.py)."""
    return 2.5 / (3.5 / p["flops_fwdbwd"] - 1.0 / p["flops_fwd"])


def ring_time(c, w, cfg, causal, backward, p):
    """(modelled seconds, ideal seconds) of one rank's ring attention, c tokens per rank.

    Per step s = 0 .. W-1 (cfg = (B, H, Hk, D), D = Dv, bfloat16):
      pairs   = c^2 (full) or c^2 / 2 (zig-zag causal: every step, the diagonal one included)
      compute = 4 B H D pairs / F (the forward), 2.5x that at the backward's rate; the causal
                diagonal block (s = 0) at F x causal_ratio
      K/V     = B Hk c 2D x 2 bytes / link + latency (not after the last forward step);
                backward: + float32 dK/dV, B Hk c 2D x 4 bytes, + a second latency
      step    = max(compute, transfer)  (the transfer is posted before the kernel)
      merge   = B H rows (18 D + 24) bytes / HBM per forward step s >= 1 (rows = c, or 3c/4 on
                average for zig-zag causal), as implemented (unfused
                PyTorch ops: the block output cast to float32, then lerp into the float32
                running output; the LSE update); a fused merge would move ~10 D + 12.
                Backward: dQ and dK/dV accumulation, B D (H rows + 2 Hk c) x 10 bytes / HBM
                per step
    ideal = the same FLOPs at the non-causal rates, divided over W ranks, nothing else.
    """
    b, h, hk, d = cfg
    bw, lat = _link(w, p)
    pairs = c * c / 2 if causal else c * c
    work = 4.0 * b * h * d * pairs
    rate = [p["flops_fwd"] * (p["causal_ratio"] if causal and s == 0 else 1.0) for s in range(w)]
    kv = b * hk * c * 2 * d * 2 / bw + lat
    rows = 0.75 * c if causal else c  # zig-zag: c rows at half the steps, c / 2 at the others
    merge = b * h * rows * (18 * d + 24) / p["hbm"]
    t = sum(max(work / rate[s], kv if s < w - 1 else 0.0) for s in range(w)) + (w - 1) * merge
    ideal = w * work / p["flops_fwd"]
    if backward:
        f_bwd = _bwd_rate(p)
        kv_dkv = b * hk * c * 2 * d * (2 + 4) / bw + 2 * lat
        acc = b * d * (h * rows + 2 * hk * c) * 10 / p["hbm"]
        t += sum(max(2.5 * work / (f_bwd * rate[s] / p["flops_fwd"]), kv_dkv) + acc
                 for s in range(w))
        ideal += w * 2.5 * work / f_bwd
    return t, ideal


def hide_threshold(w, cfg, causal, backward, p):
    """Smallest tokens per rank c from which every step's transfer hides behind its kernel:
    the root of a c^2 = beta c + latency (forward; and the backward's, when asked), with
    a = 4 B H D (1/2 if causal) / F and beta = bytes per token / link bandwidth."""
    b, h, hk, d = cfg
    bw, lat = _link(w, p)
    half = 0.5 if causal else 1.0

    def root(a, beta, alpha):
        return math.ceil((beta + math.sqrt(beta * beta + 4 * a * alpha)) / (2 * a))

    c = root(half * 4 * b * h * d / p["flops_fwd"], b * hk * 2 * d * 2 / bw, lat)
    if backward:
        c = max(c, root(half * 4 * b * h * d * 2.5 / _bwd_rate(p), b * hk * 2 * d * 6 / bw,
                        2 * lat))
    return c


def run_model(p=None, n_total=1 << 20, tokens_per_gpu=8192):
    p = dict({k: v for k, (v, _) in MODEL_DEFAULTS.items()}, **(p or {}))
    configs = {"GQA H=32 Hk=8 D=128": (1, 32, 8, 128), "MHA H=32 Hk=32 D=128": (1, 32, 32, 128)}
    print("\n## Model: ring attention on H100s (bfloat16, B=1)\n")
    print("Assumptions:")
    for key, (_, why) in MODEL_DEFAULTS.items():
        print(f"- `{key}` = {p[key]:.4g}: {why}")
    print("- K/V transfers overlap the block kernel perfectly (max of the two per step), the "
          "merge of each step is extra (float32 running output, HBM-bound), kernel throughput "
          "does not depend on the block size (measured at 8192 tokens: rows below ~4096 "
          "tokens per rank are optimistic), no other layer's traffic shares the links.\n")
    print("Tokens per rank from which the K/V transfer hides behind the block kernel:\n")
    print("| config | link | full fwd | full fwd+bwd | causal (zig-zag) fwd | causal fwd+bwd |")
    print("| --- | --- | --- | --- | --- | --- |")
    thresholds = {}
    for name, cfg in configs.items():
        for link, w in (("NVLink (<= 8 GPUs)", 8), ("InfiniBand (> 8 GPUs)", 16)):
            cells = [hide_threshold(w, cfg, causal, bwd, p)
                     for causal in (False, True) for bwd in (False, True)]
            thresholds[(name, link)] = cells
            print(f"| {name} | {link} | " + " | ".join(f"{c:,}" for c in cells) + " |")
    tables = {}
    for title, per_rank in (
        (f"strong scaling, N = {n_total:,} tokens in all", lambda w: n_total // w),
        (f"weak scaling, {tokens_per_gpu:,} tokens per GPU", lambda w: tokens_per_gpu),
    ):
        print(f"\nEfficiency (ideal time / modelled time), {title}:\n")
        modes = ("causal fwd", "causal fwd+bwd")
        print("| ranks | tokens per rank | link | "
              + " | ".join(f"{name} {mode}" for name in configs for mode in modes) + " |")
        print("| --- | --- | --- | " + " | ".join("---" for _ in range(2 * len(configs))) + " |")
        rows = []
        for w in (8, 16, 32, 64, 128, 256, 512, 1024):
            c = per_rank(w)
            link = "NVLink" if w <= p["gpus_per_node"] else "IB"
            cells = []
            for cfg in configs.values():
                for bwd in (False, True):
                    t, ideal = ring_time(c, w, cfg, True, bwd, p)
                    cells.append(ideal / t)
            rows.append((w, c, cells))
            flag = " *" if c < 4096 else ""
            print(f"| {w} | {c:,}{flag} | {link} | " + " | ".join(f"{e:.0%}" for e in cells) + " |")
        tables[title] = rows
    print("\n(* below the block size the kernel throughput was measured at: optimistic)")
    return thresholds, tables


# ----------------------------------------------------------------------------------------------
# 4. GPUs at hand (NCCL), when there are several
# ----------------------------------------------------------------------------------------------


def run_gpu(tokens_per_gpu, rounds, heads=32, head_dim=128):
    ngpu = torch.cuda.device_count()
    if ngpu < 2:
        print(f"\n## GPUs: {ngpu} CUDA device(s) -- ring scaling needs at least 2; skipped")
        return None
    print(f"\n## GPUs: NCCL ring, weak scaling at {tokens_per_gpu} tokens per GPU, bfloat16, "
          f"H={heads} D={head_dim}; efficiency = W x t(1 GPU, c tokens) / t(W GPUs, W c tokens) "
          "(each GPU's work grows as W)\n")
    print("| ranks | case | ms | efficiency |")
    print("| --- | --- | --- | --- |")
    base = {}
    for w in (1, 2, 4, 8):
        if w > ngpu:
            break
        n = tokens_per_gpu * w
        res = cp.run_local_world(_compare_job, w, (1, heads, n, head_dim, rounds, 1, "cuda", False),
                                 backend="nccl", timeout_s=1200, collective_timeout_s=300)
        for case, rec in res[0].items():
            t = statistics.median(rec["ring"])
            # Work per GPU grows as W (N^2 / W): ideal time = W * t(1 GPU).
            base.setdefault(case, t)
            print(f"| {w} | {case} | {t * 1e3:.2f} | {w * base[case] / t:.0%} |")
    return base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default="cpu,bf16,model", help="cpu,bf16,model,gpu")
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-total", type=int, default=1 << 20)
    ap.add_argument("--tokens-per-gpu", type=int, default=8192)
    for key, (value, why) in MODEL_DEFAULTS.items():
        ap.add_argument(f"--{key.replace('_', '-')}", type=float, default=value, help=why)
    args = ap.parse_args(argv)
    parts = set(args.part.split(","))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, attnkit "
          f"{attnkit.__version__}")
    if "cpu" in parts:
        run_cpu(args.n, args.rounds, heads=args.heads)
    if "bf16" in parts:
        run_bf16()
    if "model" in parts:
        run_model({k: getattr(args, k) for k in MODEL_DEFAULTS}, args.n_total, args.tokens_per_gpu)
    if "gpu" in parts:
        run_gpu(args.tokens_per_gpu, args.rounds)


if __name__ == "__main__":
    main()
