"""Runs doc snippets one after another in this one process (one torch import, and engines that
the snippets share by name, e.g. LangChain's, are loaded once), each as a script of its own
(runpy, ``__name__ == "__main__"``), and writes what each printed and raised as JSON.

    python snippet_runner.py SNIPPETS.json RESULTS.json
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import tempfile
import traceback


def main() -> None:
    todo = json.load(open(sys.argv[1]))
    results = {}
    folder = tempfile.mkdtemp(prefix="asyncengine-snippets-")
    for i, item in enumerate(todo):
        path = os.path.join(folder, f"snippet_{i}.py")
        with open(path, "w") as f:
            f.write(item["code"])
        out, err = io.StringIO(), io.StringIO()
        error = None
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(path, run_name="__main__")
            except BaseException:  # noqa: BLE001 - reported, not raised: the next snippet runs
                error = traceback.format_exc()
        results[item["where"]] = {"stdout": out.getvalue(), "stderr": err.getvalue()[-4000:], "error": error}
        with open(sys.argv[2], "w") as f:  # after each one: a crash still leaves the earlier results
            json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # engines the snippets left running (their threads) need no teardown


if __name__ == "__main__":
    main()
