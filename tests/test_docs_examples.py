"""Every code block of README.md and docs/*.md runs as written, and prints what the docs say.

How pages are covered (nothing here lists the pages: a new page is covered once it exists):

* Discovery: every fenced block tagged ``python``, ``bash`` or ``sh`` in ``README.md`` and
  ``docs/*.md``. Untagged blocks are output, transcripts or diagrams and are not run (an
  untagged block right after a python block and an ``Output...:`` paragraph is that block's
  expected stdout, compared exactly).
* A page's blocks run in document order in one fresh temporary working directory; its
  python blocks share one namespace (``__name__ == "__doc_example__"``).
* A shell block runs line by line through ``bash`` in that directory, with this
  interpreter first on ``PATH`` and the repository first on ``PYTHONPATH`` (so
  ``python -m torch_bq ...`` and ``python -m examples...`` use this checkout). A line is
  split at ``&&``; each command must exit 0. The only commands not run are those starting
  with a prefix in :data:`SKIPPED_COMMANDS` (installs, the test suite itself, ``torchrun``);
  the test prints each one it skips.
* A page holding ``<!-- docs-test: nproc=N -->`` is a distributed example: its python
  blocks, joined in order, are one script that ``python -m torch.distributed.run
  --standalone --nproc-per-node N`` runs with gloo (what ``torchrun`` does), and every rank
  must exit 0 (the harness ends each rank with ``os._exit(0)`` after the page's code, see
  ``_run_distributed``). Such a page may not claim printed output.
* Fixtures: a block may name a checkpoint by one of the relative paths of
  :data:`FIXTURES` (``"path/to/model"``, ...). Before a page runs, each fixture whose path
  occurs in one of the page's runnable blocks is written at that path in the working
  directory. To add one, add an entry (path -> writer) to :data:`FIXTURES`. Any other file a
  block reads, the page's own blocks must write.
* :data:`SLOW_PAGES` lists the pages whose examples take more than a few seconds on two
  cores; they are marked ``slow`` (still run in CI).
"""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import checkpoint_fixtures as fx
from torch_bq import formats

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted([ROOT / "README.md", *DOCS.glob("*.md")])

# Commands that are documented but not run here, with the reason.
SKIPPED_COMMANDS = {
    "pip install": "installs packages; CI has already run it",
    "python -m pip install": "installs packages; CI has already run it",
    "python -m pytest": "the test suite itself",
    "torchrun": "multi-process launch; the distributed pages run their python blocks under "
    "torch.distributed.run (see nproc= above) and tests/test_distributed.py runs examples/",
}

# Pages whose examples take more than a few seconds on two cores: the demo and inductor
# compiles (README), two torchrun ranks (distributed), an inductor compile (moe), tiny transformers
# models loaded, saved and compiled (huggingface).
SLOW_PAGES = {"README.md", "distributed.md", "moe.md", "huggingface.md"}

_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
_NPROC = re.compile(r"<!--\s*docs-test:\s*nproc=(\d+)\s*-->")
_RUNNABLE = {"python": "python", "bash": "shell", "sh": "shell"}


# --------------------------------------------------------------------------- #
# fixtures named by the docs
# --------------------------------------------------------------------------- #


def _gaussian(n, k, seed):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def _fp4_model(root: Path) -> None:
    """README's ``path/to/model``: ``model.layers.0.mlp.down_proj`` MXFP4 ``[1024, 4096]``, our layout."""
    root.mkdir(parents=True)
    fx.torch_bq_layout(root / "model.safetensors", "model.layers.0.mlp.down_proj", fmt="fp4", n=1024, k=4096,
                       bias=False)


def _bf16_model(root: Path) -> None:
    """README's ``path/to/bf16_model``: a bf16 Llama-style MLP and embedding, with config.json."""
    root.mkdir(parents=True)
    shapes = {"model.embed_tokens.weight": (64, 128), "model.layers.0.mlp.gate_proj.weight": (256, 128),
              "model.layers.0.mlp.up_proj.weight": (256, 128), "model.layers.0.mlp.down_proj.weight": (128, 256)}
    tensors = {name: _gaussian(*shape, i).to(torch.bfloat16) for i, (name, shape) in enumerate(shapes.items())}
    save_file(tensors, root / "model.safetensors")
    (root / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))


