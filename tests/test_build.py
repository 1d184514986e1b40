"""The package builds and imports without a C++ compiler (attnkit._C then reported missing)."""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_install_without_a_compiler_still_imports(tmp_path):
    src = tmp_path / "src"
    # A copy of the sources without the developer's built .so files.
    skip = shutil.ignore_patterns("*.so", "__pycache__", "build", "*.egg-info", "out")
    for path in ("pytorch_ext", "kernels", "bench", "csrc"):
        shutil.copytree(ROOT / path, src / path, ignore=skip)
    for path in ("setup.py", "README.md"):
        shutil.copy(ROOT / path, src / path)
    env = dict(os.environ, CC="/bin/false", CXX="/bin/false")
    env.pop("ATTNKIT_REQUIRE_NATIVE", None)
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", str(src),
         "-w", str(wheels)],
        check=True, env=env, cwd=tmp_path,
    )
    (wheel,) = wheels.glob("attnkit-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True, cwd=tmp_path,
    )
    assert not list(target.rglob("_C*.so"))
    probe = (
        # The developer's editable install puts a finder on sys.meta_path that would resolve
        # attnkit._C from the source tree; drop it so only the wheel under test is seen.
        "import sys;"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()];"
        "import attnkit, torch;"
        "assert attnkit.__file__.startswith(sys.argv[1]), attnkit.__file__;"
        "s = attnkit.backends()['hopfield_energy']['cpu'];"
        "assert not s.usable and 'attnkit._C' in s.reason, s;"
        "q = torch.randn(1, 1, 3, 4);"
        "print(attnkit.softmax_attention(q, q, q).shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(target)], check=True, capture_output=True, text=True,
        env=dict(os.environ, PYTHONPATH=str(target)), cwd=tmp_path,
    )
    assert "torch.Size([1, 1, 3, 4])" in out.stdout


def _cpp_sources():
    # csrc/ops.cpp and csrc/checks/*.cpp get the same C++17 check, with their CUDA branch compiled
    # in, from tests/csrc/test_checks.py::test_cuda_build_of_the_gxx_sources_compiles (each file
    # costs ~10 s of parsing torch's headers on the CI machine: once is enough).
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("csrc/cpu/*.cpp"))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_cpp_sources_are_cpp17():
    """torch < 2.13 builds extensions as C++17 (2.13 as C++20): every C++ source must compile as
    C++17 with no C++20 extension used (an H200 image with torch 2.11 failed on std::bit_cast).
    torch's own headers come in as system headers, so their C++20-isms do not count here; the
    .cu files get the same check from .ci/compile_cuda.sh (sm_90a under -std=c++17)."""
    from torch.utils.cpp_extension import include_paths
    import sysconfig

    includes = []
    for path in [*include_paths(), sysconfig.get_paths()["include"]]:
        includes += ["-isystem", path]
    procs = {}
    for src in _cpp_sources():
        cmd = ["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", "-march=native",
               "-Werror=c++20-extensions", "-Werror=c++20-compat", "-DTORCH_EXTENSION_NAME=_C",
               *includes, src]
        procs[src] = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True)
        if len(procs) % 2 == 0:  # two at a time: the CI machine has 2 cores
            for p in procs.values():
                p.wait()
    failures = {src: p.communicate()[0] for src, p in procs.items() if p.wait() != 0}
    assert not failures, "\n".join(f"{src} is not C++17:\n{log[-3000:]}" for src, log in failures.items())
