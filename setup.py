"""Build attnkit: the Python package plus the native extension ``attnkit._C``.

``attnkit._C`` is built from ``csrc/``: the C++ (CPU) sources always, the CUDA sources
when torch has CUDA and nvcc is found (``ATTNKIT_BUILD_CUDA=auto|0|1``).  The extension is
*optional*: when it cannot be compiled (no compiler, say) the install still succeeds, the
package imports, and ``attnkit.backends()`` reports the ``cpu`` backend unavailable with the
reason.  Install for development with ``pip install --no-build-isolation -e .`` (torch must be
installed first: the extension is built against it).
"""
import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
PACKAGES = [
    "attnkit",
    "attnkit.kernels",
    "attnkit.ops",
    "attnkit.reference",
    "attnkit.nn",
    "attnkit.theory",
    "attnkit.bench",
    "attnkit.integrations",
]
PACKAGE_DIR = {
    "attnkit": "pytorch_ext",
    "attnkit.kernels": "kernels",
    "attnkit.ops": "pytorch_ext/ops",
    "attnkit.reference": "pytorch_ext/reference",
    "attnkit.nn": "pytorch_ext/nn",
    "attnkit.theory": "pytorch_ext/theory",
    "attnkit.bench": "bench",
    "attnkit.integrations": "pytorch_ext/integrations",
}


def _want_cuda(torch_utils):
    flag = os.environ.get("ATTNKIT_BUILD_CUDA", "auto").strip().lower()
    if flag not in ("auto", "0", "1"):
        raise SystemExit(f"ATTNKIT_BUILD_CUDA must be auto, 0 or 1; got {flag!r}")
    if flag == "0":
        return False
    import torch

    has_torch_cuda = torch.version.cuda is not None
    has_nvcc = torch_utils.CUDA_HOME is not None
    if flag == "1":
        if not (has_torch_cuda and has_nvcc):
            raise SystemExit(
                "ATTNKIT_BUILD_CUDA=1 but "
                + ("torch was built without CUDA" if not has_torch_cuda else "nvcc was not found")
            )
        return True
    return has_torch_cuda and has_nvcc


def _extensions():
    try:
        from torch.utils import cpp_extension
    except ImportError:  # pragma: no cover - torch is a build requirement
        print("attnkit: torch is not importable; building without attnkit._C")
        return [], {}

    # csrc/checks/: every op's input checks, and the CUDA registrations (g++-compiled, issue 10).
    cpp_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp") + glob.glob("csrc/checks/*.cpp"))
    # Shared headers (csrc/cpu/flash_tiles.h, csrc/cuda/mma_sm80.cuh): a change rebuilds.
    headers = sorted(glob.glob("csrc/**/*.h", recursive=True) + glob.glob("csrc/**/*.cuh", recursive=True))
    # The C++ standard is torch's choice: -std=c++17 up to torch 2.12, -std=c++20 from 2.13.  The
    # sources are kept C++17-clean (tests/test_build.py, .ci/compile_cuda.sh check both), so no
    # standard is forced here: objects built under another standard than libtorch's were the
    # first suspect when every failing check in a .cu killed the process (issue 10).
    # -fno-trapping-math: without it GCC will not vectorize a loop whose body divides under a
    # select (-ftrapping-math forbids computing the division for lanes that do not use it):
    # softcap's rational tanh ran scalar, 1.6 ns per score against 0.45-0.7 vectorized (AMD
    # EPYC AVX2, session 12).  Values are unchanged: it only concerns floating-point exception
    # flags, which attnkit never reads (reductions keep their order: no -fassociative-math).
    cxx_flags = ["-O3", "-fopenmp", "-fno-trapping-math"]
    # attnkit is built from source on the machine that runs it, so the CPU kernels are tuned
    # for it (AVX-512 / AVX512-BF16 where present).  ATTNKIT_MARCH=x86-64-v3 (or any -march
    # value, or "none") builds a portable binary instead.
    march = os.environ.get("ATTNKIT_MARCH", "native")
    if march != "none":
        cxx_flags.append(f"-march={march}")
    link_flags = ["-fopenmp"]
    if _want_cuda(cpp_extension):
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
            import torch

            if not torch.cuda.is_available():
                os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
                    "%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())
                )
        # Compute capability 9.0 builds for sm_90a, the target that has wgmma and setmaxnreg
        # (csrc/cuda/softmax_sm90.cu; its code for plain sm_90 is a stub that the host never
        # launches).  sm_90a code runs on 9.0 devices only, which is what "9.0" asked for.
        os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(
            "9.0a" if arch.strip() == "9.0" else arch.strip()
            for arch in os.environ["TORCH_CUDA_ARCH_LIST"].replace(" ", ";").split(";")
            if arch.strip()
        )
        cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
        ext = cpp_extension.CUDAExtension(
            "attnkit._C",
            cpp_sources + cuda_sources,
            extra_compile_args={
                "cxx": cxx_flags + ["-DATTNKIT_WITH_CUDA"],
                "nvcc": ["-O3", "--use_fast_math", "-DATTNKIT_WITH_CUDA"],
            },
            extra_link_args=link_flags,
            depends=headers,
            optional=True,
        )
    else:
        ext = cpp_extension.CppExtension(
            "attnkit._C",
            cpp_sources,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
            depends=headers,
            optional=True,
        )
    class OptionalBuildExtension(cpp_extension.BuildExtension):
        """Builds attnkit._C, or warns and goes on without it (the package still works).

        setuptools' ``optional=True`` alone is not enough: torch's BuildExtension probes the
        compiler before any extension is compiled and raises there when it is missing.
        ``ATTNKIT_REQUIRE_NATIVE=1`` turns a failed build into an error (CI sets it).
        """

        def run(self):
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - any build failure means "no native code"
                if os.environ.get("ATTNKIT_REQUIRE_NATIVE") == "1":
                    raise
                print(
                    f"WARNING: attnkit: building attnkit._C failed ({type(exc).__name__}: {exc}); "
                    "installing without it: the cpu and cuda backends will be reported "
                    "unavailable by attnkit.backends()."
                )

    return [ext], {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="attnkit",
    version="0.1.0",
    description="Fused softmax, linear, sparse and Hopfield attention kernels for PyTorch",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_dir=PACKAGE_DIR,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    # Tested: torch 2.11 (+cu130, the GPU image: C++17, CUDA build) and 2.13 (CPU, CI: C++20).
    install_requires=["torch>=2.11", "numpy"],
    extras_require={
        "triton": ["triton"],
        "bench": ["matplotlib", "tqdm", "pytest-benchmark"],
        "test": ["pytest", "expecttest", "triton"],
        # attnkit.integrations.transformers (attn_implementation="attnkit"); tested with 5.17.0.
        "transformers": ["transformers>=5.17"],
    },
)
