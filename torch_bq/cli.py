"""Command-line tools: ``inspect`` a checkpoint's quantized tensors, ``convert`` a float checkpoint.

Wired into ``python -m torch_bq`` by :mod:`torch_bq.__main__` through
:func:`add_inspect_parser` / :func:`add_convert_parser`; each registers a
sub-command whose ``func(args)`` returns the exit status. :func:`inspect_main`
and :func:`convert_main` run one tool on an argv list, and
``python -m torch_bq.cli {inspect,convert} ...`` works on its own.

Exit status (the same for both commands; :data:`EXIT_CODES` holds the table):

===  =====================================================================
0    success
1    ``inspect`` found invalid layers (the table says which and why)
2    usage error or refused input: bad arguments (argparse's own code), an
     invalid ``--include``/``--exclude`` regex or ``--block``, a checkpoint
     that is not readable or not convertible, an output that exists, is a
     file, or overlaps the input
3    the operating system failed a read or write (permission denied,
     read-only filesystem, disk full); ``convert`` left the output as it was
130  interrupted (Ctrl-C); ``convert`` left the output as it was
70   an internal error (a bug): the traceback is printed
===  =====================================================================

Every error but the last is one line on stderr, ``error: ...``.
"""

from __future__ import annotations

import argparse
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Optional, Sequence, TextIO

import torch

__all__ = [
    "add_inspect_parser",
    "add_convert_parser",
    "inspect_main",
    "convert_main",
    "inspect_checkpoint",
    "InspectRow",
    "main",
    "EXIT_OK",
    "EXIT_INVALID",
    "EXIT_USAGE",
    "EXIT_IO",
    "EXIT_INTERRUPTED",
    "EXIT_INTERNAL",
    "EXIT_CODES",
]

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2  # argparse exits with 2 too
EXIT_IO = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_INTERNAL = 70  # EX_SOFTWARE of sysexits.h

#: exit status -> meaning, as the module docstring and ``--help`` give them
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_INVALID: "inspect found invalid layers",
    EXIT_USAGE: "usage error or refused input (bad arguments, unreadable/unconvertible checkpoint, output exists)",
    EXIT_IO: "an OS read/write error (permission, read-only, disk full); the output was left as it was",
    EXIT_INTERRUPTED: "interrupted; the output was left as it was",
    EXIT_INTERNAL: "internal error (a bug; traceback printed)",
}
_EPILOG = "exit status: " + "; ".join(f"{code} {what}" for code, what in EXIT_CODES.items())


def _error(message: str) -> None:
    # On a terminal the progress line has no newline yet: clear it rather than append to it.
    clear = "\r\x1b[K" if getattr(sys.stderr, "isatty", lambda: False)() else ""
    print(f"{clear}error: {message}", file=sys.stderr)


def _guarded(run):
    """Turn the errors a command can meet into one line on stderr and a documented exit status."""

    def wrapper(args: argparse.Namespace, *rest) -> int:
        from .checkpoint import CheckpointError

        left = f"; {args.output} was left as it was" if getattr(args, "output", None) else ""
        try:
            return run(args, *rest)
        except KeyboardInterrupt:
            _error(f"interrupted{left}")
            return EXIT_INTERRUPTED
        except (CheckpointError, ValueError, TypeError, FileExistsError, NotADirectoryError) as e:
            _error(str(e))
            return EXIT_USAGE
        except OSError as e:
            what = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
            _error(f"{what}{left}")
            return EXIT_IO
        except Exception:  # a bug: keep the traceback, but with its own exit status
            traceback.print_exc()
            return EXIT_INTERNAL

    wrapper.__name__, wrapper.__doc__ = run.__name__, run.__doc__
    return wrapper

# =========================================================================== #
# inspect
# =========================================================================== #


