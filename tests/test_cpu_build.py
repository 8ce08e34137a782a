"""The first build of the CPU kernels under faults: a killed build never hangs the next process,
and a process that waits too long for another one's build runs the reference instead."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_bq.ops import _backend

ROOT = Path(__file__).resolve().parents[1]

# One op call that needs the JIT-built generic kernels (no install-time library is looked for).
FIRST_CALL = """
import torch
from pathlib import Path
from torch_bq import formats, ops
from torch_bq.ops import _backend
_backend.INSTALLED_DIR = Path("/nonexistent")
_backend.set_cpu_isa_cap("generic")
p, s = formats.quantize_fp4(torch.randn(8, 64))
x = torch.randn(2, 64)
from torch_bq import reference
from torch_bq.testing import assert_linear_close
y = ops.fp4_linear(x, p, s, out_dtype=torch.float32)
assert_linear_close(y, formats.qdq_fp8(x), formats.dequantize_fp4(p, s, 64, torch.float32))
info = ops.backend_info()["cpu"]
print(info["kernels"], info["source"])
"""


def environment(extensions_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != _backend.REQUIRE_ENV}
    env.update(TORCH_EXTENSIONS_DIR=str(extensions_dir), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)
    return env


def jit_paths(extensions_dir: Path, monkeypatch) -> tuple:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions_dir))
    return _backend._jit_paths("generic")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX file locks")
def test_a_build_held_too_long_falls_back_to_the_reference_with_one_line(tmp_path, monkeypatch):
    _, lock = jit_paths(tmp_path, monkeypatch)
    with _backend._exclusive(lock, 0) as held:  # another process is "building"
        assert held
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", FIRST_CALL],
            env=environment(tmp_path, TORCH_BQ_BUILD_TIMEOUT="1"),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        waited = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["reference", "None"]
    warning = [line for line in result.stderr.splitlines() if "torch_bq:" in line]
    assert len(warning) == 1 and "using the reference kernels" in warning[0] and "over 1 s" in warning[0], warning
    assert waited < 120


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals and file locks")
@pytest.mark.skipif(_backend.shutil.which("c++") is None, reason="needs a C++ compiler")
def test_a_killed_build_does_not_hang_the_next_process(tmp_path, monkeypatch):
    """SIGKILL during the build leaves torch's own ``lock`` file behind (torch's builder
    waits on it forever); the next process still builds and runs the fast kernels."""
    build_dir, _ = jit_paths(tmp_path, monkeypatch)
    torch_lock = build_dir / "lock"
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_CALL],
        env=environment(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the compiler it starts dies with it
    )
    try:
        deadline = time.monotonic() + 300
        while not torch_lock.exists():
            assert first.poll() is None, "the first process ended before its build started"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        time.sleep(1.0)  # the compiler is running
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    assert torch_lock.exists()  # what used to make every later process wait forever
    second = subprocess.run(
        [sys.executable, "-c", FIRST_CALL],
        env=environment(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.split() == ["fast", "built"]
