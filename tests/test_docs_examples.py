"""The Python examples in docs/ run as written, and print what the docs say they print.

Each page's ```python blocks run in order in one namespace, in a fresh directory
(the examples write their own fixture files). A block followed by an "Output:"
paragraph and a plain code block must print exactly that text.
"""

import contextlib
import io
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"

_FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)


def _examples(page: Path):
    """``[(code, expected_output_or_None)]`` for each python block of ``page``."""
    text = page.read_text()
    fences = list(_FENCE.finditer(text))
    out = []
    for i, m in enumerate(fences):
        if m.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences) and fences[i + 1].group(1) == "":
            between = text[m.end(): fences[i + 1].start()]
            if re.fullmatch(r"\s*Output[^\n]*:\s*", between):
                expected = fences[i + 1].group(2)
        out.append((m.group(2), expected))
    return out


@pytest.mark.parametrize("page", ["checkpoints.md", "modules.md", "formats.md"])
def test_doc_examples_run_and_print_what_they_claim(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__doc_example__"}
    examples = _examples(DOCS / page)
    assert examples, f"{page} has no python examples"
    for n, (code, expected) in enumerate(examples):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(compile(code, f"{page}[block {n}]", "exec"), namespace)
        if expected is not None:
            assert buffer.getvalue().strip() == expected.strip(), f"{page} block {n} printed:\n{buffer.getvalue()}"


def test_checkpoints_inspect_transcript_is_real(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    text = (DOCS / "checkpoints.md").read_text()
    code, _ = _examples(DOCS / "checkpoints.md")[0]  # writes ds_v3_tiny/
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {"__name__": "__doc_example__"})
    transcript = next(m.group(2) for m in _FENCE.finditer(text) if "$ python -m torch_bq inspect ds_v3_tiny" in m.group(2))
    expected = transcript.split("\n", 1)[1]
    from torch_bq import cli

    assert cli.inspect_main(["ds_v3_tiny", "-q"]) == 0
    assert capsys.readouterr().out.strip() == expected.strip()
