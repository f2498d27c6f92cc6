"""benchmarks/gpu_check.py without a GPU: it refuses clearly, and --dry-run runs every section
(tiny, on CPU, kernels in triton's interpreter) to a table with no failed row."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def run(*args, timeout=300):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU even on a GPU machine
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_refuses_without_cuda():
    r = run()
    assert r.returncode == 2
    assert "needs CUDA" in r.stderr


def test_dry_run_table(tmp_path):
    out = tmp_path / "rows.json"
    r = run("--dry-run", "--json", str(out), "--skip", "prefill_attn,cache_write")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())
    sections = {x["section"] for x in rows}
    assert {"env", "copy_bw", "decode_attn", "rms_norm", "offline", "smollm2", "total"} <= sections
    assert all(x["ok"] for x in rows)
    assert any(x["metric"] == "graphs == eager tokens" and x["value"] is True for x in rows)
    assert "section" in r.stdout.splitlines()[0]  # the table


def test_refuses_without_the_installed_package(tmp_path):
    """Benchmarks run against the installed package: with msgspec unimportable (the GPU machine we
    have seen lacked it), the script says how to install from carried wheels and stops; there is no
    stand-in under a real library's name."""
    block = ("import sys, runpy\n"
             "class Block:\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'msgspec' or name.startswith('msgspec.'):\n"
             "            raise ImportError('blocked for the test')\n"
             "sys.meta_path.insert(0, Block())\n"
             f"sys.argv = ['gpu_check.py', '--dry-run', '--json', {str(tmp_path / 'rows.json')!r}]\n"
             f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert r.returncode == 1
    assert "installed package" in r.stderr and "--find-links" in r.stderr
    assert not (tmp_path / "rows.json").exists()
