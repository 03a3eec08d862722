"""Command line: ``python -m nbtools demo``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the nbtools command line."""
    parser = argparse.ArgumentParser(prog="nbtools")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="2-rank CPU training run that is killed and recovers")
    demo.add_argument("--out", default="nbtools-demo", help="output directory")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from nbtools._demo import run_demo

        return run_demo(args.out)
    return 2


if __name__ == "__main__":
    sys.exit(main())
