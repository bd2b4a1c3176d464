"""``python -m bench {build,load,scale,ddp,all,report} [--quick] ...``"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from bench.harness import DEFAULT_WORK, REPO, Config, log, save_section

SECTIONS = ("build", "load", "scale", "ddp")


def compile_code_under_test() -> None:
    """Byte-compile ``shardprep`` and ``loader`` as ``pip install`` does for the peers.

    The peers are installed packages whose ``.pyc`` files were written at install time;
    this checkout may never have written ours (``PYTHONDONTWRITEBYTECODE=1``, set on the
    benchmark machine, or a fresh clone). Without them, every fresh measured process
    compiles the modules it imports lazily during the timed epoch (about 20 ms here).
    """
    import compileall

    for package in ("shardprep", "loader"):
        if not compileall.compile_dir(str(REPO / package), quiet=1):
            raise SystemExit(f"bench: {package} does not compile")


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the chosen sections, write the report."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("command", choices=(*SECTIONS, "all", "report"))
    p.add_argument("--quick", action="store_true", help="small sizes, 1 run: a few minutes")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help=f"data, shards and results (default {DEFAULT_WORK}; never the repo)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured runs per figure (median); default 3, quick 1",
    )
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 1, quick 0)")
    p.add_argument(
        "--datasets",
        default="small,images,text",
        help="comma list for build/load (default: small,images,text)",
    )
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks.md")
    a = p.parse_args(argv)

    cfg = Config.make(
        a.quick, a.work_dir, a.repeats, "python -m bench " + " ".join(shlex.quote(x) for x in argv)
    )
    if a.warmup is not None:
        cfg.warmup = max(0, a.warmup)
    if cfg.work.resolve().is_relative_to(REPO):
        p.error("--work-dir must be outside the repository")
    cfg.work.mkdir(parents=True, exist_ok=True)
    datasets = tuple(d for d in a.datasets.split(",") if d)
    compile_code_under_test()
    todo = SECTIONS if a.command == "all" else () if a.command == "report" else (a.command,)
    for name in todo:
        log(f"=== {name} ({'quick' if cfg.quick else 'full'}, work dir {cfg.work})")
        t0, la0 = time.time(), os.getloadavg()[0]
        if name == "build":
            from bench import build

            save_section(cfg, name, build.run(cfg, datasets), t0, la0)
        elif name == "load":
            from bench import load

            save_section(cfg, name, load.run(cfg, datasets), t0, la0)
        elif name == "scale":
            from bench import scale

            save_section(cfg, name, scale.run(cfg), t0, la0)
        elif name == "ddp":
            from bench import ddp

            save_section(cfg, name, ddp.run(cfg), t0, la0)
    from bench.report import render

    render(cfg, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
