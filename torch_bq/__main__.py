"""Command line: ``python -m torch_bq {demo} ...``."""

import argparse
import sys

from . import demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_bq", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(subparsers)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
