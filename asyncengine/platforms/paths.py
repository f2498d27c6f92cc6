"""Where the engine keeps what it downloads, builds or measures (models, weight caches, the dtype
probe's answer): one directory, chosen by the environment."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$ASYNCENGINE_CACHE``, else ``$XDG_CACHE_HOME/asyncengine``, else ``~/.cache/asyncengine``
    (not created here)."""
    if explicit := os.environ.get("ASYNCENGINE_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "asyncengine"
    return Path.home() / ".cache" / "asyncengine"