@dataclass
class InspectRow:
    """One quantized layer (or one expert of a stacked one) as ``inspect`` reports it."""

    name: str
    layout: str
    format: str
    block: Optional[tuple[int, int]]
    shape: tuple[int, int]  # [N, K] of the layer
    experts: Optional[int]
    nbytes: int  # data + scale bytes, all experts
    status: str  # "ok" or what is wrong
    source: str = "?"  # where format and block came from: record, config, argument, layout, shapes
    scale: str = "?"  # the stored scale encoding: e8m0, f32 (bf16/f16 widened), e4m3 (NVFP4)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def inspect_checkpoint(source, *, progress: Optional[TextIO] = None) -> tuple[list[InspectRow], dict]:
    """Find and validate every quantized linear of ``source``.

    Reads headers for layouts, then every quantized tensor once (one expert at a
    time for stacked tensors) to scan for NaN codes (docs/contract.md §1).

    Returns:
        ``(rows, totals)`` with ``totals = {"quantized_bytes", "other_bytes",
        "other_tensors", "invalid"}``.
    """
    from .checkpoint import (
        CheckpointError,
        IncompleteCheckpointError,
        NotARegularFileError,
        UnsafePathError,
        detect_linear,
        open_checkpoint,
        quantized_prefixes,
        read_linear,
    )
    from .nn.convert import Progress

    rows: list[InspectRow] = []
    with open_checkpoint(source) as reader:
        prefixes = quantized_prefixes(reader.keys())
        bar = Progress(progress, max(1, len(prefixes)), "inspect")
        used: set[str] = set()
        for prefix in prefixes:
            try:
                layout = detect_linear(reader, prefix, expert=None)
            except (NotARegularFileError, UnsafePathError, IncompleteCheckpointError):
                raise  # the checkpoint itself is unusable, not one layer
            except CheckpointError as e:
                if "pass expert=i" not in str(e):
                    rows.append(InspectRow(prefix, "?", "?", None, (0, 0), None, 0, str(e), "?"))
                    bar.step(prefix)
                    continue
                layout = detect_linear(reader, prefix, expert=0)
            names = layout.names
            used.update(names)
            status = "ok"
            for e in range(layout.num_experts or 1):
                try:
                    lay = layout if layout.num_experts is None else detect_linear(reader, prefix, expert=e)
                    read_linear(reader, lay)
                except CheckpointError as err:
                    status = (f"expert {e}: " if layout.num_experts else "") + str(err)
                    break
            nbytes = sum(reader.nbytes(n) for n in names if n != layout.bias_name)
            rows.append(InspectRow(prefix, layout.layout, layout.format, layout.block,
                                   (layout.out_features, layout.in_features), layout.num_experts, nbytes, status,
                                   layout.source, _scale_name(reader.dtype(layout.scale_name))))
            bar.step(prefix)
        other = [k for k in reader.keys() if k not in used]
        totals = {
            "quantized_bytes": sum(r.nbytes for r in rows),
            "other_bytes": sum(reader.nbytes(k) for k in other),
            "other_tensors": len(other),
            "invalid": sum(not r.ok for r in rows),
        }
    return rows, totals


def _scale_name(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e8m0fnu, torch.uint8):
        return "e8m0"
    return {torch.float8_e4m3fn: "e4m3"}.get(dtype, "f32")  # bf16/f16 scales are widened to float32 on load


def _mib(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@_guarded
def _run_inspect(args: argparse.Namespace, out: TextIO = None) -> int:
    out = out or sys.stdout
    rows, totals = inspect_checkpoint(args.path, progress=None if args.quiet else sys.stderr)
    header = ("tensor", "layout", "format", "block", "scale", "from", "shape [N, K]", "bytes", "status")
    table = [header]
    for r in rows:
        shape = f"{r.shape[0]} x {r.shape[1]}" + (f" x {r.experts} experts" if r.experts else "")
        block = "-" if r.block is None else f"{r.block[0]}x{r.block[1]}"
        table.append((r.name, r.layout, r.format, block, r.scale, r.source, shape, _mib(r.nbytes), r.status))
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1], file=out)
    print(
        f"total: {len(rows)} quantized layers, {_mib(totals['quantized_bytes'])} quantized; "
        f"{totals['other_tensors']} other tensors, {_mib(totals['other_bytes'])}; "
        f"{totals['invalid']} invalid",
        file=out,
    )
    return EXIT_INVALID if totals["invalid"] else EXIT_OK


