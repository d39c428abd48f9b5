"""What every part of the megatron integration shares: the supported release and how megatron-core is
imported, the parallel axes, the per-site counters, and which mode's handle is active."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from ...config import CompressionConfig
from ...policy import CompressionPolicy

#: The pip extra that installs the supported megatron-core.
EXTRA = "pip install 'megatron-core==0.16.1' (taco-triton's `megatron` extra: pip install -e '.[megatron]' in a clone)"
#: The megatron-core release these patch points were read from.
TESTED_VERSION = "0.16.1"

AXES = ("tp", "pp", "dp")
"""The parallel axes a handle routes: tensor (TP collectives), pipeline (stage-boundary
send/recv), data (DDP gradient reduction and the distributed optimizer's parameter all-gather)."""

#: What a message the policy does not compress is sent with.
NATIVE = CompressionConfig(enabled=False)

#: The handle of each mode while it is enabled, else None: `mappings` (`enable`) and `groups`
#: (`enable_groups`); each mode refuses to start while the other is active.
ACTIVE = SimpleNamespace(mappings=None, groups=None)


@dataclass
class SiteStats:
    """Routed calls of one (site, direction, collective): how many, how many compressed, input bytes,
    wire bytes, and the axis ("tp", "pp" or "dp") the site belongs to."""

    calls: int = 0
    """Calls routed."""
    compressed: int = 0
    """Of those, calls sent compressed."""
    bytes: int = 0
    """Input bytes of those calls."""
    wire_bytes: float = 0.0
    """Bytes this rank handed to the process group for these calls (as `WireStats` counts them)."""
    axis: str = "tp"
    """The axis the site belongs to: "tp", "pp" or "dp"."""


def derived_policy(policy, config: CompressionConfig) -> CompressionPolicy:
    """An axis's policy derived from the user's: `config` as the default of every site (None when
    `policy.default` is None), `policy`'s `min_bytes`, `exempt`, `forward`, `backward`,
    `overrides` and `comm_dtype` as they are, no calibration fields; None: `config` everywhere."""
    if policy is None:
        return CompressionPolicy(default=config)
    return CompressionPolicy(default=config if policy.default is not None else None, min_bytes=policy.min_bytes,
                             exempt=list(getattr(policy, "exempt", ())), forward=getattr(policy, "forward", True),
                             backward=getattr(policy, "backward", True), overrides=dict(getattr(policy, "overrides", {})),
                             comm_dtype=getattr(policy, "comm_dtype", None))


def _needs_megatron(e: ImportError) -> ImportError:
    return ImportError(
        f"taco_triton.integrations.megatron needs megatron-core (tested with {TESTED_VERSION}): {EXTRA}"
        f" ({type(e).__name__}: {e})"
    )


def import_megatron():
    """megatron-core's modules holding the mappings mode's patch points: (mappings, layers,
    p2p_communication, param_and_grad_buffer). Raises ImportError naming the extra to install."""
    try:
        from megatron.core.distributed import param_and_grad_buffer
        from megatron.core.pipeline_parallel import p2p_communication
        from megatron.core.tensor_parallel import layers, mappings
    except ImportError as e:
        raise _needs_megatron(e) from e
    return mappings, layers, p2p_communication, param_and_grad_buffer


def import_parallel_state():
    """megatron-core's ``parallel_state`` (the group mode's patch points); ImportError as above."""
    try:
        from megatron.core import parallel_state
    except ImportError as e:
        raise _needs_megatron(e) from e
    return parallel_state


def megatron_version() -> str:
    try:
        from megatron.core import package_info

        return str(package_info.__version__)
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"
