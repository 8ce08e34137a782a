import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'^__version__ = "(.+)"$', Path("torch_bq/__init__.py").read_text(), re.M).group(1)

setup(
    name="torch_bq",
    version=version,
    description="Block-quantized (fp8 / fp4) linear layers and a speculative-decoding drafter as PyTorch custom ops",
    long_description=Path("README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["torch_bq", "torch_bq.*"]),
    # The fast CPU kernels ship as source and are compiled on first use.
    package_data={"torch_bq.ops.cpu": ["*.cpp"]},
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
