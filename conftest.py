"""Test set-up: Triton's interpreter on CPU, NaN-poisoned outputs, hypothesis profiles.

TACO_TEST_DEVICE=cuda (bench/gpu_check.sh) runs the same tests on a GPU with compiled kernels.
HYPOTHESIS_PROFILE=thorough runs the property tests with many more examples.
"""
import os

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


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace):
    import torch

    import taco_triton

    doctest_namespace.update(torch=torch, taco=taco_triton, **{n: getattr(taco_triton, n) for n in taco_triton.__all__})
