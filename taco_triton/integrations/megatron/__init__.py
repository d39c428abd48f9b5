"""Route megatron-core's tensor-parallel (TP), pipeline-parallel (PP) and data-parallel (DP)
communication through taco_triton's compressed collectives.

Two modes, one at a time:

- `enable` (the mappings mode) replaces megatron-core's communication functions: TP collectives,
  pipeline send/recv and DDP's gradient reductions, decided per message by a policy at sites
  named after megatron's roles; it works on a model that already exists.
- `enable_groups` (the group mode) replaces megatron's process groups in ``parallel_state`` by
  compressing ones (`taco_triton.compressed_group`) before the model is built, which also reaches
  code that talks to the group directly, such as TransformerEngine's layers; pick it for
  ``--transformer-impl transformer_engine``.

    from taco_triton.integrations import megatron as taco_megatron
    from taco_triton.parallel import CompressionPolicy

    with taco_megatron.enable(CompressionPolicy(exempt=["*.output_layer.*"]), model=gpt):
        loss = gpt(tokens, position_ids, attention_mask, labels=labels)
        loss.mean().backward()

Importing this package does not import megatron; `enable` and `enable_groups` do, and raise
ImportError naming what to install (``pip install 'megatron-core==0.16.1'``, the ``megatron``
extra) when it is missing. `cpu_compat` lets megatron-core run on a CPU-only torch.

Modules: `mappings_mode` (`enable`, `MegatronHandle`), `tp`, `pp` and `dp` (each axis's routing
and site names; `dp` also `gradient_policy`, `pp` `pipeline_policy`), `error_feedback` (DP), `patching` (the patch points
and replacements), `group_mode` (`enable_groups`, `GroupsHandle`), `cpu` (`cpu_compat`),
`common` (the supported release, `AXES`, `SiteStats`).
"""
from __future__ import annotations

from .common import AXES, SiteStats
from .common import EXTRA as EXTRA, TESTED_VERSION as TESTED_VERSION  # public, outside __all__ as before
from .mappings_mode import MegatronHandle, enable, active_handle
from .dp import GRADIENT_CONFIG, gradient_policy
from .pp import PIPELINE_CONFIG, pipeline_policy
from .group_mode import GROUP_GLOBALS as GROUP_GLOBALS, GroupsHandle, enable_groups
from .cpu import cpu_compat

__all__ = ["AXES", "GRADIENT_CONFIG", "GroupsHandle", "MegatronHandle", "PIPELINE_CONFIG", "SiteStats", "active_handle",
           "cpu_compat", "enable", "enable_groups", "gradient_policy", "pipeline_policy"]

