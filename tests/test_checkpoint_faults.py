"""The reader under faults and hostile files: FIFOs, files changing under a loaded model, paths out of the
directory, incomplete checkpoints, and a fuzz of truncations and header lies."""

import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import checkpoint_fixtures as fx
from torch_bq import cli, formats
from torch_bq.checkpoint import (
    CheckpointError,
    CheckpointReader,
    IncompleteCheckpointError,
    NotARegularFileError,
    UnsafePathError,
)
from torch_bq.nn import FP8Linear

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120  # seconds; a reader that blocks fails the test instead of hanging the suite


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=TIMEOUT, env=env, cwd=ROOT)


def _in_thread(fn, timeout=30):
    """``fn()`` in a daemon thread; fail (instead of hanging the suite) if it has not returned in time."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised in the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"blocked for {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


# --------------------------------------------------------------------------- #
# only regular files are opened (a FIFO used to block forever)
# --------------------------------------------------------------------------- #


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize("where", ["file", "glob", "index", "shard", "config"])
def test_fifo_is_refused_without_blocking(tmp_path, capsys, where):
    d = tmp_path / "ckpt"
    if where in ("index", "shard"):
        dq, sq = formats.quantize_fp8(torch.randn(32, 32))
        fx.sharded(d, {"x.weight": dq, "x.weight_scale": sq}, shards=2)
        target = d / ("model.safetensors.index.json" if where == "index" else "model-00002-of-00002.safetensors")
        target.unlink()
    else:
        d.mkdir()
        if where == "config":
            fx.deepseek_v3(d, prefix="x", config=False)
        target = d / {"file": "f.safetensors", "glob": "f.safetensors", "config": "config.json"}[where]
    os.mkfifo(target)
    source = target if where == "file" else d
    out = _in_thread(lambda: cli.inspect_main([str(source), "-q"]))  # a blocked thread = the bug
    assert out == 2
    err = capsys.readouterr().err
    assert "expected a regular" in err and "FIFO" in err, err
    with pytest.raises(NotARegularFileError, match="found a FIFO; it was not opened"):
        _in_thread(lambda: FP8Linear.from_checkpoint(CheckpointReader(source), "x", block=(128, 128)))


# --------------------------------------------------------------------------- #
# loaded modules own their bytes
# --------------------------------------------------------------------------- #


def test_editing_the_file_does_not_change_a_loaded_module(tmp_path):
    path = tmp_path / "m.safetensors"
    fx.torch_bq_layout(path, n=64, k=64, bias=False)
    m = FP8Linear.from_checkpoint(path, "proj", block=(32, 32))
    before = m.dequantize(torch.float32).weight.clone()
    blob = bytearray(path.read_bytes())
    with open(path, "r+b") as f:  # in place, as an editor or a second convert --overwrite would
        f.seek(len(blob) - 64 * 64 - 4)
        f.write(bytes(64 * 64))
    assert torch.equal(m.dequantize(torch.float32).weight, before)


def test_truncating_the_file_does_not_crash_a_loaded_module(tmp_path):
    # Used to be SIGBUS (exit 135) on the next forward: the module's weight was the file's mapped pages.
    path = tmp_path / "m.safetensors"
    fx.torch_bq_layout(path, n=256, k=256, bias=False)
    code = """
        import os, sys, torch
        from torch_bq.nn import FP8Linear
        m = FP8Linear.from_checkpoint(sys.argv[1], "proj", block=(32, 32))
        y0 = m(torch.ones(1, 256))
        os.truncate(sys.argv[1], 16)
        y1 = m(torch.ones(1, 256))
        print("same" if torch.equal(y0, y1) else "changed")
    """
    r = _run(code, str(path))
    assert r.returncode == 0 and r.stdout.strip() == "same", (r.returncode, r.stderr[-2000:])


def test_a_file_shrinking_while_read_is_a_named_error(tmp_path):
    path = tmp_path / "m.safetensors"
    fx.torch_bq_layout(path, n=64, k=64)
    reader = CheckpointReader(path)  # header parsed, file open
    os.truncate(path, path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match="ended after .* bytes .*truncated after it was opened"):
        reader.get("proj.weight")


# --------------------------------------------------------------------------- #
# an index names files inside its directory only, of the right type
# --------------------------------------------------------------------------- #


def _index_with(root: Path, shard_name):
    d, s = formats.quantize_fp8(torch.randn(32, 32))
    root.mkdir(parents=True)
    save_file({"x.weight": d, "x.weight_scale": s}, root / "model.safetensors")
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x.weight": shard_name, "x.weight_scale": "model.safetensors"}}))


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink-out", "symlink-dir-out"])
def test_index_paths_outside_the_directory_are_refused(tmp_path, kind):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    d, s = formats.quantize_fp8(torch.randn(32, 32))
    save_file({"x.weight": d}, outside / "evil.safetensors")
    root = tmp_path / "ckpt"
    name = {"absolute": str(outside / "evil.safetensors"), "dotdot": "../elsewhere/evil.safetensors",
            "symlink-out": "link.safetensors", "symlink-dir-out": "sub/evil.safetensors"}[kind]
    _index_with(root, name)
    if kind == "symlink-out":
        (root / "link.safetensors").symlink_to(outside / "evil.safetensors")
    if kind == "symlink-dir-out":
        (root / "sub").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="shards must be inside|outside the checkpoint directory"):
        CheckpointReader(root)
    assert cli.inspect_main([str(root), "-q"]) == 2


def test_glob_symlink_out_of_the_directory_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    fx.torch_bq_layout(tmp_path / "elsewhere" / "m.safetensors")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "m.safetensors").symlink_to(tmp_path / "elsewhere" / "m.safetensors")
    with pytest.raises(UnsafePathError):
        CheckpointReader(tmp_path / "ckpt")


def test_symlink_inside_the_directory_is_fine(tmp_path):
    root = tmp_path / "ckpt"
    _index_with(root, "alias.safetensors")
    (root / "alias.safetensors").symlink_to(root / "model.safetensors")
    assert CheckpointReader(root).shape("x.weight") == (32, 32)


@pytest.mark.parametrize("value", [3, None, ["model.safetensors"], {"a": 1}, ""])
def test_weight_map_values_of_the_wrong_type_are_named(tmp_path, value):
    root = tmp_path / "ckpt"
    _index_with(root, value)
    with pytest.raises(CheckpointError, match=r"weight_map\['x.weight'\] must be a shard file name"):
        CheckpointReader(root)


@pytest.mark.parametrize("index", ['[]', '{"weight_map": [1]}', '{"metadata": {}}', '7'])
def test_index_that_is_not_an_object_is_named(tmp_path, index):
    root = tmp_path / "ckpt"
    _index_with(root, "model.safetensors")
    (root / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        CheckpointReader(root)


# --------------------------------------------------------------------------- #
# incomplete checkpoints are refused
# --------------------------------------------------------------------------- #


def _three_shards(root: Path):
    tensors = {}
    for i in range(3):
        d, s = formats.quantize_fp8(torch.randn(32, 32))
        tensors[f"l{i}.weight"], tensors[f"l{i}.weight_scale"] = d, s
    fx.sharded(root, tensors, shards=3)


def test_shards_without_their_index_are_refused(tmp_path):
    # what a convert killed before writing its index used to leave: it inspected as "0 invalid"
    _three_shards(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors.index.json").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"numbered shards .* but not the model.safetensors.index.json"):
        CheckpointReader(tmp_path / "c")
    assert cli.inspect_main([str(tmp_path / "c"), "-q"]) == 2
    with pytest.raises(IncompleteCheckpointError):
        FP8Linear.from_checkpoint(tmp_path / "c", "l0")


def test_index_naming_an_absent_shard_is_refused(tmp_path):
    _three_shards(tmp_path / "c")
    (tmp_path / "c" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"names shard\(s\) \['model-00002-of-00003.safetensors'\]"):
        CheckpointReader(tmp_path / "c")
    assert cli.inspect_main([str(tmp_path / "c"), "-q"]) == 2


def test_index_missing_a_member_of_its_own_numbering_is_refused(tmp_path):
    _three_shards(tmp_path / "c")
    index = tmp_path / "c" / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    content["weight_map"] = {k: v for k, v in content["weight_map"].items() if "00003-of" not in v}
    index.write_text(json.dumps(content))
    with pytest.raises(IncompleteCheckpointError, match=r"names no tensor in shard\(s\) \['model-00003-of-00003"):
        CheckpointReader(tmp_path / "c")


# --------------------------------------------------------------------------- #
# fuzz: truncations, header corruptions, dtype and shape lies
# --------------------------------------------------------------------------- #


def _small_file(path: Path) -> bytes:
    d, s = formats.quantize_fp8(torch.randn(8, 40, generator=torch.Generator().manual_seed(1)), (1, 32))
    save_file({"p.weight": d, "p.weight_scale": s, "p.bias": torch.arange(8.0)}, path,
              metadata={"format": "pt"})
    return path.read_bytes()


def _header(blob: bytes) -> dict:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n])


def _with_header(blob: bytes, header: dict) -> bytes:
    n = struct.unpack("<Q", blob[:8])[0]
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + blob[8 + n:]


def _read_all(path: Path):
    reader = CheckpointReader(path)
    return {k: reader.get(k) for k in reader.keys()}


def _check_against_safetensors(path: Path) -> None:
    """Ours either raises CheckpointError or returns exactly what safetensors' own reader returns."""
    try:
        ours = _read_all(path)
    except CheckpointError:
        return
    theirs = load_file(path)  # a file we accept must be one safetensors accepts, with the same bytes
    assert sorted(ours) == sorted(theirs)
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape
        assert torch.equal(ours[k].contiguous().view(torch.uint8), theirs[k].contiguous().view(torch.uint8))


