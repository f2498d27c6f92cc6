#!/usr/bin/env python
"""Start-up A/B: two (or more) variants of the CLI, alternated round by round in one sitting, so
that a noisy machine's slow minutes fall on both alike.

    # two checkouts (before/after a change): @PATH runs `python -m asyncengine` from that checkout
    python benchmarks/startup_ab.py --rounds 5 --variant before=@/path/to/old --variant after=@. --serve
    # two settings of one checkout: anything else is extra CLI flags
    python benchmarks/startup_ab.py --rounds 8 --variant inproc=--no-engine-core-process \\
        --variant process=--engine-core-process

Per round and variant (the variants' order flips every round): `--help`'s wall time; the chat's
first answer byte from launch, its CPU seconds and peak RSS (all its processes); with --decode N,
the decode speed the chat reports for an N-token answer; with --serve, the idle server's ready time
and RSS, in-process and with --engine-core-process. --only picks some of help, chat, decode, serve. --peer times another
engine's one-question command (launch to exit) in the same rounds.
Prints medians, bests and every run (benchmarks/startup.py's measurements).
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import startup  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="NAME=@CHECKOUT|FLAGS")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--serve", action="store_true", help="also time the idle server (both core modes)")
    ap.add_argument("--decode", type=int, default=0, metavar="N", help="also the decode speed of an N-token answer")
    ap.add_argument("--only", default=None, help="comma-separated subset of help,chat,decode,serve")
    ap.add_argument("--peer", default=None, metavar="CMD",
                    help="a peer's one-question command (e.g. llama-cli ... -st -n 16), timed launch to exit "
                         "each round beside the variants' chat (total_s)")
    args = ap.parse_args()
    variants = {}
    for v in args.variant:
        name, _, spec = v.partition("=")
        if spec.startswith("@"):
            variants[name] = (os.path.abspath(spec[1:]), [])
        else:
            variants[name] = (None, spec.split())
    os.chdir(tempfile.gettempdir())  # `python -m` puts the working directory first on sys.path
    base_env = dict(os.environ)

    def use(checkout):
        os.environ.clear()
        os.environ.update(base_env)
        if checkout:
            os.environ["PYTHONPATH"] = checkout
            os.environ["STARTUP_CLI"] = f"{sys.executable} -m asyncengine"

    what = set((args.only or "help,chat,decode,serve").split(","))
    if not args.decode:
        what.discard("decode")
    if not args.serve and args.only is None:
        what.discard("serve")
    res: dict[str, list[float]] = {}
    for checkout, flags in variants.values():  # warm the page cache and every on-disk cache
        use(checkout)
        startup.run_timed(startup.cli() + ["chat", *flags, "--prompt", startup.PROMPT])
    for rnd in range(args.rounds):
        order = list(variants.items())
        for name, (checkout, flags) in (order if rnd % 2 == 0 else order[::-1]):
            use(checkout)
            if "help" in what:
                res.setdefault(f"{name} help_s", []).append(startup.run_timed(startup.cli() + ["--help"])["wall_s"])
            if "chat" in what:
                r = startup.run_timed(startup.cli() + ["chat", *flags, "--prompt", startup.PROMPT])
                res.setdefault(f"{name} chat_total_s", []).append(r["wall_s"])
                for k in ("first_s", "cpu_s", "rss_mb"):
                    res.setdefault(f"{name} chat_{k}", []).append(r[k])
            if "decode" in what:
                d = startup.run_timed(startup.cli() + ["chat", *flags, "--temperature", "0", "--max-tokens",
                                                       str(args.decode), "--prompt", startup.LONG_PROMPT])
                if (t := startup.reported_tok_s(d["stderr"])) is not None:
                    res.setdefault(f"{name} decode_tok_s", []).append(t)
            if "serve" in what:
                for label, extra in (("serve", []), ("serve_core_process", ["--engine-core-process"])):
                    s = startup.serve_idle(flags + extra)
                    res.setdefault(f"{name} {label}_ready_s", []).append(s["ready_s"])
                    res.setdefault(f"{name} {label}_rss_mb", []).append(s["rss_mb"])
        if args.peer:
            res.setdefault("peer total_s", []).append(startup.run_timed(shlex.split(args.peer))["wall_s"])
    for k, v in sorted(res.items()):
        best = max(v) if k.endswith("tok_s") else min(v)
        print(f"{k:34s} median {statistics.median(v):8.3f}  best {best:8.3f}  {[round(x, 2) for x in v]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
