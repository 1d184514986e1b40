"""One implementation's minimum call time over ~3 s of back-to-back calls, for A/B runs of two
builds on a noisy machine (session 18): run it alternately in fresh processes, each build first on
PYTHONPATH.  Not a test.

    python bench/cpu_micro/min_of_calls.py N D CAUSAL(0|1) DTYPE [THREADS]
"""
import torch, time, sys, attnkit
torch.set_num_threads(int(sys.argv[5]) if len(sys.argv)>5 else 1)
N=int(sys.argv[1]); D=int(sys.argv[2]); causal=sys.argv[3]=='1'; dt=getattr(torch,sys.argv[4])
torch.manual_seed(0)
q,k,v=[torch.randn(1,8,N,D,dtype=dt) for _ in range(3)]
f=lambda: attnkit.softmax_attention(q,k,v,is_causal=causal)
f()
ts=[]
t_end=time.perf_counter()+3
while time.perf_counter()<t_end:
    t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
ts.sort()
print(f"min {ts[0]*1e3:.3f} p10 {ts[len(ts)//10]*1e3:.3f} ms (n={len(ts)})")
