"""The suite never writes into the user's cache folders (tests/conftest.py points them at one
session folder): a run once left 538 MB in ~/.cache/asyncengine/weights."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from asyncengine.models import default_model
from asyncengine.models.weight_cache import cache_file

# tests/conftest.py's session folder (a plain `from conftest import` is ambiguous: tests/ has several)
TEST_CACHE_ROOT = Path(os.environ["ASYNCENGINE_CACHE"]).parent


def test_every_cache_points_into_the_session_folder():
    root = TEST_CACHE_ROOT.resolve()
    assert "asyncengine-tests-" in root.name and not root.is_relative_to((Path.home() / ".cache").resolve())
    assert default_model.cache_dir().resolve().is_relative_to(root)
    assert cache_file(__file__, "float32", object).resolve().is_relative_to(root)  # the weight cache
    for var in ("HF_HOME", "TRITON_CACHE_DIR"):
        assert Path(os.environ[var]).resolve().is_relative_to(root), var
    # subprocesses (the CLI, servers, engine cores) inherit it
    out = subprocess.run([sys.executable, "-c", "from asyncengine.models.default_model import cache_dir; "
                          "print(cache_dir())"], capture_output=True, text=True, check=True).stdout.strip()
    assert Path(out).resolve().is_relative_to(root)


def test_the_default_model_is_read_not_copied():
    """Linked from the user's cache when a checked copy is there; else fetched into the session folder."""
    ours = default_model.default_model_path()
    if ours.is_symlink():
        assert ours.resolve().is_file() and default_model._is_verified(ours)
    else:
        assert not ours.exists() or ours.resolve().is_relative_to(TEST_CACHE_ROOT.resolve())
