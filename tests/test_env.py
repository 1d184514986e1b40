"""attnkit._env: environment variables read live, at a dict lookup's cost."""
import os

from attnkit._env import env_reader


def test_reader_follows_every_change(monkeypatch):
    name = "ATTNKIT_TEST_ENV_READER"
    monkeypatch.delenv(name, raising=False)
    read = env_reader(name)
    assert read() is None
    monkeypatch.setenv(name, "first")
    assert read() == "first" == os.environ.get(name)
    os.environ[name] = "ünïcode"
    assert read() == "ünïcode"
    monkeypatch.setenv(name, "")
    assert read() == ""
    monkeypatch.delenv(name)
    assert read() is None


def test_readers_are_independent(monkeypatch):
    monkeypatch.setenv("ATTNKIT_TEST_ENV_A", "a")
    monkeypatch.delenv("ATTNKIT_TEST_ENV_B", raising=False)
    assert (env_reader("ATTNKIT_TEST_ENV_A")(), env_reader("ATTNKIT_TEST_ENV_B")()) == ("a", None)
