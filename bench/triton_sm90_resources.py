"""Registers, spills and shared memory of a Triton kernel compiled for an H100 / H200 (sm_90) on a
machine without a GPU: Triton 3.9 compiles ahead of time for a named target, and its bundled
ptxas reports what the cubin uses.  The launch's specializations are rebuilt by hand -- unit
head-dim strides as constants (Triton specializes an int argument equal to 1) and 16-divisible
pointers and strides (its ``tt.divisibility`` hint) -- since without them the address arithmetic
alone spilled kilobytes that the real launch never sees (decode, 64-row tiles: 4.9 KB against
none).

    python bench/triton_sm90_resources.py decode

    python bench/triton_sm90_resources.py softmax-fwd     (also softmax-dkdv, softmax-dq)

    python bench/triton_sm90_resources.py linear-output   (also linear-state_fwd, -state_bwd,
                                                           -dq, -dk, -dv)

prints, for kernels/decode.py's split kernel, every option variant (dense / paged, window,
softcap, ALiBi) under the configs that lead on an H200 (bench/RESULTS.md, session 10) -- and for
``softmax-*``, kernels/softmax.py's forward or backward kernels, causal, plain / window /
window + softcap + ALiBi, under every config of the kernel's autotune list -- and for ``linear-*``
a kernel of kernels/linear.py, causal and not, under its autotune list: a check that each
variant compiles, and whether an option costs spills, before a GPU run times it.  ``--ptx``
adds a hash of each build's PTX (a change that should compile to the same code, checked).
Not a timing: registers and spills only.  Needs ``TRITON_INTERPRET`` unset.
"""
from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def _ptxas() -> str:
    # Triton 3.9's PTX is version 9.4; of the ptxas builds it ships only ptxas-blackwell reads it.
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.join(folder, "ptxas-blackwell")


