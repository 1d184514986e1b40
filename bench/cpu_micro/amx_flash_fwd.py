"""The own-AMX-tile flash forward prototype (amx_flash_fwd.cpp) against attnkit's cpu forward and
torch SDPA, bfloat16 B=1 H=8 D=64, interleaved in one process (min over rounds of 0.5 s each); the
max error of each against float64 first.  Not a test.  Xeon with AMX only (AMX-BF16, and a
compiler that takes -march=sapphirerapids).

    python bench/cpu_micro/amx_flash_fwd.py [THREADS (attnkit, SDPA; the prototype: one)] [N] [ROUNDS]
"""
import sys, time, torch, attnkit
from torch.utils.cpp_extension import load
load(name="amx_flash_fwd", sources=[__file__.replace(".py", ".cpp")], extra_cflags=["-O2", "-march=sapphirerapids"], is_python_module=False, verbose=False)
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
N = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
torch.manual_seed(0)
q, k, v = [torch.randn(1, 8, N, 64, dtype=torch.bfloat16) for _ in range(3)]
ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
fs = {
 "attnkit": lambda: attnkit.softmax_attention(q, k, v),
 "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v),
 "proto0": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 0),
 "proto1": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 1),
 "proto0_v1": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 100),
 "proto1_v1": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 101),
 "proto0_exactmax": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 10),
 "amx_only": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 3),
 "soft_only": lambda: torch.ops.amx_flash_fwd.fwd(q[0], k[0], v[0], 4),
}
for n, f in fs.items():
    o = f().double().reshape(ref.shape)
    print(n, "max err", (o - ref).abs().max().item())
best = {n: 1e9 for n in fs}
for rnd in range(int(sys.argv[3]) if len(sys.argv) > 3 else 5):
    for n, f in fs.items():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            a = time.perf_counter(); f(); best[n] = min(best[n], time.perf_counter() - a)
print({n: round(b * 1e3, 3) for n, b in best.items()}, "sdpa/x:", {n: round(best["sdpa"] / b, 2) for n, b in best.items()})
