"""The input checks of the native ops (csrc/checks/, issue 10), both backends, without a GPU.

Every op has one check function (csrc/checks/<family>.cpp) that its CPU kernel calls first and
that its CUDA registration runs before calling the .cu code.  attnkit._C._checks binds them with a
``Target``: ``Target("cpu")``, or ``Target("cuda", device="meta", cc=..., smem_optin=...)``, which
runs the CUDA branch on meta tensors for a made-up device (default: compute capability 9.0,
227 KiB of shared memory per block, an H100).  So CI covers every message of both branches:

- CPU: each bad input through the real op (torch.ops.attnkit.<op>, CPU tensors) and through
  ``_checks`` -- the same message either way (``cpu_raises``); device mismatches, which the
  dispatcher never routes to the CPU kernel, through ``_checks`` with meta tensors;
- CUDA: through ``_checks`` with meta tensors (``cuda_raises``); the tests marked gpu call the
  real CUDA ops with bad inputs (they raised by killing the process before: issue 10).

Matches are regular expressions on the messages, which say what was expected and what came.
The checks raise through ATTNKIT_CHECK (csrc/message.h: messages built without iostreams).
"""
import itertools
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import attnkit  # noqa: F401  (loads attnkit._C, which registers the ops)
from attnkit import _C

checks = _C._checks
ROOT = pathlib.Path(__file__).resolve().parents[2]
F16, BF16, F32, F64, I32, I64 = torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64
CPU = checks.Target("cpu")
CUDA = checks.Target("cuda", device="meta")  # compute capability 9.0, 227 KiB: an H100
OPS = ("softmax_fwd", "softmax_bwd", "linear_fwd", "linear_bwd", "sparse_range_fwd", "sparse_range_bwd",
       "block_sparse_fwd", "block_sparse_bwd", "hopfield_update_fwd", "hopfield_energy_fwd")
# Ops with a CPU kernel only (no CUDA registration: a CUDA call gets the dispatcher's "could not
# run ... with arguments from the 'CUDA' backend"): the paged KV-cache decode (issue 28).
CPU_ONLY_OPS = ("softmax_decode_paged",)


def cpu(*shape, dtype=F32):
    return torch.zeros(*shape, dtype=dtype)