def _fp8_mlp(root: Path) -> None:
    """docs/distributed.md's ``path/to/mlp``: fp8 (32x32 e8m0) ``mlp.up_proj`` [96, 256], ``mlp.down_proj`` [256, 96]."""
    root.mkdir(parents=True)
    tensors = {}
    for i, (name, shape) in enumerate({"mlp.up_proj": (96, 256), "mlp.down_proj": (256, 96)}.items()):
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = formats.quantize_fp8(_gaussian(*shape, i))
    save_file(tensors, root / "model.safetensors")


# docs/distributed.md's drafter: the tiny config its block spells out.
_TINY_DRAFTER = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                     sliding_window=24, intermediate_size=512, num_layers=2)


def _drafter(root: Path) -> None:
    """docs/distributed.md's ``path/to/drafter``: a tiny fp8 drafter under the prefix ``model.mtp.``."""
    from torch_bq.nn import Drafter, DrafterConfig, FP8Linear

    root.mkdir(parents=True)
    config = DrafterConfig(**_TINY_DRAFTER)
    drafter = Drafter(config)
    for i, layer in enumerate(drafter.layers):
        for j, name in enumerate(("qkv_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            old = getattr(layer, name)
            dense = torch.nn.Linear(old.in_features, old.out_features, bias=False)
            dense.weight.data = _gaussian(old.out_features, old.in_features, 10 * i + j)
            setattr(layer, name, FP8Linear.from_linear(dense, block=config.fp8_block))
    state = {"model.mtp." + k: v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(state, root / "model.safetensors")


def _hf_checkpoint(family: str, layout: str):
    """docs/huggingface.md's tiny checkpoints: a transformers model of ``family`` in ``layout``.

    The layouts are the families' own (tests/hf_fixtures.py); the page is skipped where
    transformers (the ``hf`` extra) is not installed.
    """

    def write(root: Path) -> None:
        pytest.importorskip("transformers")
        import hf_fixtures as hfx

        writers = {"bf16": hfx.save_bf16, "fp8": hfx.deepseek_fp8, "mxfp4": hfx.gpt_oss_mxfp4,
                   "nvfp4": hfx.modelopt_nvfp4}
        writers[layout](hfx.float_model(family), root)

    return write


FIXTURES = {
    "path/to/model": _fp4_model,
    "path/to/bf16_model": _bf16_model,
    "path/to/mlp": _fp8_mlp,
    "path/to/drafter": _drafter,
    "path/to/DeepSeek-V3": _hf_checkpoint("deepseek_v3", "fp8"),
    "path/to/gpt-oss": _hf_checkpoint("gpt_oss", "mxfp4"),
    "path/to/Qwen3-FP8": _hf_checkpoint("qwen3", "fp8"),
    "path/to/Llama": _hf_checkpoint("llama", "bf16"),
    "path/to/Llama-NVFP4": _hf_checkpoint("llama", "nvfp4"),
}


# --------------------------------------------------------------------------- #
# discovery
# --------------------------------------------------------------------------- #


def _blocks(page: Path):
    """``[(kind, code, expected_output_or_None)]`` for each runnable block of ``page``, in order."""
    text = page.read_text()
    fences = list(_FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        kind = _RUNNABLE.get(m.group(1))
        if kind is None:
            continue
        expected = None
        if kind == "python" and i + 1 < len(fences) and fences[i + 1].group(1) == "":
            between = text[m.end(): fences[i + 1].start()]
            if re.fullmatch(r"\s*Output[^\n]*:\s*", between):
                expected = fences[i + 1].group(2)
        out.append((kind, m.group(2), expected))
    return out


def _page_id(page: Path) -> str:
    return page.name


def _page_params():
    params = []
    for page in PAGES:
        if not _blocks(page):
            continue
        marks = [pytest.mark.slow] if page.name in SLOW_PAGES else []
        params.append(pytest.param(page, id=_page_id(page), marks=marks))
    return params


def _commands(block: str):
    """The shell commands of a block: one per line (``\\`` continues a line), split at ``&&``."""
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            yield from (c.strip() for c in line.split("&&"))


def _skip_reason(command: str):
    return next((why for prefix, why in SKIPPED_COMMANDS.items() if command.startswith(prefix)), None)


def _env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _prepare_fixtures(blocks, cwd: Path) -> list:
    runnable = "\n".join(code for _, code, _ in blocks)
    made = []
    for path, write in FIXTURES.items():
        if path in runnable:
            write(cwd / path)
            made.append(path)
    return made


# --------------------------------------------------------------------------- #
# the tests
# --------------------------------------------------------------------------- #


def _run_shell(command: str, page: str, cwd: Path) -> None:
    why = _skip_reason(command)
    if why is not None:
        print(f"{page}: not run: {command!r} ({why})")
        return
    result = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, (
        f"{page}: `{command}` exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    )


def _run_distributed(page: Path, blocks, nproc: int, cwd: Path) -> None:
    assert all(expected is None for _, _, expected in blocks), f"{page.name}: a distributed page cannot claim output"
    script = cwd / "docs_page.py"
    code = "\n\n".join(code for kind, code, _ in blocks if kind == "python")
    # Once the page's code has run, skip interpreter teardown: gloo's worker threads
    # sometimes abort it ("terminate called without an active exception", about 1 run
    # in 10 on torch 2.13, after destroy_process_group); tests/tp_checks.py does the same.
    script.write_text(code + "\n\nimport os, sys\nsys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(script)],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, (
        f"{page.name} under {nproc} ranks exited {result.returncode}\nstdout:\n{result.stdout}\n"
        f"stderr:\n{result.stderr[-6000:]}"
    )
    for command in (c for kind, code, _ in blocks if kind == "shell" for c in _commands(code)):
        _run_shell(command, page.name, cwd)


@pytest.mark.parametrize("page", _page_params())
def test_doc_blocks_run_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(page)
    _prepare_fixtures(blocks, tmp_path)
    nproc = _NPROC.search(page.read_text())
    if nproc:
        _run_distributed(page, blocks, int(nproc.group(1)), tmp_path)
        return
    namespace: dict = {"__name__": "__doc_example__"}
    for n, (kind, code, expected) in enumerate(blocks):
        if kind == "shell":
            for command in _commands(code):
                _run_shell(command, page.name, tmp_path)
            continue
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"{page.name}[block {n}]", "exec"), namespace)
        if expected is not None:
            assert buffer.getvalue().strip() == expected.strip(), f"{page.name} block {n} printed:\n{buffer.getvalue()}"


def test_discovery_finds_every_runnable_block(tmp_path):
    """The rules above on a page written here: tags, order, Output, skips, fixtures."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)\n```\n\nOutput:\n\n```\n1\n```\n\n```bash\npip install x && python -m torch_bq -h\n"
        "torchrun -m y  # launch\n```\n\n```sh\npython -c 'print(2)' \\\n  --flag\n```\n\n```text\nnot run\n```\n"
        "```python\nopen('path/to/model/model.safetensors')\n```\n"
    )
    blocks = _blocks(page)
    assert [(kind, expected) for kind, _, expected in blocks] == [
        ("python", "1\n"), ("shell", None), ("shell", None), ("python", None)
    ]
    commands = [c for kind, code, _ in blocks if kind == "shell" for c in _commands(code)]
    assert commands == ["pip install x", "python -m torch_bq -h", "torchrun -m y", "python -c 'print(2)'    --flag"]
    assert [_skip_reason(c) is not None for c in commands] == [True, False, True, False]
    assert _prepare_fixtures(blocks, tmp_path) == ["path/to/model"]
    assert (tmp_path / "path/to/model/model.safetensors").is_file()


def test_slow_pages_exist():
    """A renamed page must not silently leave the slow list (and so run in the fast set)."""
    assert SLOW_PAGES <= {page.name for page in PAGES}


def test_checkpoints_inspect_transcript_is_real(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "checkpoints.md").read_text()
    _, code, _ = _blocks(DOCS / "checkpoints.md")[0]  # writes ds_v3_tiny/
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__doc_example__"})
    transcript = next(m.group(2) for m in _FENCE.finditer(text) if "$ python -m torch_bq inspect ds_v3_tiny" in m.group(2))
    expected = transcript.split("\n", 1)[1]
    from torch_bq import cli

    assert cli.inspect_main(["ds_v3_tiny", "-q"]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
