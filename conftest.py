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


def _module_fixture_files(rootdir) -> set:
    """Test files that define a module-scoped fixture (a training run, a multi-rank session,
    compiled kernels): each must run on one worker, so that its fixture is built once."""
    import pathlib
    import re

    scoped = re.compile(r"@pytest\.fixture\([^)]*scope=[\"']module[\"']")
    root = pathlib.Path(rootdir)
    return {str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py") if scoped.search(p.read_text())}


def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`make test`): the tests of a file with a module-scoped fixture go to one
    worker together; every other test is scheduled on its own. (xdist's own `loadgroup` reads
    `xdist_group` markers into node ids, which pytest 9 no longer takes from `item._nodeid`.)"""
    from xdist.scheduler import LoadScopeScheduling

    grouped = _module_fixture_files(config.rootpath)

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if path in grouped else nodeid

    return ModuleFixtureScheduling(config, log)