def add_inspect_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``inspect PATH`` on an ``argparse`` sub-parsers object; ``args.func(args)`` runs it."""
    p = subparsers.add_parser(
        "inspect",
        help="list a checkpoint's quantized tensors: format, block, shape, validity",
        description="Print each quantized linear of a safetensors checkpoint (file or directory) with its "
        "layout, format, block, where format and block came from (record: torch_bq's metadata; config: "
        "config.json; layout: fixed by the layout; shapes: inferred, unique), shape and validity (NaN codes), "
        "and a total. Exit status 1 if any is invalid.",
        epilog=_EPILOG,
    )
    p.add_argument("path", help="a .safetensors file or a checkpoint directory")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run_inspect)
    return p


# =========================================================================== #
# convert
# =========================================================================== #


def _parse_block(text: str) -> tuple[int, int]:
    try:
        bn, bk = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BNxBK such as 32x32 or 128x128, got {text!r}") from None
    from . import formats

    try:
        block = formats.check_block((bn, bk))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return block


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a valid regular expression ({e}): {text!r}") from None
    return text


@_guarded
def _run_convert(args: argparse.Namespace, out: TextIO = None) -> int:
    from .nn.convert import convert_checkpoint

    out = out or sys.stdout
    scale_dtype = {"e8m0": torch.float8_e8m0fnu, "f32": torch.float32}[args.scale_dtype]
    summary = convert_checkpoint(
        args.input, args.output, args.format, block=args.block, scale_dtype=scale_dtype,
        rounding=args.rounding, include=args.include, exclude=args.exclude or None,
        overwrite=args.overwrite, progress=None if args.quiet else sys.stderr,
    )
    ratio = summary["bytes_out"] / summary["bytes_in"] if summary["bytes_in"] else 1.0
    print(
        f"converted {len(summary['quantized'])} weights to {args.format}, copied {len(summary['copied'])} tensors; "
        f"{_mib(summary['bytes_in'])} -> {_mib(summary['bytes_out'])} ({ratio:.2f}x) in "
        f"{len(summary['files'])} shard(s) under {args.output}",
        file=out,
    )
    return EXIT_OK


def add_convert_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``convert IN OUT --format fp8|fp4`` on an ``argparse`` sub-parsers object."""
    from .nn.convert import DEFAULT_EXCLUDE

    p = subparsers.add_parser(
        "convert",
        help="quantize a bf16/fp32 safetensors checkpoint to fp8 or fp4 (our layout, sharded, with an index)",
        description="Quantize every 2-D floating '*.weight' of a safetensors checkpoint (file or directory), "
        "shard by shard, into '{p}.weight' + '{p}.weight_scale'; other tensors are copied. The output appears "
        "only once complete (written beside it, then renamed into place); on any error it is left as it was.",
        epilog=_EPILOG,
    )
    p.add_argument("input", help="a .safetensors file or a checkpoint directory")
    p.add_argument("output", help="output directory")
    p.add_argument("--format", required=True, choices=("fp8", "fp4", "nvfp4"),
                   help="fp8 (any --block), fp4 (OCP MXFP4) or nvfp4 (NVIDIA, ModelOpt layout)")
    p.add_argument("--block", type=_parse_block, default=(32, 32), help="fp8 scale block BNxBK (default 32x32)")
    p.add_argument("--scale-dtype", choices=("e8m0", "f32"), default="e8m0", help="fp8 scale storage (default e8m0)")
    p.add_argument("--rounding", choices=("ceil", "floor"), default="ceil", help="fp4 scale rule (default ceil)")
    p.add_argument("--include", type=_regex, default=None, help="regex: only weights whose name matches")
    p.add_argument("--exclude", type=_regex, default=DEFAULT_EXCLUDE,
                   help=f"regex: weights left in high precision (default {DEFAULT_EXCLUDE!r}; '' for none)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory (as a whole)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run_convert)
    return p


# =========================================================================== #
# entry points
# =========================================================================== #


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m torch_bq.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_inspect_parser(sub)
    add_convert_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``inspect`` or ``convert`` from ``argv``; returns the exit status."""
    args = _parser().parse_args(argv)
    return args.func(args)


def inspect_main(argv: Optional[Sequence[str]] = None) -> int:
    """``inspect`` with ``argv`` holding its own arguments (``[PATH, ...]``)."""
    return main(["inspect", *(sys.argv[1:] if argv is None else argv)])


def convert_main(argv: Optional[Sequence[str]] = None) -> int:
    """``convert`` with ``argv`` holding its own arguments (``[IN, OUT, "--format", ...]``)."""
    return main(["convert", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
