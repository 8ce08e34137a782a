"""``convert_checkpoint`` / ``python -m torch_bq convert`` under faults and hostile arguments.

The promises of docs/reliability.md "Converting a checkpoint": the output appears
only complete, the destination is otherwise left exactly as it was (killed at any
moment, an error half-way, a full disk, a read-only or wrong destination), the
source is never modified, and the CLI ends in one line with a documented status.
"""

import errno
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import checkpoint_fixtures as fx
from torch_bq import cli, formats
from torch_bq.nn import CheckpointError, FP4Linear, FP8Linear, convert_checkpoint
from torch_bq.nn import _staging

ROOT = Path(__file__).resolve().parents[1]
TMP_MARK = ".torch_bq-tmp-"


def _source(root: Path, nan_in=None) -> dict:
    """A two-shard bf16 checkpoint with a config.json; ``nan_in``: a weight to poison."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.proj.weight": torch.randn(64, 64, generator=g).bfloat16() for i in range(4)}
    tensors["norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    if nan_in is not None:
        tensors[nan_in][3, 5] = float("nan")
    fx.sharded(root, tensors, shards=2)
    (root / "config.json").write_text('{"hidden_size": 64}')
    return tensors


def _digest(path: Path) -> str:
    """sha256 of a file; of a safetensors file's content (its header's JSON order varies between writes)."""
    h = hashlib.sha256()
    if path.suffix != ".safetensors":
        h.update(path.read_bytes())
        return h.hexdigest()
    with safe_open(path, "pt") as f:
        h.update(json.dumps(f.metadata(), sort_keys=True).encode())
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            h.update(f"{name} {t.dtype} {list(t.shape)}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tree(path: Path):
    """``{relative path: digest}`` of every file under ``path`` (``None`` when absent); a file maps to its digest."""
    if not os.path.lexists(path):
        return None
    if path.is_file():
        return _digest(path)
    return {str(p.relative_to(path)): _digest(p) if p.is_file() else "dir" for p in sorted(path.rglob("*"))}


def _leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if TMP_MARK in p.name]


@pytest.fixture
def src(tmp_path):
    _source(tmp_path / "src")
    return tmp_path / "src"


@pytest.fixture
def previous(tmp_path, src):
    """A destination already holding an earlier conversion (fp4) plus a stray file."""
    convert_checkpoint(src, tmp_path / "out", "fp4", progress=None)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    return tmp_path / "out"


# --------------------------------------------------------------------------- #
# errors half-way: nothing half-written is left
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("existing", [False, True])
def test_error_in_shard_2_leaves_destination_as_it_was(tmp_path, existing):
    # Before: shard 1 was left behind without an index, looking like a finished output.
    _source(tmp_path / "bad", nan_in="layers.3.proj.weight")  # round-robin: shard 2
    dst = tmp_path / "out"
    if existing:
        dst.mkdir()
        (dst / "old.txt").write_text("keep me")
    before, source = _tree(dst), _tree(tmp_path / "bad")
    with pytest.raises(CheckpointError, match=r"layers.3.proj.weight: w: expected finite values, got nan"):
        convert_checkpoint(tmp_path / "bad", dst, "fp8", overwrite=True, progress=None)
    assert _tree(dst) == before and _tree(tmp_path / "bad") == source
    assert _leftovers(tmp_path) == []


def _failing_save(monkeypatch, fail_on: int, message: str):
    """Make the ``fail_on``-th safetensors write fail the way safetensors reports an OS error."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, calls = safetensors.torch.save_file, []

    def save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == fail_on:
            raise SafetensorError(f"Error while serializing: I/O error: {message}")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return calls


def test_full_disk_is_an_os_error_and_changes_nothing(tmp_path, src, previous, monkeypatch):
    before = _tree(previous)
    calls = _failing_save(monkeypatch, 2, "No space left on device (os error 28)")
    with pytest.raises(OSError) as info:
        convert_checkpoint(src, previous, "fp8", overwrite=True, progress=None)
    assert info.value.errno == errno.ENOSPC and len(calls) == 2
    assert _tree(previous) == before and _leftovers(tmp_path) == []