def meta(*shape, dtype=F16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def cpu_raises(op, args, match):
    """The CPU kernel and the check alone both reject args, with a message matching `match`
    (and naming the op and the backend)."""
    full = rf"attnkit::{op} \(cpu\): .*{match}"
    with pytest.raises(RuntimeError, match=full):
        getattr(torch.ops.attnkit, op)(*args)
    with pytest.raises(RuntimeError, match=full):
        getattr(checks, op)(CPU, *args)


def cpu_check_raises(op, args, match):
    """The CPU branch of the check alone rejects args (device mismatches: the dispatcher never
    sends those to the CPU kernel)."""
    with pytest.raises(RuntimeError, match=rf"attnkit::{op} \(cpu\): .*{match}"):
        getattr(checks, op)(CPU, *args)


def cuda_raises(op, args, match, target=CUDA):
    with pytest.raises(RuntimeError, match=rf"attnkit::{op} \(cuda\): .*{match}"):
        getattr(checks, op)(target, *args)


def test_every_op_has_a_check_bound():
    declared = re.findall(r'm\.def\("(\w+)\(', (ROOT / "csrc/ops.cpp").read_text())
    assert sorted(declared) == sorted(OPS + CPU_ONLY_OPS)
    assert all(hasattr(checks, op) for op in OPS + CPU_ONLY_OPS)


def test_the_native_code_is_wired_to_the_checks():
    """Source-level guard of the design: every CPU kernel calls its op's check; every CUDA kernel
    is registered from csrc/checks/ (g++), whose wrapper checks first and raises launch errors
    after; nothing in csrc/cuda/ checks inputs, throws on a CUDA error, or registers itself."""
    cpu_src = "".join(p.read_text() for p in (ROOT / "csrc/cpu").glob("*.cpp"))
    checks_src = "".join(p.read_text() for p in (ROOT / "csrc/checks").glob("*.cpp"))
    for op in CPU_ONLY_OPS:
        assert f"checks::{op}(checks::cpu_target()," in cpu_src, op
        assert f'm.impl("{op}"' not in checks_src, op
    for op in OPS:
        assert f"checks::{op}(checks::cpu_target()," in cpu_src, op
        assert f'm.impl("{op}", &attnkit::{op}_cuda_checked);' in checks_src, op
        wrapper = re.search(rf"{op}_cuda_checked\(.*?\n}}\n", checks_src, re.S).group(0)
        call = re.search(rf"\b{op}_cuda\(", wrapper).start()
        assert wrapper.index(f"checks::{op}(checks::cuda_target(") < call \
            < wrapper.index(f'checks::raise_cuda_error("{op}")'), wrapper
    for path in [*(ROOT / "csrc/cuda").glob("*.cu"), *(ROOT / "csrc/cuda").glob("*.cuh")]:
        code = re.sub(r"//[^\n]*", "", path.read_text())
        for word in ("C10_CUDA_CHECK", "C10_CUDA_KERNEL_LAUNCH_CHECK", "TORCH_LIBRARY", "throw"):
            assert word not in code, f"{path.name} uses {word}: input checks belong in csrc/checks/ (issue 10)"
    # No message is formatted through iostreams inside attnkit._C (TORCH_CHECK's c10::str did, and
    # that segfaulted on the GPU image: csrc/message.h); ATTNKIT_CHECK instead.
    for path in ROOT.glob("csrc/**/*"):
        if path.suffix in (".h", ".cuh", ".cpp", ".cu") and path.name != "message.h":
            code = re.sub(r"//[^\n]*", "", path.read_text())
            for word in ("TORCH_CHECK", "TORCH_INTERNAL_ASSERT", "c10::str(", "operator<<"):
                assert word not in code, f"{path.relative_to(ROOT)} uses {word}: use ATTNKIT_CHECK (csrc/message.h)"


def _cuda_include():
    from torch.utils.cpp_extension import CUDA_HOME

    for home in (CUDA_HOME, "/usr/local/cuda"):
        if home and (pathlib.Path(home) / "include" / "cuda_runtime.h").exists():
            return str(pathlib.Path(home) / "include")
    return None


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None, reason="needs g++ and the CUDA headers")
def test_cuda_build_of_the_gxx_sources_compiles():
    """The CPU torch wheel cannot link a CUDA extension, so CI cannot build it; this compiles (C++17,
    syntax only) what the g++ side of a CUDA build adds: the CUDA registrations and the device
    query of csrc/checks/ (ATTNKIT_WITH_CUDA).  The .cu files: .ci/compile_cuda.sh."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = ["-isystem", _cuda_include()]
    for path in [*include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", path]
    sources = [ROOT / "csrc/ops.cpp", *sorted((ROOT / "csrc/checks").glob("*.cpp"))]
    procs = {}
    for src in sources:
        cmd = ["g++", "-std=c++17", "-fsyntax-only", "-Wall", "-Werror=c++20-extensions", "-Werror=c++20-compat",
               "-DATTNKIT_WITH_CUDA",
               "-DTORCH_EXTENSION_NAME=_C", *includes, str(src)]
        procs[src.name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if len(procs) % 2 == 0:  # two at a time: the CI machine has 2 cores
            for p in procs.values():
                p.wait()
    failures = {name: p.communicate()[0] for name, p in procs.items() if p.wait() != 0}
    assert not failures, "\n".join(f"{name}:\n{log[-3000:]}" for name, log in failures.items())


def test_targets():
    with pytest.raises(RuntimeError, match="backend must be 'cpu' or 'cuda'; got 'tpu'"):
        checks.Target("tpu")
    q = meta(1, 1, 4, 64)
    with pytest.raises(RuntimeError, match=r"attnkit::softmax_fwd \(cuda\): the cuda backend takes CUDA tensors; "
                                           r"got q on meta"):
        checks.softmax_fwd(checks.Target("cuda"), q, q, q, None, 1.0, False)
    with pytest.raises(RuntimeError, match=r"attnkit::softmax_fwd \(cpu\): the cpu backend takes CPU tensors; "
                                           r"got q on meta"):
        checks.softmax_fwd(CPU, q, q, q, None, 1.0, False)


# ================================================================================== softmax


def test_softmax_accepts_valid_inputs():
    q, k, v = cpu(2, 4, 7, 16), cpu(2, 2, 9, 16), cpu(2, 2, 9, 8)
    checks.softmax_fwd(CPU, q, k, v, cpu(2, 4, 7, 9, dtype=torch.bool), 0.5, True)
    checks.softmax_bwd(CPU, cpu(2, 4, 7, 8), q, k, v, cpu(2, 4, 7, 8), cpu(2, 4, 7), None, 0.5, False)
    for dtype, d in itertools.product((F16, BF16), (64, 128)):
        q, k = meta(2, 4, 7, d, dtype=dtype), meta(2, 2, 9, d, dtype=dtype)
        checks.softmax_fwd(CUDA, q, k, k, meta(1, 4, 1, 9, dtype=F32), 0.5, True)  # 1 in any dim: fine
        checks.softmax_bwd(CUDA, q, q, k, k, q, meta(2, 4, 7, dtype=F32), None, 0.5, False)


@pytest.mark.parametrize("case", [
    ((cpu(4, 8, 16), cpu(1, 2, 9, 16), cpu(1, 2, 9, 16)), r"expected q \[B,H,N,D\], k \[B,Hk,M,D\], v \[B,Hk,M,Dv\]; "
                                                           r"got 3-D, 4-D and 4-D"),
    ((cpu(1, 4, 8, 16), cpu(1, 2, 9, 16, dtype=F64), cpu(1, 2, 9, 16)),
     "q, k and v must share a dtype; got Float, Double"),
    ((cpu(1, 4, 8, 16, dtype=I32),) * 3, "expected floating inputs; got Int"),
    ((cpu(1, 4, 8, 16), cpu(2, 2, 9, 16), cpu(2, 2, 9, 16)), "batch sizes differ"),
    ((cpu(1, 4, 8, 16), cpu(1, 2, 9, 8), cpu(1, 2, 9, 16)), "q and k must share the head dim"),
    ((cpu(1, 4, 8, 16), cpu(1, 2, 9, 16), cpu(1, 2, 10, 16)), "k and v must agree on Hk and M"),
    ((cpu(1, 4, 8, 16), cpu(1, 3, 9, 16), cpu(1, 3, 9, 16)), "multiple of the key/value heads; got H = 4, Hk = 3"),
])
def test_softmax_cpu_rejects(case):
    (q, k, v), match = case
    cpu_raises("softmax_fwd", (q, k, v, None, 1.0, False), match)


def test_softmax_cpu_rejects_bad_masks_and_backward_inputs():
    q, k, v = cpu(1, 4, 8, 16), cpu(1, 2, 9, 16), cpu(1, 2, 9, 16)
    cpu_raises("softmax_fwd", (q, k, v, cpu(1, 1, 8, 9, dtype=torch.bool), 1.0, False),
               r"mask must have shape \[B, H, N, M\] = \[1, 4, 8, 9\] \(a broadcast view is fine\); got \[1, 1, 8, 9\]")
    cpu_raises("softmax_fwd", (q, k, v, cpu(1, 4, 8, 9, dtype=I32), 1.0, False),
               "mask must be bool or floating point .*; got Int")
    out, lse = cpu(1, 4, 8, 16), cpu(1, 4, 8)
    cpu_raises("softmax_bwd", (out[:, :, :4], q, k, v, out, lse, None, 1.0, False),
               r"grad_out and out must have shape \[B, H, N, Dv\] = \[1, 4, 8, 16\]; got \[1, 4, 4, 16\] and")
    cpu_raises("softmax_bwd", (out, q, k, v, out.double(), lse, None, 1.0, False),
               "grad_out and out must have q's dtype Float; got Float and Double")
    cpu_raises("softmax_bwd", (out, q, k, v, out, lse[:, :2], None, 1.0, False),
               r"lse must have shape \[B, H, N\] = \[1, 4, 8\]; got \[1, 2, 8\]")
    cpu_raises("softmax_bwd", (out, q, k, v, out, lse.double(), None, 1.0, False), "lse must be Float; got Double")
    cpu_raises("softmax_bwd", (out.double(), q.double(), k.double(), v.double(), out.double(), lse, None, 1.0, False),
               "lse must be Double; got Float")
    # Devices: the dispatcher would route a CUDA tensor to the CUDA kernel; meta ones show the check.
    cpu_check_raises("softmax_fwd", (q, meta(1, 2, 9, 16, dtype=F32), v, None, 1.0, False),
                 r"k must be on q's device \(cpu\); got meta")
    cpu_check_raises("softmax_fwd", (q, k, v, meta(1, 4, 8, 9, dtype=torch.bool), 1.0, False),
                 r"mask must be on q's device \(cpu\); got meta")
    cpu_check_raises("softmax_bwd", (out, q, k, v, out, meta(1, 4, 8, dtype=F32), None, 1.0, False),
                 r"lse must be on q's device \(cpu\); got meta")


def test_softmax_decode_paged_cpu_checks():
    """attnkit::softmax_decode_paged (CPU only): the caches [num_blocks, Hk, block_size, *], the
    int64 table's shape, dtype, device and used entries, the decoding kernel's row limits, the
    score options -- through the op and the check alike."""
    q, kc, vc = cpu(2, 4, 1, 8), cpu(11, 2, 8, 8), cpu(11, 2, 8, 6)
    table = torch.arange(10, dtype=I64).view(2, 5)
    checks.softmax_decode_paged(CPU, q, kc, vc, table, 40, 0.5)  # valid: no raise
    cpu_raises("softmax_decode_paged", (q, kc, vc, table.int(), 40, 0.5), "block_table must be int64; got Int")
    cpu_raises("softmax_decode_paged", (q, kc, vc, table, 41, 0.5), "length 41 needs 6 blocks of 8; block_table has 5")
    cpu_raises("softmax_decode_paged", (q, kc, vc, table - 1, 40, 0.5),
               r"first 5 entries of each row must be blocks of the cache, in \[0, 11\); got values in \[-1, 8\]")
    cpu_raises("softmax_decode_paged", (cpu(2, 4, 17, 8), kc, vc, table, 40, 0.5), "N <= 16 query rows")
    cpu_raises("softmax_decode_paged", (cpu(2, 3, 1, 8), kc, vc, table, 40, 0.5),
               "the query heads must be a multiple of the key/value heads; got H = 3, Hk = 2")
    cpu_raises("softmax_decode_paged", (q, kc, vc, table, 40, 0.5, -1, -1, 0.0, cpu(2, 4, dtype=F64)),
               "alibi_slopes must be Float; got Double")
    cpu_check_raises("softmax_decode_paged", (q, kc, vc, meta(2, 5, dtype=I64), 40, 0.5),
                     r"block_table must be on q's device \(cpu\); got meta")


def test_softmax_cuda_branch():
    q = meta(1, 2, 4, 64)
    ok = (q, q, q, None, 1.0, False)
    on_cpu = cpu(1, 2, 4, 64, dtype=F16)  # the CUDA kernel gets a CPU q in a mixed-device call
    cuda_raises("softmax_fwd", (on_cpu, on_cpu, on_cpu, None, 1.0, False),
                r"the cuda backend takes CUDA tensors; got q on cpu", target=checks.Target("cuda"))
    cuda_raises("softmax_fwd", (q, q, on_cpu, None, 1.0, False), r"v must be on q's device \(meta\); got cpu")
    for dtype in (F32, F64):
        x = meta(1, 2, 4, 64, dtype=dtype)
        cuda_raises("softmax_fwd", (x, x, x, None, 1.0, False), "the cuda kernels take float16 or bfloat16; got")
    for d, dv in ((96, 96), (32, 32), (64, 128)):
        cuda_raises("softmax_fwd", (meta(1, 1, 4, d), meta(1, 1, 4, d), meta(1, 1, 4, dv), None, 1.0, False),
                    f"the cuda kernels support head dims 64 and 128, with value's head dim equal to query's; "
                    f"got D = {d}, Dv = {dv}")
    cuda_raises("softmax_fwd", (meta(1, 3, 4, 64), meta(1, 2, 5, 64), meta(1, 2, 5, 64), None, 1.0, False),
                "multiple of the key/value heads")
    # D = 256: only where the Hopper kernels run (Target sm90), and without a mask (they take none).
    h256 = meta(1, 2, 4, 256)
    hopper = checks.Target("cuda", device="meta", sm90=True)
    checks.softmax_fwd(hopper, h256, h256, h256, None, 1.0, True)
    checks.softmax_bwd(hopper, h256, h256, h256, h256, h256, meta(1, 2, 4, dtype=F32), None, 1.0, True)
    cuda_raises("softmax_fwd", (h256, h256, h256, None, 1.0, False),
                r"head dims 64 and 128, .*got D = 256, Dv = 256 \(256 runs on the Hopper kernels: ATTNKIT_CUDA_SM90 set")
    cuda_raises("softmax_fwd", (h256, h256, h256, meta(1, 2, 4, 4, dtype=torch.bool), 1.0, False),
                r"got D = 256, Dv = 256 \(256 runs on the Hopper kernels, which take no mask\)", target=hopper)
    cuda_raises("softmax_fwd", (h256, h256, meta(1, 2, 4, 128), None, 1.0, False), r"got D = 256, Dv = 128",
                target=hopper)
    s256 = meta(1, 1, 64, 256)  # the sparse kernels have no D = 256, Hopper or not
    cuda_raises("sparse_range_fwd", (s256, s256, s256, [1, 0, 1, 0, 1], [0, 1, 0, 0], [0, 1, 1, 0], 0.1),
                "head dims 64 and 128", target=hopper)
    big = meta(1, 1, 1 << 30, 64)
    cuda_raises("softmax_fwd", (big, q[:, :1], q[:, :1], None, 1.0, False),
                r"sequence lengths must be < 2\^30; got N = 1073741824, M = 4")
    wide = meta(1, 65536, 1, 64)
    cuda_raises("softmax_fwd", (wide, wide, wide, None, 1.0, False),
                r"B and H must be <= 65535 \(CUDA grid\); got B = 1, H = 65536")
    cuda_raises("softmax_fwd", ok, r"the cuda kernels need compute capability 8.0 or newer .*; got 7.5",
                target=checks.Target("cuda", device="meta", cc=(7, 5)))
    # masks: 1 in any dim is fine on CUDA (read with stride 0)
    q, k = meta(1, 2, 4, 64), meta(1, 1, 5, 64)
    checks.softmax_fwd(CUDA, q, k, k, meta(1, 1, 1, 5, dtype=torch.bool), 1.0, False)
    cuda_raises("softmax_fwd", (q, k, k, meta(1, 2, 4, 6, dtype=torch.bool), 1.0, False),
                r"mask must have shape \[B, H, N, M\] = \[1, 2, 4, 5\] \(or 1 in any dim\); got \[1, 2, 4, 6\]")
    cuda_raises("softmax_fwd", (q, k, k, meta(1, 2, 4, 5, dtype=I32), 1.0, False),
                "mask must be bool or floating point")
    cuda_raises("softmax_fwd", (q, k, k, cpu(1, 2, 4, 5, dtype=torch.bool), 1.0, False),
                r"mask must be on q's device \(meta\); got cpu")
    lse = meta(1, 2, 4, dtype=F32)
    cuda_raises("softmax_bwd", (q, q, k, k, q, lse.double(), None, 1.0, False), "lse must be Float; got Double")
    cuda_raises("softmax_bwd", (q, q, k, k, q.float(), lse, None, 1.0, False), "grad_out and out must have q's dtype")
    cuda_raises("softmax_bwd", (q, q, k, k, q, cpu(1, 2, 4), None, 1.0, False), r"lse must be on q's device")


# ================================================================================== linear

LIN = ("elu", True, 1e-6, 1.0)


def lin_fwd_args(q, k, v, S0=None, z0=None, causal=False, fm="elu"):
    return (q, k, v, S0, z0, causal, fm, True, 1e-6, 1.0)


def lin_bwd_args(q, k, v, out=None, den=None, S=None, z=None, g=None, gden=None, gS=None, gz=None, S0=None, z0=None,
                 causal=False, fm="elu", mk=cpu):
    B, H, N, D = q.shape
    Dv = v.shape[3]
    acc = F64 if q.dtype == F64 else F32
    out = mk(B, H, N, Dv, dtype=q.dtype) if out is None else out
    den = mk(B, H, N, dtype=acc) if den is None else den
    S = mk(B, H, D, Dv, dtype=acc) if S is None else S
    z = mk(B, H, D, dtype=acc) if z is None else z
    return (g, gden, gS, gz, q, k, v, out, den, S, z, S0, z0, causal, fm, True, 1e-6, 1.0)


def test_linear_accepts_valid_inputs():
    for dtype in (F16, BF16, F32, F64):
        acc = F64 if dtype == F64 else F32
        q, k, v = cpu(1, 2, 5, 4, dtype=dtype), cpu(1, 2, 5, 4, dtype=dtype), cpu(1, 2, 5, 3, dtype=dtype)
        S0, z0 = cpu(1, 2, 4, 3, dtype=acc), cpu(1, 2, 4, dtype=acc)
        checks.linear_fwd(CPU, *lin_fwd_args(q, k, v, S0, z0, causal=True, fm="relu"))
        checks.linear_bwd(CPU, *lin_bwd_args(q, k, v, g=cpu(1, 2, 5, 3, dtype=dtype), S0=S0, z0=z0, causal=True))
        q, k, v = meta(1, 2, 5, 4, dtype=dtype), meta(1, 2, 5, 4, dtype=dtype), meta(1, 2, 5, 3, dtype=dtype)
        checks.linear_fwd(CUDA, *lin_fwd_args(q, k, v, causal=True, fm="identity"))
        checks.linear_bwd(CUDA, *lin_bwd_args(q, k, v, mk=lambda *s, dtype: meta(*s, dtype=dtype)))


def test_linear_cpu_rejects():
    q, k, v = cpu(1, 2, 4, 16), cpu(1, 2, 5, 16), cpu(1, 2, 5, 16)
    cpu_raises("linear_fwd", lin_fwd_args(q[0], k, v), r"expected q \[B,H,N,D\], k \[B,H,M,D\], v \[B,H,M,Dv\]; "
                                                       r"got \[2, 4, 16\]")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v.double()),
               "q, k and v must share a dtype; got Float, Float and Double")
    cpu_raises("linear_fwd", lin_fwd_args(q.int(), k.int(), v.int()),
               "the cpu kernels take float16, bfloat16, float32 or float64; got Int")
    cpu_raises("linear_fwd", lin_fwd_args(q, k[..., :8], v), "q, k, v sizes do not fit")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, causal=True), "causal needs N == M; got 4 and 5")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, fm="tanh"),
               "unknown feature_map 'tanh'; expected 'elu', 'relu' or 'identity'")
    S0, z0 = cpu(1, 2, 16, 16), cpu(1, 2, 16)
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, S0.double(), z0), "S0 must be Float; got Double")
    cpu_raises("linear_fwd", lin_fwd_args(q.double(), k.double(), v.double(), S0, z0.double()),
               "S0 must be Double; got Float")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, S0, z0[..., :3]),
               r"z0 must have shape \[1, 2, 16\]; got \[1, 2, 3\]")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, S0, None), "S0 and z0 go together; got S0 without z0")
    cpu_raises("linear_fwd", lin_fwd_args(q, k, v, None, z0), "S0 and z0 go together; got z0 without S0")
    cpu_check_raises("linear_fwd", lin_fwd_args(q, k, v, meta(1, 2, 16, 16, dtype=F32), z0),
                 r"S0 must be on q's device \(cpu\); got meta")
    cpu_check_raises("linear_fwd", lin_fwd_args(q, meta(1, 2, 5, 16, dtype=F32), v), "k must be on q's device")


@pytest.mark.parametrize("field,value,match", [
    ("out", cpu(1, 2, 4, 8), r"out must be the forward's output, \[B, H, N, Dv\] = \[1, 2, 4, 16\] of q's dtype Float; "
                             r"got \[1, 2, 4, 8\] Float"),
    ("out", cpu(1, 2, 4, 16, dtype=F64), "out must be the forward's output"),
    ("den", cpu(1, 2, 5), r"den must have shape \[1, 2, 4\]; got \[1, 2, 5\]"),
    ("den", cpu(1, 2, 4, dtype=F64), "den must be Float; got Double"),
    ("S", cpu(1, 2, 16, 15), r"S must have shape \[1, 2, 16, 16\]"),
    ("z", cpu(1, 2, 15), r"z must have shape \[1, 2, 16\]"),
    ("gden", cpu(1, 2, 3), r"grad_den must have shape \[1, 2, 4\]"),
    ("gS", cpu(1, 2, 16, 16, dtype=F16), "grad_S must be Float; got Half"),
    ("gz", cpu(2, 16), r"grad_z must have shape \[1, 2, 16\]"),
    ("g", cpu(1, 2, 4, 15), r"grad_out must be shaped and typed like out, \[1, 2, 4, 16\] Float; got \[1, 2, 4, 15\]"),
    ("g", cpu(1, 2, 4, 16, dtype=F64), "grad_out must be shaped and typed like out"),
    ("S0", cpu(1, 2, 16, 16), "S0 and z0 go together"),
])
def test_linear_cpu_rejects_backward_inputs(field, value, match):
    q, k, v = cpu(1, 2, 4, 16), cpu(1, 2, 5, 16), cpu(1, 2, 5, 16)
    cpu_raises("linear_bwd", lin_bwd_args(q, k, v, **{field: value}), match)


def test_linear_cpu_rejects_backward_devices():
    q, k, v = cpu(1, 2, 4, 16), cpu(1, 2, 5, 16), cpu(1, 2, 5, 16)
    cpu_check_raises("linear_bwd", lin_bwd_args(q, k, v, g=meta(1, 2, 4, 16, dtype=F32)),
                 r"grad_out must be on q's device \(cpu\); got meta")
    cpu_check_raises("linear_bwd", lin_bwd_args(q, k, v, out=meta(1, 2, 4, 16, dtype=F32)), "out must be on q's device")
    cpu_check_raises("linear_bwd", lin_bwd_args(q, k, v, den=meta(1, 2, 4, dtype=F32)), "den must be on q's device")


def test_linear_cuda_branch():
    q, k, v = meta(1, 2, 4, 16, dtype=F32), meta(1, 2, 5, 16, dtype=F32), meta(1, 2, 5, 16, dtype=F32)
    # the inputs that crashed the process on an H200 (issue 10): causal with N != M
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, causal=True), "causal needs N == M; got 4 and 5")
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, fm="softplus"), "unknown feature_map 'softplus'")
    cuda_raises("linear_fwd", lin_fwd_args(q, k[..., :8], v), "sizes do not fit")
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v.half()), "share a dtype")
    cuda_raises("linear_fwd", lin_fwd_args(*(t.int() for t in (q, k, v))),
                "the cuda kernels take float16, bfloat16, float32 or float64; got Int")
    s0, z0 = meta(1, 2, 16, 16, dtype=F32), meta(1, 2, 16, dtype=F32)
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, s0.double(), z0), "S0 must be Float")
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, s0, None), "S0 and z0 go together")
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, s0, z0[..., :3]), r"z0 must have shape \[1, 2, 16\]")
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v, s0, cpu(1, 2, 16)), r"z0 must be on q's device \(meta\); got cpu")
    # limits: tensor cores for 16-bit, the grid, int indexing, shared memory for float64
    old = checks.Target("cuda", device="meta", cc=(7, 5))
    checks.linear_fwd(old, *lin_fwd_args(q, k, v))  # float32 runs on CUDA cores
    h = meta(1, 2, 4, 16)
    cuda_raises("linear_fwd", lin_fwd_args(h, h, h), "float16 / bfloat16 inputs need compute capability 8.0 or newer",
                target=old)
    wide = meta(65536, 1, 4, 16, dtype=F32)
    cuda_raises("linear_fwd", lin_fwd_args(wide, wide, wide), r"B and H must be <= 65535 \(CUDA grid\); got B = 65536")
    deep = meta(1, 1, 4, 1 << 24, dtype=F32)
    cuda_raises("linear_fwd", lin_fwd_args(deep, deep, deep), r"sizes too large: need N, M < 2\^30 and D, Dv < 2\^24")
    d = meta(1, 2, 4, 16, dtype=F64)
    checks.linear_fwd(CUDA, *lin_fwd_args(d, d, d))  # 227 KiB: enough
    ampere_consumer = checks.Target("cuda", device="meta", cc=(8, 6), smem_optin=99 * 1024)
    checks.linear_fwd(ampere_consumer, *lin_fwd_args(q, k, v))  # float32: 56320 bytes
    # float32 / float16 / bfloat16: two bfloat16 tiles of a split state per slot (linear.cu)
    just_under = checks.Target("cuda", device="meta", cc=(8, 0), smem_optin=56320 - 1)
    cuda_raises("linear_fwd", lin_fwd_args(q, k, v),
                r"the cuda kernels need 56320 bytes of shared memory per block for Float inputs; this device "
                r"\(compute capability 8.0\) allows 56319", target=just_under)
    cuda_raises("linear_fwd", lin_fwd_args(d, d, d),
                r"the cuda kernels need 101888 bytes of shared memory per block for Double inputs; this device "
                r"\(compute capability 8.6\) allows 101376", target=ampere_consumer)
    mk = lambda *s, dtype: meta(*s, dtype=dtype)  # noqa: E731
    cuda_raises("linear_bwd", lin_bwd_args(q, k, v, g=meta(1, 2, 4, 16, dtype=F16), mk=mk),
                "grad_out must be shaped and typed like out")
    cuda_raises("linear_bwd", lin_bwd_args(q, k, v, S=cpu(1, 2, 16, 16), mk=mk), r"S must be on q's device")


# ================================================================================== sparse

V1 = [1, 0, 1, 0, 1]  # one group, every row
LO, HI = [0, 1, 0, 0], [0, 1, 1, 0]  # key t' in [0, t]: causal


def test_sparse_accepts_valid_inputs():
    q = cpu(1, 2, 10, 8)
    checks.sparse_range_fwd(CPU, q, q, cpu(1, 2, 10, 4), [3, 1, 3, 1, 3], LO, HI, 1.0)  # 3 interleaved groups
    checks.sparse_range_bwd(CPU, cpu(1, 2, 10, 4), q, q, cpu(1, 2, 10, 4), cpu(1, 2, 10), cpu(1, 2, 10),
                            [2, 1, 2, 0, 1], LO, HI, 1.0)  # queries interleaved, keys shared: fine on the CPU
    h = meta(1, 2, 64, 64)
    checks.sparse_range_fwd(CUDA, h, h, h, [8, 1, 8, 1, 8], LO, HI, 1.0)
    checks.sparse_range_bwd(CUDA, h, h, h, h, meta(1, 2, 64, dtype=F32), meta(1, 2, 64, dtype=F32), [2, 33, 32, 33, 32],
                            LO, HI, 1.0)  # rows 0, 32 | 33: disjoint by the second form, pg > (T_0 - 1) pt
    ptr = torch.tensor([[0, 1, 3], [3, 5, 5]], dtype=I32)  # absolute offsets: head 1 owns idx[3:5]
    idx = torch.tensor([0, 0, 1, 0, 1], dtype=I32)
    checks.block_sparse_fwd(CPU, q[:, :, :8], q[:, :, :8], q[:, :, :8], ptr, idx, 4, True, 1.0)
    checks.block_sparse_fwd(CUDA, h, h, h, meta(1, 5, dtype=I32), meta(7, dtype=I32), 16, True, 1.0)


@pytest.mark.parametrize("qkv,match", [
    ((cpu(2, 10, 8), cpu(1, 2, 10, 8), cpu(1, 2, 10, 8)), r"expected q \[B,H,Nq,D\], k \[B,H,Nk,D\], v \[B,H,Nk,Dv\]; "
                                                          r"got 3-D, 4-D and 4-D"),
    ((cpu(1, 2, 10, 8), cpu(1, 2, 10, 8, dtype=F16), cpu(1, 2, 10, 8)), "q, k and v must share a dtype"),
    ((cpu(1, 2, 10, 8, dtype=I64),) * 3, "expected floating inputs; got Long"),
    ((cpu(1, 2, 10, 8), cpu(1, 1, 10, 8), cpu(1, 1, 10, 8)), "q, k, v must share B and H"),
    ((cpu(1, 2, 10, 8), cpu(1, 2, 10, 4), cpu(1, 2, 10, 8)), "q and k must share D"),
    ((cpu(1, 2, 10, 8), cpu(1, 2, 10, 8), cpu(1, 2, 9, 8)), "k and v must have the same rows"),
])
def test_sparse_cpu_rejects_bad_tensors(qkv, match):
    cpu_raises("sparse_range_fwd", (*qkv, V1, LO, HI, 1.0), match)
    ptr, idx = torch.zeros(1, 3, dtype=I32), torch.zeros(0, dtype=I32)
    cpu_raises("block_sparse_fwd", (*qkv, ptr, idx, 5, False, 1.0), match)


@pytest.mark.parametrize("view,lo,hi,match", [
    ([1, 0, 1, 0], LO, HI, r"view must be \[G, q_pg, q_pt, k_pg, k_pt\]; got 4 values"),
    ([1, 0, 0, 0, 1], LO, HI, r"needs G, q_pg, k_pg >= 0 and q_pt, k_pt >= 1; got \[1, 0, 0, 0, 1\]"),
    ([-1, 0, 1, 0, 1], LO, HI, "needs G, q_pg, k_pg >= 0"),
    (V1, [0, 1, 0], HI, r"lo must be \[a, d, m, b\]; got 3 values"),
    (V1, LO, [0, 0, 1, 0], r"hi = \[a, d, m, b\] needs d >= 1 and m >= 0 \(nondecreasing bounds\); got d=0, m=1"),
    (V1, [0, 1, -1, 0], HI, "lo = .* needs d >= 1 and m >= 0"),
    (V1, [1 << 61, 1, 0, 0], HI, r"lo's offset a is out of range \(\|a\| < 2\^60\)"),
    ([2, 0, 1, 0, 1], LO, HI, "view .* puts query row 0 in two groups; the kernels need the groups' query rows to be "
                              "disjoint"),
    ([3, 4, 1, 0, 1], LO, HI, "puts query row 4 in two groups"),  # g0 rows 0..9, g1 rows 4..9
])
def test_sparse_cpu_rejects_bad_views(view, lo, hi, match):
    q = cpu(1, 2, 10, 8)
    cpu_raises("sparse_range_fwd", (q, q, q, view, lo, hi, 1.0), match)
    g, rows = cpu(1, 2, 10, 8), cpu(1, 2, 10)
    cpu_raises("sparse_range_bwd", (g, q, q, q, rows, rows, view, lo, hi, 1.0), match)


def test_sparse_cpu_rejects_bad_backward_inputs():
    q, v, rows = cpu(1, 2, 10, 8), cpu(1, 2, 10, 4), cpu(1, 2, 10)
    bad = [
        ((cpu(1, 2, 10, 8), q, q, v, rows, rows),
         r"grad_out must be \[B, H, Nq, Dv\] = \[1, 2, 10, 4\]; got \[1, 2, 10, 8\]"),
        ((v.double(), q, q, v, rows, rows), "grad_out must have q's dtype Float; got Double"),
        ((v, q, q, v, rows[:, :1], rows), r"lse and delta must be \[B, H, Nq\] = \[1, 2, 10\]; got lse \[1, 1, 10\]"),
        ((v, q, q, v, rows, rows.double()), "lse and delta must be Float; got delta Double"),
    ]
    for args, match in bad:
        cpu_raises("sparse_range_bwd", (*args, V1, LO, HI, 1.0), match)
    cpu_check_raises("sparse_range_bwd", (v, q, q, v, rows, meta(1, 2, 10, dtype=F32), V1, LO, HI, 1.0),
                 r"delta must be on q's device \(cpu\); got meta")


def test_block_sparse_cpu_rejects():
    q = cpu(1, 2, 32, 4)
    ptr, idx = torch.tensor([[0, 1, 2]], dtype=I32), torch.tensor([0, 1], dtype=I32)

    def fwd(q=q, k=q, ptr=ptr, idx=idx, block=16):
        return (q, k, k, ptr, idx, block, False, 1.0)

    cpu_raises("block_sparse_fwd", fwd(block=0), "block must be >= 1; got 0")
    cpu_raises("block_sparse_fwd", fwd(k=cpu(1, 2, 16, 4)), "q and k must have the same length N")
    cpu_raises("block_sparse_fwd", fwd(block=15), "N = 32 must be a multiple of block = 15")
    cpu_raises("block_sparse_fwd", fwd(ptr=ptr.long()), "row_ptr and col_idx must be int32; got Long and Int")
    cpu_raises("block_sparse_fwd", fwd(ptr=ptr.repeat(3, 1)), r"row_ptr must be \[1 or H, nb \+ 1\] = \[1 or 2, 3\]; "
                                                              r"got \[3, 3\]")
    cpu_raises("block_sparse_fwd", fwd(ptr=ptr[:, :2]), r"row_ptr must be \[1 or H, nb \+ 1\]")
    cpu_raises("block_sparse_fwd", fwd(idx=idx[None]), r"col_idx must be 1-D; got \[1, 2\]")
    cpu_raises("block_sparse_fwd", fwd(ptr=torch.tensor([[0, 2, 1]], dtype=I32)),
               r"row_ptr must hold nondecreasing offsets into col_idx \(2 entries\); head 0 row 1: \[2, 1\)")
    cpu_raises("block_sparse_fwd", fwd(ptr=torch.tensor([[0, 1, 3]], dtype=I32)), "nondecreasing offsets")
    cpu_raises("block_sparse_fwd", fwd(idx=torch.tensor([0, 2], dtype=I32)),
               r"col_idx entries must be increasing block indices in \[0, 2\) per row; head 0 row 1 has 2")
    cpu_raises("block_sparse_fwd", fwd(ptr=torch.tensor([[0, 2, 2]], dtype=I32), idx=torch.tensor([1, 0], dtype=I32)),
               "increasing block indices")
    cpu_check_raises("block_sparse_fwd", fwd(idx=meta(2, dtype=I32)),
                     r"col_idx must be on q's device \(cpu\); got meta")
    # backward: the transposed lists too, and that they transpose the row lists (sizes)
    g, rows = cpu(1, 2, 32, 4), cpu(1, 2, 32)

    def bwd(cptr=ptr, ridx=idx, block=16):
        return (g, q, q, q, rows, rows, ptr, idx, cptr, ridx, block, False, 1.0)

    cpu_raises("block_sparse_bwd", bwd(ridx=torch.tensor([0, 5], dtype=I32)),
               r"row_idx entries must be increasing block indices in \[0, 2\)")
    cpu_raises("block_sparse_bwd", bwd(ridx=torch.tensor([0, 1, 1], dtype=I32)),
               "the column lists must transpose the row lists; got 2 vs 3 entries")
    cpu_raises("block_sparse_bwd", bwd(cptr=torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=I32)),
               "the column lists must transpose the row lists; got 2 vs 2 entries, 1 vs 2 layout heads")


def test_sparse_cuda_branch():
    q = meta(1, 1, 64, 64)
    x32 = meta(1, 1, 64, 64, dtype=F32)
    cuda_raises("sparse_range_fwd", (x32, x32, x32, V1, LO, HI, 0.1),
                "the cuda kernels take float16 or bfloat16; got Float")
    q96 = meta(1, 1, 64, 96)
    cuda_raises("sparse_range_fwd", (q96, q96, q96, V1, LO, HI, 0.1), "head dims 64 and 128")
    cuda_raises("sparse_range_fwd", (q, q, meta(1, 1, 64, 128), V1, LO, HI, 0.1), "got D = 64, Dv = 128")
    big = meta(1, 1, 1 << 30, 64)
    cuda_raises("sparse_range_fwd", (q, big, big, V1, LO, HI, 0.1), r"sequence lengths must be < 2\^30; got Nq = 64")
    wide = meta(65536, 1, 64, 64)
    cuda_raises("sparse_range_fwd", (wide, wide, wide, V1, LO, HI, 0.1), r"B and H must be <= 65535")
    cuda_raises("sparse_range_fwd", (q, q, q, V1, LO, HI, 0.1), "compute capability 8.0",
                target=checks.Target("cuda", device="meta", cc=(7, 0)))
    # views and bounds: the kernels' int arithmetic, and groups disjoint by their closed forms
    cuda_raises("sparse_range_fwd", (q, q, q, [1, 0, 1 << 31, 0, 1], LO, HI, 0.1), r"view entries must be < 2\^31")
    for lo in ([0, 1 << 31, 0, 0], [0, 1, (1 << 20) + 1, 0], [(1 << 40) + 1, 1, 0, 0], [0, 1, 0, -(1 << 62) - 1]):
        cuda_raises("sparse_range_fwd", (q, q, q, V1, lo, HI, 0.1),
                    r"the cuda kernels take bounds \[a, d, m, b\] with 1 <= d < 2\^31, 0 <= m <= 2\^20")
    cuda_raises("sparse_range_fwd", (q, q, q, [2, 0, 1, 0, 1], LO, HI, 0.1),
                r"the cuda kernels need the groups' query rows to be disjoint; view = \[2, 0, 1, 0, 1\] with Nq = 64 "
                "puts some query row in two groups")
    # disjoint queries (interleaved) but shared keys (pg = 0): the forward takes it, the backward not
    interleaved_q_shared_k = [2, 1, 2, 0, 1]
    checks.sparse_range_fwd(CUDA, q, q, q, interleaved_q_shared_k, LO, HI, 0.1)
    rows = meta(1, 1, 64, dtype=F32)
    cuda_raises("sparse_range_bwd", (q, q, q, q, rows, rows, interleaved_q_shared_k, LO, HI, 0.1),
                "need the groups' query rows and key rows to be disjoint")
    cuda_raises("sparse_range_bwd", (q, q, q, q, rows.double(), rows, V1, LO, HI, 0.1),
                "lse and delta must be Float; got lse Double")
    cuda_raises("sparse_range_bwd", (q.float(), q, q, q, rows, rows, V1, LO, HI, 0.1), "grad_out must have q's dtype")
    # block-sparse
    ptr, idx = meta(1, 9, dtype=I32), meta(8, dtype=I32)
    cuda_raises("block_sparse_fwd", (q, q, q, ptr, idx, 8, False, 0.1),
                "the cuda kernels need block >= 16; got block = 8")
    cuda_raises("block_sparse_fwd", (q, q, q, ptr, idx, 24, False, 0.1), "N = 64 must be a multiple of block = 24")
    cuda_raises("block_sparse_fwd", (q, q, q, meta(1, 5, dtype=I32), cpu(8, dtype=I32), 16, False, 0.1),
                r"col_idx must be on q's device \(meta\); got cpu")
    cuda_raises("block_sparse_fwd", (q, q, q, meta(1, 5, dtype=I64), idx, 16, False, 0.1), "must be int32")
    q2, rows2 = meta(1, 2, 64, 64), meta(1, 2, 64, dtype=F32)
    cuda_raises("block_sparse_bwd", (q2, q2, q2, q2, rows2, rows2, meta(1, 5, dtype=I32), idx, meta(2, 5, dtype=I32),
                                     idx, 16, False, 0.1), "1 vs 2 layout heads")


def test_cuda_disjointness_test_is_sound():
    """The CUDA branch takes a view only when its closed-form tests prove the groups disjoint;
    whatever it takes, the exact row-by-row check of the CPU branch takes too."""
    taken = 0
    for n, G, pg, pt in itertools.product(range(1, 10), range(0, 5), range(0, 4), range(1, 4)):
        view = [G, pg, pt, pg, pt]
        try:
            checks.sparse_range_fwd(CUDA, meta(1, 1, n, 64), meta(1, 1, n, 64), meta(1, 1, n, 64), view, LO, HI, 1.0)
        except RuntimeError as e:
            assert "disjoint" in str(e)
            continue
        taken += 1
        checks.sparse_range_fwd(CPU, cpu(1, 1, n, 2), cpu(1, 1, n, 2), cpu(1, 1, n, 2), view, LO, HI, 1.0)
    assert taken > 100


# ================================================================================== hopfield


def upd(state, stored, values=None, beta=0.5, steps=1, tol=None, final_state=False):
    return (state, stored, values, beta, steps, tol, final_state)


def test_hopfield_accepts_valid_inputs():
    for dtype in (F16, BF16, F32, F64):
        checks.hopfield_update_fwd(CPU, *upd(cpu(2, 3, 4, 8, dtype=dtype), cpu(2, 3, 9, 8, dtype=dtype),
                                             cpu(2, 3, 9, 5, dtype=dtype), steps=3, tol=0.0))
        checks.hopfield_energy_fwd(CPU, cpu(2, 3, 4, 8, dtype=dtype), cpu(2, 3, 9, 8, dtype=dtype), 2.0)
    for dtype in (F16, BF16, F32):
        checks.hopfield_update_fwd(CUDA, *upd(meta(2, 3, 4, 256, dtype=dtype), meta(2, 3, 9, 256, dtype=dtype),
                                              meta(2, 3, 9, 1, dtype=dtype), steps=3))
        checks.hopfield_energy_fwd(CUDA, meta(2, 3, 4, 1, dtype=dtype), meta(2, 3, 9, 1, dtype=dtype), 2.0)


@pytest.mark.parametrize("args,match", [
    (upd(cpu(3, 7, 16), cpu(1, 3, 9, 16)), r"expected state \[B,H,S,D\] and stored \[B,H,N,D\]; got 3-D and 4-D"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16, dtype=F64)), "state and stored must share a dtype; got Float and Double"),
    (upd(cpu(1, 3, 7, 16, dtype=I32), cpu(1, 3, 9, 16, dtype=I32)), "expected floating inputs; got Int"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 8)), "state and stored must agree on B, H and D"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 0, 16)), r"needs at least one stored pattern \(N >= 1\)"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), beta=0.0), "beta must be finite and > 0; got 0"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), beta=float("nan")), "beta must be finite and > 0"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), steps=0), "steps must be >= 1; got 0"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), tol=float("inf")), "tol must be finite and >= 0; got inf"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), cpu(1, 3, 8, 2)),
     r"values must be \[B,H,N,Dv\] matching stored \[1, 3, 9, 16\]; got \[1, 3, 8, 2\]"),
    (upd(cpu(1, 3, 7, 16), cpu(1, 3, 9, 16), cpu(1, 3, 9, 2, dtype=F64)),
     r"values must share the dtype of stored \(Float\); got Double"),
])
def test_hopfield_cpu_rejects(args, match):
    cpu_raises("hopfield_update_fwd", args, match)
    if args[2] is None and args[4:] == (1, None, False):
        cpu_raises("hopfield_energy_fwd", (args[0], args[1], args[3]), match)


def test_hopfield_cpu_rejects_devices():
    s = cpu(1, 3, 7, 16)
    cpu_check_raises("hopfield_energy_fwd", (s, meta(1, 3, 9, 16, dtype=F32), 0.5),
                 r"stored must be on state's device \(cpu\); got meta")
    cpu_check_raises("hopfield_update_fwd", upd(s, cpu(1, 3, 9, 16), meta(1, 3, 9, 2, dtype=F32)),
                 r"values must be on state's device \(cpu\); got meta")


def test_hopfield_cuda_branch():
    s, x = meta(1, 2, 3, 16, dtype=F32), meta(1, 2, 9, 16, dtype=F32)
    for op, args in (("hopfield_update_fwd", upd(s.double(), x.double())),
                     ("hopfield_energy_fwd", (s.double(), x.double(), 0.5))):
        cuda_raises(op, args, "the cuda kernels take float16, bfloat16 and float32; got Double")
    cuda_raises("hopfield_energy_fwd", (meta(1, 2, 3, 300, dtype=F32), meta(1, 2, 9, 300, dtype=F32), 0.5),
                r"head dim D must be in 1..256; got 300")
    cuda_raises("hopfield_energy_fwd", (meta(1, 2, 3, 0, dtype=F32), meta(1, 2, 9, 0, dtype=F32), 0.5),
                r"head dim D must be in 1..256; got 0")
    # one block row per (b, h) in gridDim.y: B * H <= 65535 although B and H each are
    wide_s, wide_x = meta(256, 256, 1, 16, dtype=F32), meta(256, 256, 2, 16, dtype=F32)
    cuda_raises("hopfield_update_fwd", upd(wide_s, wide_x),
                r"B \* H must be <= 65535 \(CUDA grid\); got B = 256, H = 256")
    cuda_raises("hopfield_update_fwd", upd(s, x, meta(1, 2, 9, 257, dtype=F32)),
                r"value dim Dv must be in 1..256; got 257")
    cuda_raises("hopfield_update_fwd", upd(s, x, steps=1 << 31), r"steps must be < 2\^31 - 1")
    cuda_raises("hopfield_update_fwd", upd(s, x, cpu(1, 2, 9, 4)),
                r"values must be on state's device \(meta\); got cpu")
    cuda_raises("hopfield_energy_fwd", (s, x, -1.0), "beta must be finite and > 0")


# ================================================================================== on a GPU


@pytest.mark.gpu
def test_cuda_ops_raise_instead_of_crashing():
    """The inputs that killed the process on an H200 with torch 2.11 (issue 10) now raise, from
    g++-compiled code, before any launch; the CUDA context stays usable."""
    from attnkit_testing import native_cuda_ops

    ops = native_cuda_ops()
    dev = "cuda"
    q, k = torch.randn(1, 2, 4, 16, device=dev), torch.randn(1, 2, 5, 16, device=dev)
    with pytest.raises(RuntimeError, match=r"attnkit::linear_fwd \(cuda\): causal needs N == M"):
        ops.linear_fwd(q, k, k, None, None, True, *LIN)
    h96 = torch.randn(1, 1, 4, 96, device=dev, dtype=F16)
    with pytest.raises(RuntimeError, match=r"attnkit::softmax_fwd \(cuda\): .*head dims 64 and 128"):
        ops.softmax_fwd(h96, h96, h96, None, 1.0, False)
    h = torch.randn(1, 2, 4, 64, device=dev, dtype=F16)
    with pytest.raises(RuntimeError, match=r"mask must have shape \[B, H, N, M\]"):
        ops.softmax_fwd(h, h, h, torch.ones(1, 2, 4, 6, dtype=torch.bool, device=dev), 1.0, False)
    with pytest.raises(RuntimeError, match=r"mask must be on q's device"):
        ops.softmax_fwd(h, h, h, torch.ones(1, 2, 4, 4, dtype=torch.bool), 1.0, False)
    h64 = torch.randn(1, 1, 64, 64, device=dev, dtype=F16)
    with pytest.raises(RuntimeError, match=r"attnkit::sparse_range_fwd \(cuda\): .*disjoint"):
        ops.sparse_range_fwd(h64, h64, h64, [2, 0, 1, 0, 1], LO, HI, 0.1)
    with pytest.raises(RuntimeError, match=r"attnkit::hopfield_energy_fwd \(cuda\): .*float16, bfloat16 and float32"):
        ops.hopfield_energy_fwd(q.double(), q.double(), 0.5)
    wide = torch.randn(256, 256, 1, 4, device=dev)
    with pytest.raises(RuntimeError, match=r"B \* H must be <= 65535"):
        ops.hopfield_energy_fwd(wide, wide, 0.5)
    assert (torch.ones(1, device=dev) + 1).item() == 2.0  # the context still works


@pytest.mark.gpu
def test_cuda_target_reads_the_device():
    """The checks see the real device: a made-up target with its compute capability and shared
    memory gives the same verdicts as the op (here: float64 linear fits or not)."""
    from attnkit_testing import native_cuda_ops

    ops = native_cuda_ops()
    props = torch.cuda.get_device_properties(0)
    d = torch.randn(1, 1, 70, 8, device="cuda", dtype=F64)
    need = 101888
    target = checks.Target("cuda", cc=(props.major, props.minor),
                           smem_optin=getattr(props, "shared_memory_per_block_optin", need))
    try:
        checks.linear_fwd(target, *lin_fwd_args(d, d, d))
        fits = True
    except RuntimeError:
        fits = False
    if fits:
        ops.linear_fwd(d, d, d, None, None, False, *LIN)
    else:
        with pytest.raises(RuntimeError, match="bytes of shared memory"):
            ops.linear_fwd(d, d, d, None, None, False, *LIN)
