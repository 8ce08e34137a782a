"""``inspect`` and ``convert``: the commands, their output and exit status."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import checkpoint_fixtures as fx
from torch_bq import cli, formats
from torch_bq.nn import FP4Linear, FP8Linear

ROOT = Path(__file__).resolve().parents[1]


def test_inspect_lists_every_layout(tmp_path, capsys):
    fx.deepseek_v3(tmp_path / "ds", prefix="model.layers.0.mlp.down_proj", n=300, k=260)
    assert cli.inspect_main([str(tmp_path / "ds"), "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["tensor", "layout", "format", "block", "scale", "from", "shape", "[N,", "K]", "bytes",
                              "status"]
    row = out[1].split()
    assert row[:6] == ["model.layers.0.mlp.down_proj", "deepseek-v3", "fp8", "128x128", "f32", "config"]
    assert row[6:9] == ["300", "x", "260"] and row[-1] == "ok"
    # data 300*260 bytes + float32 scales 3*3*4
    assert out[-1] == (f"total: 1 quantized layers, {(300 * 260 + 36) / 1024:.2f} KiB quantized; "
                       f"1 other tensors, 64 B; 0 invalid")


def test_inspect_gpt_oss_and_mixed(tmp_path, capsys):
    fx.gpt_oss(tmp_path / "g.safetensors", prefix="experts.down_proj", experts=3)
    assert cli.inspect_main([str(tmp_path / "g.safetensors"), "-q"]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert re.search(r"experts.down_proj\s+gpt-oss\s+fp4\s+1x32\s+e8m0\s+layout\s+64 x 96 x 3 experts", row) and row.endswith("ok")


def test_inspect_reports_nan_codes_and_exits_1(tmp_path, capsys):
    t = fx.gpt_oss(tmp_path / "g.safetensors", prefix="e", experts=3)
    scales = t["e_scales"].clone()
    scales[2, 10, 1] = 255
    t["e_scales"] = scales
    d, s = formats.quantize_fp8(torch.randn(64, 64))
    t["ok.weight"], t["ok.weight_scale"] = d, s
    save_file(t, tmp_path / "g.safetensors")
    assert cli.inspect_main([str(tmp_path / "g.safetensors"), "-q"]) == 1
    out = capsys.readouterr().out
    assert "expert 2: e_scales: found NaN e8m0 code 255 at index [10, 1]" in out
    assert re.search(r"^ok\s+torch_bq\s+fp8\s+32x32\s+e8m0\s+shapes\s+64 x 64\s+4.00 KiB\s+ok$", out, re.M)
    assert out.rstrip().endswith("1 invalid")


def test_inspect_unreadable_file_exits_2(tmp_path, capsys):
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 4)
    assert cli.inspect_main([str(tmp_path / "bad.safetensors")]) == 2
    assert "not a valid safetensors file" in capsys.readouterr().err


def test_convert_command_round_trip(tmp_path, capsys):
    torch.manual_seed(0)
    w = {"model.layers.0.mlp.up_proj.weight": torch.randn(96, 64), "model.embed_tokens.weight": torch.randn(10, 64),
         "model.norm.weight": torch.ones(64)}
    save_file(w, tmp_path / "in.safetensors")
    status = cli.convert_main([str(tmp_path / "in.safetensors"), str(tmp_path / "out"), "--format", "fp8",
                               "--block", "1x32"])
    assert status == 0
    captured = capsys.readouterr()
    assert "converted 1 weights to fp8, copied 2 tensors" in captured.out
    assert "convert [3/3] model.norm.weight" in captured.err  # progress on stderr
    m = FP8Linear.from_checkpoint(tmp_path / "out", "model.layers.0.mlp.up_proj")
    data, _ = formats.quantize_fp8(w["model.layers.0.mlp.up_proj.weight"], (1, 32))
    assert m.block == (1, 32) and torch.equal(m.weight.view(torch.uint8), data.view(torch.uint8))
    # the converted checkpoint inspects clean
    assert cli.inspect_main([str(tmp_path / "out"), "-q"]) == 0
    # fp4, and refusing a non-empty output
    assert cli.convert_main([str(tmp_path / "in.safetensors"), str(tmp_path / "out4"), "--format", "fp4", "-q"]) == 0
    assert FP4Linear.from_checkpoint(tmp_path / "out4", "model.layers.0.mlp.up_proj").in_features == 64
    assert cli.convert_main([str(tmp_path / "in.safetensors"), str(tmp_path / "out4"), "--format", "fp4", "-q"]) == 2
    assert "not empty" in capsys.readouterr().err


def test_convert_argument_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.convert_main([str(tmp_path), str(tmp_path / "o"), "--format", "int4"])
    with pytest.raises(SystemExit):
        cli.convert_main([str(tmp_path), str(tmp_path / "o"), "--format", "fp8", "--block", "32"])
    assert "expected BNxBK" in capsys.readouterr().err


def test_parsers_plug_into_a_host_cli(tmp_path, capsys):
    # How torch_bq/__main__.py wires them: add_*_parser on its own sub-parsers, then args.func(args).
    parser = argparse.ArgumentParser(prog="python -m torch_bq")
    sub = parser.add_subparsers(dest="command", required=True)
    cli.add_inspect_parser(sub)
    cli.add_convert_parser(sub)
    fx.torch_bq_layout(tmp_path / "m.safetensors", fmt="fp4")
    args = parser.parse_args(["inspect", str(tmp_path / "m.safetensors"), "--quiet"])
    assert args.func(args) == 0
    assert re.search(r"^proj\s+torch_bq\s+fp4\s+1x32\s+e8m0\s+shapes\s+70 x 100\s", capsys.readouterr().out, re.M)


def test_module_entry_point_runs(tmp_path):
    fx.torch_bq_layout(tmp_path / "m.safetensors")
    out = subprocess.run([sys.executable, "-m", "torch_bq.cli", "inspect", str(tmp_path / "m.safetensors")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "inspect [1/1] proj" in out.stderr and "total: 1 quantized layers" in out.stdout
