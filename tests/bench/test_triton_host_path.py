"""bench/triton_host_path.py runs (in a subprocess: it stubs kernels/softmax.py's launches)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "triton_host_path.py"


def test_prints_three_positive_timings():
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, str(SCRIPT), "--reps", "3", "--rounds", "1"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    times = re.findall(r"^\s+(forward[^\n]*?)\s+([0-9.]+) us$", done.stdout, re.M)
    assert [name.split()[0] for name, _ in times] == ["forward,", "forward,", "forward"], done.stdout
    assert all(float(t) > 0 for _, t in times)


GPU_SCRIPT = SCRIPT.with_name("triton_host_path_gpu.py")


def test_gpu_probe_says_it_needs_cuda_on_a_cpu_machine():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: test_gpu_probe_prints_every_row runs it")
    done = subprocess.run([sys.executable, str(GPU_SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stdout, done.stdout + done.stderr[-2000:]


@pytest.mark.gpu
def test_gpu_probe_prints_every_row():
    done = subprocess.run([sys.executable, str(GPU_SCRIPT), "--reps", "20", "--rounds", "1", "--no-large"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    walls = re.findall(r"^\s+(.+?)\s+([0-9.]+) us\s+([0-9.]+) us", done.stdout, re.M)
    assert len(walls) == 7 and all(float(w) > 0 for _, w, _ in walls), done.stdout
