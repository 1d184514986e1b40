"""Building an emulator library for a kernel file's device code, in the background.

``Build(directory, harness, include_name, device_code, defines, load)`` writes the extracted
device code to ``directory / include_name``, starts ``g++`` on ``harness`` (a harness.cpp-based
file that #includes it) and, on ``emulator()``, waits and returns ``load(path of the .so)``
(failing the calling test with g++'s log if the build failed).  ``NoBuild(reason)`` stands in
for a build that could not start (it fails the test that asks for it).  Used by
tests/csrc/test_linear_cuda_emulated.py; the softmax and sparse tests carry their own copies.
"""
import subprocess
from pathlib import Path

import pytest

CXX = "g++"
CXXFLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-shared", "-fPIC")


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
