"""Building and loading an emulator library for a kernel file's device code, in the background.

Imported by the emulated tests as ``from cuda_emulator import emu_build`` (tests/csrc is on
sys.path under pytest's default import mode, as for ``attnkit_testing``).

- ``session_builds(root, source, harness, include_name, mutations, mutant_defines, load)``: a
  generator for a session fixture (``yield from``): cuts the device code out of `source`
  (extract.py, with the project headers it includes), starts g++ on `harness` for it ("full")
  and for one copy per deliberate bug in `mutations` (built with `mutant_defines`), all at once,
  yields them, and at teardown kills what is still running.
- ``session_fixtures(directory_name, ...)``: a test module's two session fixtures over it,
  ``builds`` (session_builds in a fresh temporary directory) and ``emulator`` (the full build,
  loaded): ``builds, emulator = emu_build.session_fixtures(...)``.
- ``Build(directory, harness, include_name, device_code, defines, load)``: one g++ run; it writes
  the device code to ``directory / include_name`` (the file `harness` #includes), and
  ``emulator()`` waits and returns ``load(path of the .so)``, failing the calling test with
  g++'s log if the build failed.  ``NoBuild(reason)`` stands in for a build that could not start.
- ``Library``: the C API every harness has (``emu_configure``, ``emu_last_error``); a test's
  emulator class derives from it and declares its own entry points.
"""
import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from . import extract

CXX = "g++"
CXXFLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC")
REPO = Path(__file__).resolve().parents[3]


class Build:
    def __init__(self, directory: Path, harness: Path, include_name: str, device_code: str, defines=(), load=None):
        directory.mkdir(parents=True)
        (directory / include_name).write_text(device_code)
        self.lib = directory / "libemu.so"
        cmd = [CXX, *CXXFLAGS, *(f"-D{d}" for d in defines), f"-I{directory}", str(harness), "-o", str(self.lib)]
        self.cmd = " ".join(cmd)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log = None
        self._load = load
        self._emulator = None

    def emulator(self):
        """Waits for the build; the loaded emulator (fails the test if g++ failed)."""
        if self.log is None:
            self.log, _ = self.proc.communicate()
        if self.proc.returncode != 0:
            pytest.fail(f"building the CUDA emulator failed:\n$ {self.cmd}\n{self.log[-6000:]}", pytrace=False)
        if self._emulator is None:
            self._emulator = self._load(self.lib)
        return self._emulator

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class NoBuild:
    def __init__(self, reason):
        self.reason = reason

    def emulator(self):
        pytest.fail(self.reason, pytrace=False)

    def stop(self):
        pass


def session_builds(root: Path, source: Path, harness: Path, include_name: str, mutations, mutant_defines, load):
    """Yields {"full": Build, <mutation name>: Build or NoBuild}, every g++ run started; stops
    them when resumed (fixture teardown).

    mutations: {name: (old, new)}, each applied to a copy of the extracted device code; a target
    that is not exactly once in it gives a NoBuild saying so (the test that wants it fails)."""
    name = source.resolve().relative_to(REPO).as_posix() if source.resolve().is_relative_to(REPO) else str(source)
    if shutil.which(CXX) is None:
        pytest.fail(f"{CXX} not found: the emulated tests compile {name}'s device code for the CPU with {CXX} "
                    "(C++20); install g++ >= 12.", pytrace=False)
    try:
        device_code = extract.extract_device_code(source.read_text(), extract.included_headers(source), name=name)
    except extract.ExtractError as e:
        pytest.fail(str(e), pytrace=False)
    started = {"full": Build(root / "full", harness, include_name, device_code, load=load)}
    for mutation, (old, new) in mutations.items():
        if device_code.count(old) != 1:
            reason = f"mutation {mutation}: its target is no longer (once) in {name}'s device code; update MUTATIONS"
            started[mutation] = NoBuild(reason)
        else:
            started[mutation] = Build(root / mutation, harness, include_name, device_code.replace(old, new),
                                      mutant_defines, load=load)
    try:
        yield started
    finally:
        for build in started.values():
            build.stop()


def session_fixtures(directory_name: str, source: Path, harness: Path, include_name: str, mutations, mutant_defines,
                     load):
    """(builds, emulator): the session fixtures of an emulated test module; the arguments as for
    session_builds, the builds going to a fresh temporary directory named after `directory_name`."""

    @pytest.fixture(scope="session")
    def builds(tmp_path_factory):
        """Starts every build at once (the full emulator and the mutants), in the background."""
        yield from session_builds(tmp_path_factory.mktemp(directory_name), source, harness, include_name, mutations,
                                  mutant_defines, load)

    @pytest.fixture(scope="session")
    def emulator(builds):
        return builds["full"].emulator()

    return builds, emulator


class EmulatorError(RuntimeError):
    """A launch the emulator stopped (bad ldmatrix address, divergent collective, deadlock, ...)."""


class Library:
    """An emulator library: ``self.lib`` (ctypes) with the common entry points declared."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_configure.argtypes = [ctypes.c_uint64, ctypes.c_int]

    def configure(self, seed=1, fault=0):
        """seed: the warp schedule's; fault 1: mma reads A's registers 1 and 2 swapped, fault 2:
        ldmatrix ignores .trans (0: none)."""
        self.lib.emu_configure(seed, fault)

    def check(self, rc, what):
        if rc != 0:
            raise EmulatorError(f"{what}: {self.lib.emu_last_error().decode()}")