def test_full_disk_cli_one_line_exit_3(tmp_path, src, monkeypatch, capsys):
    _failing_save(monkeypatch, 1, "No space left on device (os error 28)")
    status = cli.convert_main([str(src), str(tmp_path / "out"), "--format", "fp8", "-q"])
    err = capsys.readouterr().err
    assert status == cli.EXIT_IO == 3
    assert err.count("\n") == 1 and err.startswith("error: No space left on device: ")
    assert err.rstrip().endswith(f"{tmp_path / 'out'} was left as it was")
    assert not (tmp_path / "out").exists()


def test_file_size_limit_real_write_failure(tmp_path, src):
    # A real failing write (RLIMIT_FSIZE: EFBIG even for root), through the command line.
    script = textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (6000, 6000))
        from torch_bq.__main__ import main
        sys.exit(main(["convert", {str(src)!r}, {str(tmp_path / 'out')!r}, "--format", "fp8", "-q"]))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 3, run.stderr
    assert run.stderr.startswith("error: File too large: ") and run.stderr.count("\n") == 1
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_read_only_destination_cli(tmp_path, src, monkeypatch, capsys):
    # Simulated (root ignores directory permissions): the staging mkdir is refused by the filesystem.
    def mkdir(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(_staging.os, "mkdir", mkdir)
    status = cli.convert_main([str(src), str(tmp_path / "out"), "--format", "fp8", "-q"])
    err = capsys.readouterr().err
    assert status == 3 and err.startswith("error: Read-only file system: ") and err.count("\n") == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_destination_real(tmp_path, src, capsys):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        status = cli.convert_main([str(src), str(parent / "out"), "--format", "fp8", "-q"])
    finally:
        parent.chmod(0o755)
    assert status == 3 and "Permission denied" in capsys.readouterr().err
    assert list(parent.iterdir()) == []


# --------------------------------------------------------------------------- #
# refused before anything is touched
# --------------------------------------------------------------------------- #


def test_destination_is_a_file(tmp_path, src, capsys):
    f = tmp_path / "out"
    f.write_text("not a directory")
    for overwrite in ([], ["--overwrite"]):
        assert cli.convert_main([str(src), str(f), "--format", "fp8", "-q", *overwrite]) == 2
        err = capsys.readouterr().err
        assert err == f"error: dst: {f} exists and is not a directory\n"
    assert f.read_text() == "not a directory" and _leftovers(tmp_path) == []


def test_destination_is_the_source(tmp_path, src, capsys):
    # Before: the bf16 source shards were replaced, then a SameFileError traceback.
    before = _tree(src)
    assert cli.convert_main([str(src), str(src), "--format", "fp8", "--overwrite", "-q"]) == 2
    assert "is the source directory" in capsys.readouterr().err
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(ValueError, match="is the source directory"):
        convert_checkpoint(src, link, "fp8", overwrite=True, progress=None)
    assert _tree(src) == before and _leftovers(tmp_path) == []


def test_destination_containing_the_source(tmp_path):
    _source(tmp_path / "out" / "hf")
    single = tmp_path / "box"
    single.mkdir()
    save_file({"a.weight": torch.randn(32, 32)}, single / "m.safetensors")
    before = (_tree(tmp_path / "out"), _tree(single))
    with pytest.raises(ValueError, match="contains the source file"):
        convert_checkpoint(tmp_path / "out" / "hf", tmp_path / "out", "fp8", overwrite=True, progress=None)
    with pytest.raises(ValueError, match="contains the source file"):
        convert_checkpoint(single / "m.safetensors", single, "fp8", overwrite=True, progress=None)
    assert (_tree(tmp_path / "out"), _tree(single)) == before


def test_destination_inside_the_source_is_allowed(src):
    before = _tree(src)
    convert_checkpoint(src, src / "fp8", "fp8", progress=None)
    assert {k: v for k, v in _tree(src).items() if not k.startswith("fp8")} == before  # ...and nothing else changed
    FP8Linear.from_checkpoint(src / "fp8", "layers.0.proj")
    # the source still loads as it did (its index ignores the new subdirectory)
    assert len(load_file(src / "model-00001-of-00002.safetensors")) == 3


def test_old_scale_next_to_float_weight_is_refused(tmp_path):
    # Before: the old scale was written over the new one (a 315x error on load).
    w = torch.randn(64, 64)
    _, old_scale = formats.quantize_fp8(w * 300)
    for suffix in (".weight_scale", ".weight_scale_inv", ".scale"):
        save_file({"p.weight": w, f"p{suffix}": old_scale}, tmp_path / "in.safetensors")
        with pytest.raises(CheckpointError, match=rf"p.weight: the source already holds \['p{suffix}'\]"):
            convert_checkpoint(tmp_path / "in.safetensors", tmp_path / "out", "fp8", progress=None)
        assert not (tmp_path / "out").exists()


def test_fp4_odd_k_is_refused_up_front_or_loads_back(tmp_path):
    # Before: recorded K + 1 columns, which load_quantized_ then refused. Either answer is
    # right: a named refusal before anything is written, or an output that loads back as K.
    w = torch.randn(8, 33)
    save_file({"a.weight": torch.randn(8, 64), "b.weight": w}, tmp_path / "in.safetensors")
    try:
        convert_checkpoint(tmp_path / "in.safetensors", tmp_path / "out", "fp4", progress=None)
    except CheckpointError as e:
        assert re.search(r"b.weight: K = 33 is odd.*load back as K = 34", str(e))
        assert not (tmp_path / "out").exists()
        # excluded, it is copied in high precision and the rest converts
        convert_checkpoint(tmp_path / "in.safetensors", tmp_path / "out", "fp4", exclude=r"^b\.", progress=None)
    else:
        m = FP4Linear.from_checkpoint(tmp_path / "out", "b")
        assert m.in_features == 33
        packed, scale = formats.quantize_fp4(w)
        assert torch.equal(m.weight.view(torch.uint8), packed.view(torch.uint8))
    assert FP4Linear.from_checkpoint(tmp_path / "out", "a").in_features == 64


@pytest.mark.parametrize("block, error, match", [
    ((1.5, 32), TypeError, r"block: expected two positive ints"),
    ((2**63, 32), ValueError, "at most 2147483647"),
])
def test_bad_blocks_are_refused(tmp_path, src, block, error, match):
    # Before: 1.5 was truncated to 1.
    with pytest.raises(error, match=match):
        convert_checkpoint(src, tmp_path / "out", "fp8", block=block, progress=None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("block", [(3, 5), (128, 96)])
def test_odd_blocks_are_refused_up_front_or_load_back(tmp_path, block):
    # Before: --block 3x5 wrote output that nothing could load (or misloaded it).
    w = torch.randn(96, 80)
    save_file({"p.weight": w}, tmp_path / "in.safetensors")
    try:
        convert_checkpoint(tmp_path / "in.safetensors", tmp_path / "out", "fp8", block=block, exclude=None,
                           progress=None)
    except ValueError as e:
        assert "1 or a power of two" in str(e) and not (tmp_path / "out").exists()
        return
    m = FP8Linear.from_checkpoint(tmp_path / "out", "p")
    data, scale = formats.quantize_fp8(w, block)
    assert m.block == block
    assert torch.equal(formats.dequantize_fp8(m.weight, m.weight_scale, m.block),
                       formats.dequantize_fp8(data, scale, block))


def test_every_loadable_block_loads_back(tmp_path):
    save_file({"p.weight": torch.randn(96, 80)}, tmp_path / "in.safetensors")
    for bn, bk in [(1, 32), (2, 64), (128, 128), (256, 16)]:
        out = tmp_path / f"o{bn}x{bk}"
        convert_checkpoint(tmp_path / "in.safetensors", out, "fp8", block=(bn, bk), exclude=None, progress=None)
        m = FP8Linear.from_checkpoint(out, "p")
        data, scale = formats.quantize_fp8(load_file(tmp_path / "in.safetensors")["p.weight"], (bn, bk))
        got = formats.dequantize_fp8(m.weight, m.weight_scale, m.block)
        assert torch.equal(got, formats.dequantize_fp8(data, scale, (bn, bk)))


def test_invalid_regex(tmp_path, src, capsys):
    with pytest.raises(ValueError, match=r"include: not a valid regular expression"):
        convert_checkpoint(src, tmp_path / "out", "fp8", include="(", progress=None)
    with pytest.raises(SystemExit) as info:
        cli.convert_main([str(src), str(tmp_path / "out"), "--format", "fp8", "--exclude", "[a-"])
    assert info.value.code == 2 and "argument --exclude: not a valid regular expression" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_destination_symlink_to_a_directory(tmp_path, src, previous):
    link = tmp_path / "current"
    link.symlink_to(previous)
    convert_checkpoint(src, link, "fp8", overwrite=True, progress=None)
    assert link.is_symlink() and FP8Linear.from_checkpoint(link, "layers.0.proj").block == (32, 32)
    assert _leftovers(tmp_path) == []


def test_overwrite_replaces_as_a_whole(tmp_path, src, previous, monkeypatch):
    convert_checkpoint(src, previous, "fp8", overwrite=True, progress=None)
    assert not (previous / "notes.txt").exists()
    assert FP8Linear.from_checkpoint(previous, "layers.1.proj").block == (32, 32)
    # where renameat2(RENAME_EXCHANGE) is missing, the rename-aside fallback does the same
    monkeypatch.setattr(_staging, "exchange", lambda a, b: False)
    convert_checkpoint(src, previous, "fp4", overwrite=True, progress=None)
    assert FP4Linear.from_checkpoint(previous, "layers.1.proj").in_features == 64
    assert _leftovers(tmp_path) == []


def test_interrupt_leaves_destination_and_exits_130(tmp_path, src, previous, monkeypatch, capsys):
    before = _tree(previous)
    import torch_bq.nn.convert as convert_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_module, "_save_shard", interrupted)
    assert cli.convert_main([str(src), str(previous), "--format", "fp8", "--overwrite", "-q"]) == 130
    assert capsys.readouterr().err == f"error: interrupted; {previous} was left as it was\n"
    assert _tree(previous) == before and _leftovers(tmp_path) == []


# --------------------------------------------------------------------------- #
# kill -9 at every step
# --------------------------------------------------------------------------- #

# Counts every step convert takes on the filesystem (shard writes, copies, fsyncs,
# renames, the exchange, the final cleanup) and SIGKILLs itself just before step N.
_KILLER = """
import os, shutil, signal, sys
from torch_bq.nn import _staging, convert
n, steps = int(sys.argv[1]), [0]

def step(fn):
    def wrapped(*args, **kwargs):
        if steps[0] == n:
            os.kill(os.getpid(), signal.SIGKILL)
        steps[0] += 1
        return fn(*args, **kwargs)
    return wrapped

os.fsync, os.rename, shutil.copy2, shutil.rmtree = (step(f) for f in (os.fsync, os.rename, shutil.copy2, shutil.rmtree))
_staging.exchange, convert._save_shard = step(_staging.exchange), step(convert._save_shard)
from torch_bq.__main__ import main
sys.exit(main(["convert", *sys.argv[2:]]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("existing", [True, False])
def test_killed_at_any_step_leaves_old_or_new(tmp_path, src, existing):
    # Before: kill -9 left finished shards without an index, which inspect and the loader accepted.
    dst = tmp_path / "out"
    if existing:
        convert_checkpoint(src, dst, "fp4", progress=None)
    previous, source = _tree(dst), _tree(src)
    convert_checkpoint(src, tmp_path / "expected", "fp8", progress=None)
    expected = _tree(tmp_path / "expected")
    args = [str(src), str(dst), "--format", "fp8", "--overwrite", "-q"]
    seen = []
    for n in range(40):
        run = subprocess.run([sys.executable, "-c", _KILLER, str(n), *args], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        state = _tree(dst)
        assert _tree(src) == source
        if run.returncode == 0:
            assert state == expected
            break
        assert run.returncode == -9, run.stderr
        assert state in (previous, expected), f"killed before step {n}: {state}"
        seen.append("old" if state == previous else "new")
        if state == expected and existing:  # committed: restore the previous output for the next kill point
            convert_checkpoint(src, dst, "fp4", overwrite=True, progress=None)
    else:
        pytest.fail("convert never finished")
    # every step was a kill point (shards, index, copy, fsyncs, rename) and the switch happened once
    assert len(seen) >= 8 and seen == sorted(seen, key=["old", "new"].index)
    # leftovers of killed runs are hidden siblings only, and a rerun is unaffected by them
    assert all(name.startswith(".out" + TMP_MARK) for name in _leftovers(tmp_path))
    assert cli.convert_main([*args]) == 0 and _tree(dst) == expected
    assert cli.inspect_main([str(dst), "-q"]) == 0


def test_error_on_a_terminal_clears_the_progress_line(tmp_path, monkeypatch, capsys):
    _source(tmp_path / "bad", nan_in="layers.3.proj.weight")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert cli.convert_main([str(tmp_path / "bad"), str(tmp_path / "out"), "--format", "fp8"]) == 2
    err = capsys.readouterr().err
    # the progress line is rewritten in place; the error replaces it instead of running on after it
    assert "\r\x1b[Kerror: layers.3.proj.weight: w: expected finite values" in err
