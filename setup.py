import platform
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'^__version__ = "(.+)"$', Path("torch_bq/__init__.py").read_text(), re.M).group(1)
# The ISA levels and their flags, shared with the run-time loader (imports nothing).
isa = runpy.run_path("torch_bq/ops/cpu/isa.py")
# The sources of each level's library (the JIT fallback builds the same list).
SOURCES = tuple(Path("torch_bq/ops/cpu", name) for name in isa["SOURCES"])


def cpu_kernel_extensions():
    """The CPU kernels, one library per ISA level, built here at install time.

    Empty (the kernels are then built on first use, or the reference runs) when
    torch's extension builder or a C++ compiler is missing. A level whose flags
    the compiler rejects is left out; the loader then picks the best one built.
    """
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    compiler = shutil.which("c++")
    if compiler is None:
        print("torch_bq: no C++ compiler; the CPU kernels will be built on first use", file=sys.stderr)
        return [], {}
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    extensions = []
    for level in isa["LEVELS"]:
        flags = isa["compile_flags"](level)
        if level in isa["X86_ONLY"] and not x86:
            continue
        probe = subprocess.run([compiler, *flags, "-x", "c++", "-E", "-"], input="", capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"torch_bq: {compiler} rejects the {level} flags; that level is not built", file=sys.stderr)
            continue
        # One stub per level and source (each includes that source), so the levels'
        # object files do not overwrite each other in the shared build directory.
        stubs = []
        for source in SOURCES:
            stub = Path("build", "torch_bq_kernels", f"{level}_{source.stem}.cpp")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text(f'#include "{source.resolve()}"\n')
            stubs.append(str(stub))
        extensions.append(
            CppExtension(
                name=f"torch_bq.ops.cpu.{isa['module_name'](level, torch.__version__)}",
                sources=stubs,
                extra_compile_args=flags,
                extra_link_args=list(isa["LINK_FLAGS"]),
            )
        )

    class BuildKernels(BuildExtension.with_options(use_ninja=False)):
        """Builds the levels in parallel: one compiler process each (ninja's build file would be
        shared between them)."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel is None:
                self.parallel = True

    return extensions, {"build_ext": BuildKernels}


ext_modules, cmdclass = cpu_kernel_extensions()

setup(
    name="torch_bq",
    version=version,
    description="Block-quantized (fp8 / fp4) linear layers and a speculative-decoding drafter as PyTorch custom ops",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_bq", "torch_bq.*"]),
    # The kernel source ships too: the JIT fallback builds from it when a library is missing.
    package_data={"torch_bq.ops.cpu": ["*.cpp", "*.h"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    python_requires=">=3.10",
    # The lower bound is the first release with float8_e8m0fnu and float4_e2m1fn_x2.
    # ninja: torch.utils.cpp_extension's build tool for the CPU kernels.
    install_requires=["torch>=2.7,<2.15", "numpy", "safetensors>=0.4", "ninja"],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6.100", "ml_dtypes>=0.5"],
        "bench": ["matplotlib"],
        # torch_bq.hf: the transformers quantizer (the only module that imports transformers).
        # 5.x: the HfQuantizer / conversion-ops loading API torch_bq.hf plugs into.
        "hf": ["transformers>=5.23,<6"],
        # The Neuron SDK (nki, torch-neuronx) comes from AWS's own package index;
        # the same-named PyPI packages are empty placeholders, so nothing is listed.
        "neuron": [],
    },
)
