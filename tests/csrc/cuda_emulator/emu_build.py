"""Building and loading an emulator library for a kernel file's device code, in the background.

Imported by the emulated tests as ``from cuda_emulator import emu_build`` (tests/csrc is on
sys.path under pytest's default import mode, as for ``attnkit_testing``).

- ``session_builds(root, source, harness, include_name, mutations, mutant_defines, load,
  switched)``: a generator for a session fixture (``yield from``): cuts the device code out of
  `source` (extract.py, with the project headers it includes), starts g++ on `harness` for it
  ("full"), for one copy per deliberate bug in `mutations` and for one copy holding every bug of
  `switched` ("switched": each off until ``configure(mutant=k)``), the copies built with
  `mutant_defines`, all at once, yields them, and at teardown kills what is still running.
- ``session_fixtures(directory_name, ...)``: a test module's two session fixtures over it,
  ``builds`` (session_builds in a fresh temporary directory) and ``emulator`` (the full build,
  loaded): ``builds, emulator = emu_build.session_fixtures(...)``.
- ``Build(directory, harness, include_name, device_code, defines, load)``: one g++ run; it writes
  the device code to ``directory / include_name`` (the file `harness` #includes), and
  ``emulator()`` waits and returns ``load(path of the .so)``, failing the calling test with
  g++'s log if the build failed.  ``NoBuild(reason)`` stands in for a build that could not start.
- ``Library``: the C API every harness has (``emu_configure``, ``emu_last_error``, the buffer
  registry of the checked pointers); a test's emulator class derives from it and declares its own
  entry points, and calls them inside ``with self.buffers(name=tensor, ...)``: every tensor the
  kernels get a pointer to is registered as an allocation, which every access is checked against.
"""
import contextlib
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


def switched_ids(switched):
    """{name: k}: the `mutant` value of ``Library.configure`` that turns each switched bug on."""
    return {name: k for k, name in enumerate(switched, 1)}


def session_builds(root: Path, source: Path, harness: Path, include_name: str, mutations, mutant_defines, load,
                   switched=None):
    """Yields {"full": Build, <mutation name>: Build or NoBuild, "switched": Build or NoBuild
    (when `switched` is given)}, every g++ run started; stops them when resumed (fixture
    teardown).

    mutations: {name: (old, new)}, each applied to a copy of the extracted device code as the
    kernel file spells it (before extract.instrument_pointers turns its pointers into checked
    ones); a target that is not exactly once in it gives a NoBuild saying so (the test that wants
    it fails).

    switched: {name: (old, new)} likewise, but all applied to one copy, with ``{on}`` in `new`
    standing for ``emu::mutant(k)`` -- 1 while ``configure(mutant=k)`` is in force, else 0 (k:
    switched_ids) -- so that one build holds them all: e.g. ``"i < n"`` -> ``"i < n + {on}"``.
    A bug that is off must leave the code as it was."""
    name = source.resolve().relative_to(REPO).as_posix() if source.resolve().is_relative_to(REPO) else str(source)
    if shutil.which(CXX) is None:
        pytest.fail(f"{CXX} not found: the emulated tests compile {name}'s device code for the CPU with {CXX} "
                    "(C++20); install g++ >= 12.", pytrace=False)
    try:
        plain = extract.extract_device_code(source.read_text(), extract.included_headers(source), name=name,
                                            checked_pointers=False)
        device_code = extract.instrument_pointers(plain, name)
    except extract.ExtractError as e:
        pytest.fail(str(e), pytrace=False)
    started = {"full": Build(root / "full", harness, include_name, device_code, load=load)}
    for mutation, (old, new) in mutations.items():
        if plain.count(old) != 1:
            reason = f"mutation {mutation}: its target is no longer (once) in {name}'s device code; update MUTATIONS"
            started[mutation] = NoBuild(reason)
            continue
        try:
            mutant = extract.instrument_pointers(plain.replace(old, new), name)
        except extract.ExtractError as e:
            started[mutation] = NoBuild(f"mutation {mutation}: {e}")
            continue
        started[mutation] = Build(root / mutation, harness, include_name, mutant, mutant_defines, load=load)
    if switched:
        code, reason = plain, None
        for mutation, k in switched_ids(switched).items():
            old, new = switched[mutation]
            if code.count(old) != 1:
                reason = f"switched mutation {mutation}: its target is no longer (once) in {name}'s device code"
                break
            code = code.replace(old, new.replace("{on}", f"emu::mutant({k})"))
        if reason is None:
            try:
                code = extract.instrument_pointers(code, name)
            except extract.ExtractError as e:
                reason = f"switched mutations: {e}"
        started["switched"] = NoBuild(reason) if reason else Build(root / "switched", harness, include_name, code,
                                                                   mutant_defines, load=load)
    try:
        yield started
    finally:
        for build in started.values():
            build.stop()


