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