@given(cut=st.integers(0, 2000))
def test_fuzz_truncation(tmp_path_factory, cut):
    path = tmp_path_factory.mktemp("t") / "f.safetensors"
    blob = _small_file(path)
    path.write_bytes(blob[: min(cut, len(blob) - 1)])
    with pytest.raises(CheckpointError):
        _read_all(path)


@given(pos=st.integers(0, 400), byte=st.integers(0, 255))
def test_fuzz_header_byte_corruption(tmp_path_factory, pos, byte):
    path = tmp_path_factory.mktemp("h") / "f.safetensors"
    blob = bytearray(_small_file(path))
    n = struct.unpack("<Q", bytes(blob[:8]))[0]
    blob[pos % (8 + n)] = byte
    path.write_bytes(bytes(blob))
    _check_against_safetensors(path)


@given(
    tensor=st.sampled_from(["p.weight", "p.weight_scale", "p.bias"]),
    dtype=st.sampled_from(["U8", "F32", "BF16", "F8_E4M3", "F4", "I64", "F6_E2M3", "Q7", 5]),
    shape=st.lists(st.integers(0, 2**62), max_size=3) | st.sampled_from([[8, 40], [40, 8], [320], [-1, 8], [8.0, 40]]),
    offset_shift=st.integers(-8, 8),
)
def test_fuzz_dtype_and_shape_lies(tmp_path_factory, tensor, dtype, shape, offset_shift):
    path = tmp_path_factory.mktemp("l") / "f.safetensors"
    blob = _small_file(path)
    header = _header(blob)
    header[tensor]["dtype"] = dtype
    header[tensor]["shape"] = shape
    header[tensor]["data_offsets"][1] += offset_shift
    path.write_bytes(_with_header(blob, header))
    _check_against_safetensors(path)
    try:
        FP8Linear.from_checkpoint(path, "p")
    except (CheckpointError, TypeError):
        pass  # named errors only; anything else (AttributeError, RuntimeError, a hang) fails the test