def session_fixtures(directory_name: str, source: Path, harness: Path, include_name: str, mutations, mutant_defines,
                     load, switched=None):
    """(builds, emulator): the session fixtures of an emulated test module; the arguments as for
    session_builds, the builds going to a fresh temporary directory named after `directory_name`."""

    @pytest.fixture(scope="session")
    def builds(tmp_path_factory):
        """Starts every build at once (the full emulator and the mutants), in the background."""
        yield from session_builds(tmp_path_factory.mktemp(directory_name), source, harness, include_name, mutations,
                                  mutant_defines, load, switched)

    @pytest.fixture(scope="session")
    def emulator(builds):
        return builds["full"].emulator()

    return builds, emulator


class EmulatorError(RuntimeError):
    """A launch the emulator stopped (bad ldmatrix address, divergent collective, deadlock, ...)."""


def span(t):
    """(address, bytes) of the memory a tensor's elements cover (non-negative strides): the
    allocation its kernel pointer may access, no byte more (a view's neighbours in the same
    storage are out of bounds)."""
    if any(st < 0 for st in t.stride()):
        raise ValueError("negative strides")
    elements = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.data_ptr(), elements * t.element_size()


class Library:
    """An emulator library: ``self.lib`` (ctypes) with the common entry points declared.

    ``accesses``: {buffer name: checked accesses} of the last ``buffers`` block (the buffers the
    harness registered itself, its scratch, included); ``access_log``: those of every block, in
    order (a test may clear it)."""

    def __init__(self, path: Path):
        self.lib = ctypes.CDLL(str(path))
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_configure.argtypes = [ctypes.c_uint64, ctypes.c_int]
        self.lib.emu_set_mutant.argtypes = [ctypes.c_int]
        self.lib.emu_register_buffer.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self.lib.emu_buffer_name.argtypes = self.lib.emu_buffer_accesses.argtypes = [ctypes.c_int]
        self.lib.emu_buffer_name.restype = ctypes.c_char_p
        self.lib.emu_buffer_accesses.restype = ctypes.c_longlong
        self.accesses = {}
        self.access_log = []

    @contextlib.contextmanager
    def buffers(self, **tensors):
        """Registers each tensor (None or empty: skipped) as an allocation named after its keyword,
        for the calls in the block: the checked pointers the kernels get from the harness find
        their allocation by address, and every access must stay inside it.  A pointer to memory
        that is not registered fails at its first access."""
        self.lib.emu_clear_buffers()
        for name, t in tensors.items():
            if t is not None and t.numel() > 0:
                address, nbytes = span(t)
                self.lib.emu_register_buffer(address, nbytes, name.encode())
        try:
            yield
        finally:
            self.accesses = {}
            for i in range(self.lib.emu_buffer_count()):
                name = self.lib.emu_buffer_name(i).decode()
                self.accesses[name] = self.accesses.get(name, 0) + self.lib.emu_buffer_accesses(i)
            self.access_log.append(self.accesses)
            self.lib.emu_clear_buffers()

    def configure(self, seed=1, fault=0, mutant=0):
        """seed: the warp schedule's; fault 1: mma reads A's registers 1 and 2 swapped, fault 2:
        ldmatrix ignores .trans (0: none); mutant: the switched bug to turn on (a "switched"
        build's; 0: none)."""
        self.lib.emu_configure(seed, fault)
        self.lib.emu_set_mutant(mutant)

    def check(self, rc, what):
        if rc != 0:
            raise EmulatorError(f"{what}: {self.lib.emu_last_error().decode()}")
