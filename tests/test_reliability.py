"""Package-wide promises of docs/reliability.md that no single module's tests hold."""

import ast
from pathlib import Path

import pytest
import torch

from torch_bq import cli
from torch_bq.nn import CheckpointError, CheckpointReader

PACKAGE = Path(__file__).resolve().parents[1] / "torch_bq"

# Calls and imports that can execute code stored in a file.
_PICKLE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
_PICKLE_CALLS = {("torch", "load"), ("torch", "save"), ("np", "load"), ("numpy", "load")}


def test_no_pickle_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [f"{path}: import {a.name}" for a in node.names if a.name.split(".")[0] in _PICKLE_MODULES]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _PICKLE_MODULES:
                found.append(f"{path}: from {node.module} import ...")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if isinstance(base, ast.Name) and (base.id, node.func.attr) in _PICKLE_CALLS:
                    found.append(f"{path}:{node.lineno}: {base.id}.{node.func.attr}(...)")
    assert found == []


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "consolidated.00.pth"])
def test_pickle_checkpoints_are_refused(tmp_path, name, capsys):
    torch.save({"w": torch.zeros(2)}, tmp_path / name)  # the test writes one; the package never reads it
    with pytest.raises(CheckpointError, match="holds neither model.safetensors.index.json nor any"):
        CheckpointReader(tmp_path)
    assert cli.inspect_main([str(tmp_path), "-q"]) == 2
    assert capsys.readouterr().err.startswith("error: ")
