"""The fused Hopfield update (tol=0.0 forces it) against its steps as softmax_attention calls on the
decoding kernel, float16 / bfloat16, S in {1, 16}, N from 256 to 65536: the table behind
attnkit/ops/hopfield.py's _steps_by_softmax (session 18, RESULTS.md; session 20's table of more
states is in the comment above that function).  Not a test.

    python bench/cpu_micro/hopfield_one_state.py
"""
import torch, time, attnkit, sys
torch.manual_seed(0)
def tmin(f, secs=1.0):
    f(); ts=[]; t_end=time.perf_counter()+secs
    while time.perf_counter()<t_end:
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return min(ts)
for dt in (torch.bfloat16, torch.float16):
  for S in (1, 16):
    for N in (256, 1024, 4096, 65536):
      for steps in (1, 3):
        st=torch.randn(1,4,S,64,dtype=dt); X=torch.randn(1,4,N,64,dtype=dt)
        def dec():
            xi=st
            for _ in range(steps): xi=attnkit.softmax_attention(xi,X,X,scale=0.125,backend="cpu")
            return xi
        fu=lambda: attnkit.hopfield_update(st,X,beta=0.125,steps=steps,tol=0.0)
        a=tmin(fu); b=tmin(dec)
        print(f"{str(dt)[6:]:8s} S={S:2d} N={N:6d} steps={steps} fused {a*1e3:8.3f} ms  decode {b*1e3:8.3f} ms  fused/decode {a/b:5.2f}")
