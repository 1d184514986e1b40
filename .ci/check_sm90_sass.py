"""Checks the sm_90a machine code of the Hopper kernels without a GPU (issue 27).

Usage: python .ci/check_sm90_sass.py OBJECT PTXAS_LOG

OBJECT is csrc/cuda/softmax_sm90.cu compiled with `-gencode arch=compute_90a,code=sm_90a
-Xptxas -v` (.ci/compile_cuda.sh does it), PTXAS_LOG that compile's output.  For every kernel
whose name contains `_sm90_kernel`:
  - ptxas reports no stack frame and no spill stores or loads (registers indexed at run time or
    too many live values would put them in local memory, much slower);
  - its SASS (cuobjdump -sass) has HGMMA (wgmma: the Hopper tensor-core path, not HMMA),
    UTMALDG (TMA tile loads) and USETMAXREG (the producer / consumer register split), and no
    LDL / STL (local memory);
  - ptxas did not warn that it serialized the wgmma instructions or ignored setmaxnreg.
cuobjdump comes from the CUDA toolkit next to nvcc, or from Triton's bundled copy.  Exits 0 with
a message when neither exists (the compile check itself has already run), 1 on a failed check.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

KERNEL = "_sm90_kernel"
REQUIRED = ("HGMMA", "UTMALDG", "USETMAXREG")
FORBIDDEN = ("LDL", "STL")


def find_cuobjdump() -> str | None:
    nvcc = shutil.which("nvcc")
    candidates = [shutil.which("cuobjdump")]
    if nvcc:
        real = Path(nvcc).resolve()
        candidates.append(str(real.parent / "cuobjdump"))
        # /usr/local/bin/nvcc may be a wrapper: try the toolkit it names.
        try:
            text = Path(nvcc).read_text(errors="ignore")
            for m in re.finditer(r"(/[\w./-]*cuda[\w.-]*)/bin/nvcc", text):
                candidates.append(m.group(1) + "/bin/cuobjdump")
        except OSError:
            pass
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "cuobjdump"))
    try:
        import triton  # noqa: PLC0415 - optional

        candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"))
    except Exception:  # noqa: BLE001 - Triton absent or broken: other candidates
        pass
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def ptxas_report(log: str) -> dict[str, tuple[int, int, int]]:
    """kernel -> (stack frame bytes, spill store bytes, spill load bytes) from `ptxas -v`."""
    out: dict[str, tuple[int, int, int]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)' for 'sm_90a'", line)
        if m:
            current = m.group(1)
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            out[current] = tuple(int(x) for x in m.groups())
            current = None
    return out


def sass_functions(sass: str, arch: str = "sm_90a") -> dict[str, str]:
    """Function name -> SASS, from the ELF of `arch` only (the object also holds sm_80 code, whose
    Hopper kernels are stubs with the same names)."""
    funcs: dict[str, str] = {}
    name = None
    in_arch = False
    for line in sass.splitlines():
        m = re.match(r"\s*arch = (\S+)", line)
        if m:
            in_arch, name = m.group(1) == arch, None
            continue
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1) if in_arch else None
            if name is not None:
                funcs[name] = ""
        elif name is not None:
            funcs[name] += line + "\n"
    return funcs


def main() -> int:
    obj, log_path = sys.argv[1], sys.argv[2]
    log = Path(log_path).read_text(errors="ignore")
    failures = []
    for pattern in ("serialized", "C7508", "C7510", "C7515"):
        if pattern in log:
            failures.append(f"ptxas warned ({pattern}): " + next(l for l in log.splitlines() if pattern in l))
    report = {k: v for k, v in ptxas_report(log).items() if KERNEL in k}
    if not report:
        failures.append(f"no sm_90a kernel named *{KERNEL}* in the ptxas report")
    for kernel, (stack, stores, loads) in report.items():
        if stack or stores or loads:
            failures.append(f"{kernel}: {stack} bytes stack frame, {stores} / {loads} bytes spill stores / loads")
    tool = find_cuobjdump()
    if tool is None:
        print("check_sm90_sass: no cuobjdump found; ptxas report checked only")
    else:
        sass = subprocess.run([tool, "-sass", obj], capture_output=True, text=True, check=True).stdout
        funcs = {k: v for k, v in sass_functions(sass).items() if KERNEL in k}
        if not funcs:
            failures.append(f"no *{KERNEL}* function in the SASS of {obj}")
        for kernel, body in funcs.items():
            counts = {op: len(re.findall(r"\b" + op + r"\b", body)) for op in REQUIRED + FORBIDDEN}
            missing = [op for op in REQUIRED if counts[op] == 0]
            present = [op for op in FORBIDDEN if counts[op] > 0]
            if missing or present:
                failures.append(f"{kernel}: missing {missing}, local memory {present}")
            else:
                print(f"check_sm90_sass: ok {kernel[-60:]}: " + ", ".join(f"{op} x{counts[op]}" for op in REQUIRED))
    for f in failures:
        print("check_sm90_sass: FAIL " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
