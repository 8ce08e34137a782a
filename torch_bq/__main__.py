"""Command line: ``python -m torch_bq {demo,inspect,convert} ...``."""

import argparse
import sys

from . import cli, demo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_bq", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    demo.add_parser(subparsers)
    cli.add_inspect_parser(subparsers)
    cli.add_convert_parser(subparsers)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
