"""cpublas::brgemm (oneDNN, AMX where the CPU has it) in GF/s on one thread at the bfloat16
forward's GEMM shapes (M, N, K, add_C, then an optional second shape alternated with it): the peer
of amx_gemm.cpp (session 18, RESULTS.md).  Builds brgemm_rates.cpp with torch's cpp_extension
(~1 min).  Not a test.

    python bench/cpu_micro/brgemm_rates.py
"""
import torch, sys
from torch.utils.cpp_extension import load
m = load(name="bgb", sources=[__file__.replace("brgemm_rates.py", "brgemm_rates.cpp")], extra_cflags=["-O2"], verbose=False)
torch.set_num_threads(1)
for args in [(64,256,64,False,0,0,0),(64,64,256,True,0,0,0),(64,256,64,False,64,64,256),(64,256,128,False,0,0,0),(64,128,256,True,0,0,0),(32,256,64,False,0,0,0),(16,256,64,False,0,0,0),(128,256,64,False,0,0,0),(64,512,64,False,0,0,0),(64,64,512,True,0,0,0)]:
    print(args, f"{m.bench(*args, 2000):.0f} GF/s")
