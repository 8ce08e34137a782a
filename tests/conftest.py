import os

from hypothesis import HealthCheck, settings

# One fixed, derandomized profile so CI runs the same examples every time.
settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser):
    # Read by tests/neuron/conftest.py: which NKI runs the kernel tests.
    parser.addoption(
        "--nki-backend",
        choices=("auto", "shim", "simulate"),
        default="auto",
        help="NKI kernel tests: 'shim' = NumPy stand-in (tests/nki_shim), 'simulate' = the real SDK's "
        "nki.simulate, 'auto' (default) = simulate if the Neuron SDK is importable, else shim",
    )
