"""Integrations of taco_triton's compressed collectives into training frameworks.

Each integration lives in its own module and imports its framework lazily, so importing this
package (or an integration module) never requires the framework:

- `taco_triton.integrations.megatron`: routes megatron-core's tensor-parallel communication
  through `taco_triton.all_reduce/reduce_scatter/all_gather` under a `CompressionPolicy`
  (extra ``megatron``: ``pip install -e '.[megatron]'`` in a clone).
"""

__all__: list[str] = []
