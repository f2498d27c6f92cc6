"""The front end imports no torch, as a property of its folder: every module under
``asyncengine/engine/`` imports in a fresh interpreter where any import of torch raises. (A front
end whose engine core runs in another process then never loads torch; the in-process core loads it
when it is built, inside ``engine_core/``.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHECK = r"""
import importlib, sys
from pathlib import Path

class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked: " + name)

sys.meta_path.insert(0, BlockTorch())
folder = Path(sys.argv[1])
names = sorted("asyncengine.engine." + p.stem for p in folder.glob("*.py") if p.stem != "__init__")
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed.append(f"{name}: {e}")
try:  # the block itself works: the in-process engine core needs torch
    importlib.import_module("asyncengine.engine_core.core")
    failed.append("the block let asyncengine.engine_core.core import torch")
except ImportError:
    pass
print("CHECKED", len(names))
print("FAILED", failed)
print("TORCH", [m for m in sys.modules if m == "torch" or m.startswith("torch.")])
"""


def test_every_front_end_module_imports_without_torch():
    folder = ROOT / "asyncengine" / "engine"
    out = subprocess.run([sys.executable, "-c", CHECK, str(folder)], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert int(lines["CHECKED"]) == len([p for p in folder.glob("*.py") if p.stem != "__init__"]) > 10
    assert lines["FAILED"] == "[]", lines["FAILED"]
    assert lines["TORCH"] == "[]"
