"""`cpu_compat`: lets megatron-core run on a CPU-only torch build (gloo process groups), for tests and
the CPU examples; it changes nothing where CUDA is available."""
from __future__ import annotations

import contextlib
from typing import Any

import torch


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _no_op(*args, **kwargs) -> None:
    return None


class _CpuDeviceTorch:
    """`torch` as megatron's pipeline schedules see it in `cpu_compat`: tensors they create with
    ``device="cuda"`` (token counters) land on the CPU; everything else is torch's."""

    _FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor"})

    def __getattr__(self, name: str) -> Any:
        fn = getattr(torch, name)
        if name not in self._FACTORIES:
            return fn

        def on_cpu(*args, **kwargs):
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return fn(*args, **kwargs)

        return on_cpu


@contextlib.contextmanager
def cpu_compat():
    """Let megatron-core run on a CPU-only torch build (gloo process groups): tests, CPU examples.

    megatron-core allocates buffers with ``device=torch.cuda.current_device()``, which raises on a
    CPU-only build. Inside this context ``torch.cuda.current_device`` returns
    ``torch.device("cpu")`` and ``torch.cuda.synchronize`` does nothing (the pipeline's p2p code
    calls it), and megatron's pipeline schedules (``pipeline_parallel/schedules.py``, which
    create tensors with ``device="cuda"``) see a ``torch`` that puts those on the CPU. On exit
    the originals are put back. When CUDA is available it changes nothing.

    The other things megatron-core needs on CPU are arguments, not patches:
    ``TransformerConfig(use_cpu_initialization=True, gradient_accumulation_fusion=False, ...)``;
    ``model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)`` (the default tracker
    saves CUDA RNG states); an explicit ``attention_mask`` for GPTModel (the default causal mask
    is built with ``device="cuda"``); and no sequence parallelism in models with megatron's
    torch LayerNorm wrapper ("sequence parallel not supported by torch LayerNorm"). Set
    ``CUDA_DEVICE_MAX_CONNECTIONS=1`` to silence megatron's overlap warning.

    Yields:
        Nothing; the patches hold until the block ends.
    """
    if torch.cuda.is_available():
        yield
        return
    saved = [(torch.cuda, "current_device", _cpu_current_device), (torch.cuda, "synchronize", _no_op)]
    try:
        from megatron.core.pipeline_parallel import schedules

        saved.append((schedules, "torch", _CpuDeviceTorch()))
    except ImportError:  # without megatron-core there is nothing else to adapt
        pass
    saved = [(obj, attr, getattr(obj, attr), new) for obj, attr, new in saved]
    for obj, attr, _, new in saved:
        setattr(obj, attr, new)
    try:
        yield
    finally:
        for obj, attr, orig, _ in reversed(saved):
            setattr(obj, attr, orig)
