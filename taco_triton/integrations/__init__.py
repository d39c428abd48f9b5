"""Integrations of taco_triton's compressed collectives into training frameworks.

Each integration lives in its own module and imports its framework lazily, so importing this
package (or an integration module) never requires the framework:

- `taco_triton.integrations.megatron`: routes megatron-core's tensor-parallel communication
  through `taco_triton.all_reduce/reduce_scatter/all_gather` under a `CompressionPolicy`
  (extra ``megatron``: ``pip install -e '.[megatron]'`` in a clone).
- `taco_triton.integrations.process_group`: a torch.distributed process group that compresses
  what a policy selects and forwards everything else to an inner group (`taco_triton.compressed_group`),
  for frameworks that talk to a process group directly (TransformerEngine, FSDP2, DTensor, DDP).
- `taco_triton.integrations.sites`: module hooks that name the site of a process-group call.
"""

__all__: list[str] = []