def test_fuzz_files_load_when_untouched(tmp_path):
    path = tmp_path / "f.safetensors"
    _small_file(path)
    _check_against_safetensors(path)
    assert torch.equal(_read_all(path)["p.bias"], torch.arange(8.0))


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)


@given(layer=st.dictionaries(st.sampled_from(["format", "block", "scale_dtype", "in_features", "out_features"]), _json),
       version=st.sampled_from([1, 0, 2, "1", None, 1.0]))
def test_fuzz_hostile_records(tmp_path_factory, layer, version):
    # A record torch_bq itself would write loads; any other content is a named error, never a crash or a guess.
    from torch_bq.checkpoint import RECORD_KEY

    path = tmp_path_factory.mktemp("r") / "f.safetensors"
    d, s = formats.quantize_fp8(torch.randn(64, 64, generator=torch.Generator().manual_seed(2)), (32, 32))
    meta = {RECORD_KEY: json.dumps({"version": version, "layers": {"p": layer}})}
    save_file({"p.weight": d, "p.weight_scale": s}, path, metadata=meta)
    try:
        m = FP8Linear.from_checkpoint(path, "p")
    except CheckpointError:
        return
    assert m.block == (32, 32) and torch.equal(m.weight.view(torch.uint8), d.view(torch.uint8))
