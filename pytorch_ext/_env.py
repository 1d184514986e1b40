"""Environment variables read on every call, at a dict lookup's cost.

``os.environ.get(name)`` costs ~1.5 us when ``name`` is unset (os.environ raises and catches a
KeyError inside) and ~0.5 us when set: several such reads per op call were a visible share of
the triton backend's host path (issue 26; bench/triton_host_path.py).  A reader made here looks
the encoded key up in os.environ's own dict (``_data``, CPython's os._Environ internals, which
``os.environ[...] = ...``, ``del`` and pytest's monkeypatch all update) and decodes the value:
~0.1 us, and always the live value.  Without those internals: plain os.environ.get.
"""
from __future__ import annotations

import os
from typing import Callable

_DATA = getattr(os.environ, "_data", None)
_INTERNALS = isinstance(_DATA, dict) and hasattr(os.environ, "encodekey") and hasattr(os.environ, "decodevalue")


def env_reader(name: str) -> Callable[[], str | None]:
    """A function returning ``os.environ.get(name)`` (None when unset), read live each call."""
    if not _INTERNALS:
        return lambda: os.environ.get(name)
    key, data, decode = os.environ.encodekey(name), _DATA, os.environ.decodevalue

    def read() -> str | None:
        raw = data.get(key)
        return None if raw is None else decode(raw)

    read.__name__ = f"read_{name}"
    return read