def compile_sm90(fn, types: dict, consts: dict, divisible: list, num_warps: int, num_stages: int) -> dict:
    """Compile ``fn`` (a @triton.jit function) for sm_90: ``types`` the non-constexpr arguments'
    Triton types (e.g. ``"*bf16"``, ``"i32"``, ``"fp32"``), ``consts`` the constexprs,
    ``divisible`` the arguments marked 16-divisible.  Returns registers, spill stores / loads
    (bytes) and shared memory (bytes); raises what Triton raises if it does not compile."""
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    source = ASTSource(fn, signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                       attrs={(names.index(n),): [["tt.divisibility", 16]] for n in divisible})
    kernel = triton.compile(source, target=TARGET, options=dict(num_warps=num_warps, num_stages=num_stages))
    ptx = kernel.asm["ptx"]
    ptx_hash = hashlib.sha1(ptx.encode()).hexdigest()[:12]
    arch = "sm_90a" if "sm_90a" in ptx else "sm_90"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([_ptxas(), f"-arch={arch}", "-v", f.name, "-o", os.devnull],
                                capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    if not (regs and spill):
        raise RuntimeError(f"ptxas -v said nothing usable: {report[-400:]}")
    return dict(regs=int(regs.group(1)), spill_stores=int(spill.group(1)), spill_loads=int(spill.group(2)),
                smem=int(kernel.metadata.shared), ptx=ptx_hash)


def decode_table(head_dim: int = 128) -> list[tuple]:
    """kernels/decode.py's split kernel, bfloat16, D = Dv = head_dim, several splits (partials,
    separate merge), per-sequence lengths, causal: (variant, config, resources or the error)."""
    from attnkit.kernels import decode

    fn = decode._decode_split_kernel
    pointers = dict(Q="*bf16", K="*bf16", V="*bf16", KvLens="*i32", Out="*bf16", Lse="*fp32", PartO="*fp32",
                    PartL="*fp32", Counters="*i32", Table="*i32", Alibi="*fp32", Sinks="*fp32")
    types = {n: pointers.get(n, "fp32" if n in ("qk_scale", "cap_in", "cap_out") else "i32") for n in fn.arg_names}
    unit = dict(stride_qd=1, stride_kd=1, stride_vd=1, stride_od=1)
    divisible = [n for n in fn.arg_names if n in pointers or (n.startswith("stride_") and n not in unit
                                                              and n not in ("stride_lens", "stride_ab", "stride_ah"))]
    variants = [dict(PAGED=p, HAS_WINDOW=w, HAS_SOFTCAP=c, HAS_ALIBI=a)
                for p, w, c, a in ((0, 0, 0, 0), (0, 1, 0, 0), (0, 1, 1, 1), (1, 0, 0, 0), (1, 1, 1, 1))]
    # (BLOCK_M, BLOCK_N, warps, stages): GQA N = 1..4's best, MQA N = 1's, MQA N = 4's (session 10)
    configs = ((16, 64, 2, 2), (64, 64, 4, 3), (128, 64, 8, 3))
    rows = []
    for variant, (bm, bn, warps, stages) in itertools.product(variants, configs):
        consts = dict(unit, HEAD_D=head_dim, HEAD_DV=head_dim, BLOCK_D=head_dim, BLOCK_DV=head_dim, HAS_LENS=True,
                      DIRECT=False, IS_CAUSAL=True, FUSED_MERGE=False, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=bn,
                      **{k: bool(v) for k, v in variant.items()})
        if "HAS_SINKS" in fn.arg_names:  # off: the sinks add one step at the rows' finish
            consts["HAS_SINKS"] = False
        try:
            result = compile_sm90(fn, types, consts, divisible, warps, stages)
        except Exception as exc:  # a variant that does not compile is the finding
            result = f"does not compile: {str(exc).splitlines()[0][:200]}"
        rows.append((variant, (bm, bn, warps, stages), result))
    return rows


_SOFTMAX_KERNELS = {"softmax-fwd": ("_attn_fwd_kernel", "FWD_CONFIGS"),
                    "softmax-dkdv": ("_attn_bwd_dkdv_kernel", "BWD_DKDV_CONFIGS"),
                    "softmax-dq": ("_attn_bwd_dq_kernel", "BWD_DQ_CONFIGS")}


def softmax_table(which: str, head_dim: int = 128, varlen: bool = False) -> list[tuple]:
    """A kernel of kernels/softmax.py (``which``: softmax-fwd / -dkdv / -dq), bfloat16, D = Dv =
    head_dim, no mask / dropout, causal, every config of its autotune list: the plain kernel, a
    window (its band's edge loops), and a window with softcap and ALiBi.  ``varlen``: the
    packed-sequence build (VARLEN, softmax_attention_varlen's one launch)."""
    from attnkit.kernels import softmax

    kernel_name, configs_name = _SOFTMAX_KERNELS[which]
    fn = getattr(softmax, kernel_name)
    floats = ("sm_scale", "dropout_p", "cap_in", "cap_out")
    fp32_pointers = ("Alibi", "Sinks", "Lse", "Delta")
    tensors = ("Q", "K", "V", "Mask", "Alibi", "Sinks", "Out", "Lse", "dO", "Delta", "dK", "dV", "dQ", "CuQ", "CuK")
    pointers = {n: "*fp32" if n in fp32_pointers else "*i32" if n.startswith("Cu") else "*bf16"
                for n in fn.arg_names if n in tensors}
    types = {n: pointers.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    unit = {n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d") and n != "stride_md"}
    divisible = [n for n in fn.arg_names if n in pointers or (n.startswith("stride_") and n not in unit
                                                              and not n.startswith(("stride_m", "stride_a")))]
    variants = [dict(HAS_WINDOW=w, HAS_SOFTCAP=c, HAS_ALIBI=a) for w, c, a in ((0, 0, 0), (1, 0, 0), (1, 1, 1))]
    configs = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
               for c in getattr(softmax, configs_name)]
    rows = []
    for variant, (bm, bn, warps, stages) in itertools.product(variants, configs):
        consts = dict(unit, HEAD_D=head_dim, HEAD_DV=head_dim, BLOCK_D=head_dim, BLOCK_DV=head_dim, IS_CAUSAL=True,
                      MASK_KIND=0, HAS_DROPOUT=False, DOT_PREC="tf32", BLOCK_M=bm, BLOCK_N=bn,
                      **{k: bool(v) for k, v in variant.items()})
        if "HAS_SINKS" in fn.arg_names:  # off: the sinks add one step at the rows' finish
            consts["HAS_SINKS"] = False
        if "VARLEN" in fn.arg_names:
            consts["VARLEN"] = varlen
        try:
            result = compile_sm90(fn, types, consts, divisible, warps, stages)
        except Exception as exc:
            result = f"does not compile: {str(exc).splitlines()[0][:200]}"
        rows.append((dict(PAGED=0, **variant), (bm, bn, warps, stages), result))
    return rows


def linear_table(which: str, head_dim: int = 128, varlen: bool = False) -> list[tuple]:
    """A kernel of kernels/linear.py (``which``: linear-state_fwd / -output / -state_bwd / -dq /
    -dk / -dv), bfloat16, D = Dv = head_dim, elu, normalized, causal and not, every config of its
    autotune list.  ``varlen``: the packed-sequence build (VARLEN, linear_attention_varlen's one
    launch)."""
    from attnkit.kernels import linear

    fn, kind = linear._KERNELS[which.split("-", 1)[1]]
    tensors = ("Q", "K", "V", "G", "S0", "Z0", "Hs", "Zs", "S_out", "Z_out", "Out", "Den", "Delta", "GDen", "GS",
               "GZ", "dHs", "dZs", "dS_out", "dZ_out", "dQ", "dK", "dV", "Cu", "ChunkOff")
    bf16 = ("Q", "K", "V", "G", "Out", "dQ", "dK", "dV")
    pointers = {n: "*bf16" if n in bf16 else "*i32" if n in ("Cu", "ChunkOff") else "*fp32"
                for n in fn.arg_names if n in tensors}
    types = {n: pointers.get(n, "fp32" if n in ("eps", "scale") else "i32") for n in fn.arg_names}
    unit = {n: 1 for n in fn.arg_names if n.startswith("stride_") and n.endswith("d")}
    divisible = [n for n in fn.arg_names if n in pointers or (n.startswith("stride_") and n not in unit)]
    rows = []
    for causal, c in itertools.product((True, False), linear.configs_for(kind, head_dim, head_dim)):
        consts = dict(unit, HEAD_D=head_dim, HEAD_DV=head_dim, FEATURE=0, CAUSAL=causal, NORMALIZE=True,
                      HAS_GDEN=False, HAS_GS=False, HAS_GZ=False, HAS_INIT=False, STORE_CHUNKS=causal, LOWP=2,
                      CHUNK=linear.DEFAULT_CHUNK, BLOCK_K=c.kwargs["BLOCK_K"], BLOCK_V=c.kwargs["BLOCK_V"],
                      VARLEN=varlen)
        consts = {k: v for k, v in consts.items() if k in fn.arg_names}
        key = (c.kwargs["BLOCK_K"], c.kwargs["BLOCK_V"], c.num_warps, c.num_stages)
        try:
            result = compile_sm90(fn, types, consts, divisible, c.num_warps, c.num_stages)
        except Exception as exc:
            result = f"does not compile: {str(exc).splitlines()[0][:200]}"
        rows.append((dict(PAGED=0, HAS_WINDOW=0, HAS_SOFTCAP=0, HAS_ALIBI=0, CAUSAL=causal), key, result))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    linear_kernels = [f"linear-{name}" for name in ("state_fwd", "output", "state_bwd", "dq", "dk", "dv")]
    parser.add_argument("kernel", choices=["decode", *_SOFTMAX_KERNELS, *linear_kernels])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--varlen", action="store_true", help="softmax-*, linear-*: the packed-sequence build")
    parser.add_argument("--ptx", action="store_true", help="add a hash of each build's PTX")
    args = parser.parse_args()
    if args.kernel.startswith("linear-"):
        print("| causal | BLOCK_K x BLOCK_V, warps, stages | registers | spill st / ld (bytes) | smem (KiB) |"
              + (" PTX |" if args.ptx else ""))
        print("| --- | --- | --- | --- | --- |" + (" --- |" if args.ptx else ""))
        for variant, (bk, bv, warps, stages), r in linear_table(args.kernel, args.head_dim, args.varlen):
            cells = (f"{r['regs']} | {r['spill_stores']} / {r['spill_loads']} | {r['smem'] / 1024:.0f}"
                     + (f" | {r['ptx']}" if args.ptx else "") if isinstance(r, dict) else f"{r} | |")
            print(f"| {'yes' if variant['CAUSAL'] else '-'} | {bk} x {bv}, {warps}, {stages} | {cells} |", flush=True)
        return
    print("| paged | window | softcap | alibi | BLOCK_M x BLOCK_N, warps, stages | registers "
          "| spill st / ld (bytes) | smem (KiB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = decode_table(args.head_dim) if args.kernel == "decode" else softmax_table(args.kernel, args.head_dim, args.varlen)
    for variant, (bm, bn, warps, stages), r in rows:
        flags = " | ".join("yes" if variant[k] else "-" for k in ("PAGED", "HAS_WINDOW", "HAS_SOFTCAP", "HAS_ALIBI"))
        cells = (f"{r['regs']} | {r['spill_stores']} / {r['spill_loads']} | {r['smem'] / 1024:.0f}"
                 + (f" | {r['ptx']}" if args.ptx else "") if isinstance(r, dict) else f"{r} | | ")
        print(f"| {flags} | {bm} x {bn}, {warps}, {stages} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
