"""Command line: ``python -m nbtools demo``, ``python -m nbtools doctor [--json]``, ``--version``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the nbtools command line."""
    from nbtools._doctor import header

    parser = argparse.ArgumentParser(prog="nbtools")
    parser.add_argument("--version", action="version", version=header())
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="2-rank CPU training run that is killed and recovers")
    demo.add_argument("--out", default="nbtools-demo", help="output directory")
    doctor = sub.add_parser(
        "doctor", help="check that training can run here; say what to fix (exit status 1 if not)"
    )
    doctor.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    doctor.add_argument("--no-smoke", action="store_true", help="skip the 2-rank smoke launch")
    doctor.add_argument(
        "--shm-dir",
        default=None,
        help="shared-memory filesystem to check (default $NBTOOLS_SNAPSHOT_DIR or /dev/shm)",
    )
    args = parser.parse_args(argv)
    if args.command == "demo":
        from nbtools._demo import run_demo

        return run_demo(args.out)
    if args.command == "doctor":
        from nbtools._doctor import run

        return run(as_json=args.json, smoke=not args.no_smoke, shm_path=args.shm_dir)
    return 2


if __name__ == "__main__":
    sys.exit(main())
