"""The package a non-editable install builds holds every module and data file the source tree has:
pyproject lists packages by hand (kernels/ and integrations/ are mapped from the repo's top), so a
new folder is easy to forget, and an editable install would never notice."""
from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_python_package_is_listed():
    st = _project()
    mapped = st["package-dir"]
    listed = set(st["packages"])
    found = set()
    for name, folder in mapped.items():
        base = ROOT / folder
        for init in base.rglob("__init__.py"):
            rel = init.parent.relative_to(base)
            found.add(".".join([name, *rel.parts]) if rel.parts else name)
    missing = sorted(found - listed)
    assert not missing, f"packages missing from pyproject [tool.setuptools] packages: {missing}"


def test_kernel_sources_ship_as_package_data():
    st = _project()
    patterns = st["package-data"].get("asyncengine.kernels.cpu", [])
    assert "*.c" in patterns
    assert list((ROOT / "kernels" / "cpu").glob("*.c")), "the CPU kernels' C sources"
