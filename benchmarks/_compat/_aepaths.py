"""Import hook for benchmarks/gpu_check.py on a machine where asyncengine is not installed: makes
``asyncengine.kernels`` (the top-level kernels/ folder, mapped by pyproject's package-dir) and
``asyncengine.integrations`` importable from the repository. Also a pytest plugin (``-p _aepaths``)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
import asyncengine  # noqa: E402

if not (Path(asyncengine.__file__).parent / "kernels").exists() and str(REPO) not in asyncengine.__path__:
    asyncengine.__path__.append(str(REPO))  # asyncengine.kernels -> REPO/kernels
