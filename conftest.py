"""Test set-up: Triton's interpreter on CPU, NaN-poisoned outputs, hypothesis profiles.

TACO_TEST_DEVICE=cuda (bench/gpu_check.sh) runs the same tests on a GPU with compiled kernels;
without a CUDA device it stops before collecting anything, with a message saying so (skipping
would report a GPU run that never happened as passed).
HYPOTHESIS_PROFILE=thorough runs the property tests with many more examples.
"""
import os

TEST_DEVICES = ("cpu", "cuda")
DEVICE = os.environ.get("TACO_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton.jit
os.environ["TACO_TRITON_POISON_ALLOC"] = "1"

from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "fast", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fast"))

import pytest  # noqa: E402


def pytest_configure(config):
    if DEVICE not in TEST_DEVICES:
        raise pytest.UsageError(f"TACO_TEST_DEVICE={DEVICE!r} is not supported; allowed: {list(TEST_DEVICES)}")
    if DEVICE == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise pytest.UsageError(
                f"TACO_TEST_DEVICE=cuda, but torch {torch.__version__} sees no CUDA device "
                f"(torch.version.cuda={torch.version.cuda}); unset TACO_TEST_DEVICE to test on CPU"
            )


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    import torch

    import taco_triton

    doctest_namespace.update(torch=torch, taco=taco_triton, **{n: getattr(taco_triton, n) for n in taco_triton.__all__})


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`), tests that use a module-scoped fixture (a training run,
    a megatron set-up, compiled kernels) go to one worker, so that fixture is built once."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        if any(d.scope == "module" for fds in defs.values() for d in fds):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
