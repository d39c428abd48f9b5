"""Train a small Llama-style model with PyTorch's tensor parallelism (DTensor), communication
uncompressed vs compressed.

    python -m taco_triton.examples.train_dtensor --tp 2 --compress none,fp8,int8 --steps 300

The model (RMSNorm, rotary attention, SwiGLU, byte vocabulary) is parallelized by
`torch.distributed.tensor.parallel.parallelize_module` with the plan torchtitan's earlier releases
used for Llama, turned into compressed styles by `taco_triton.integrations.dtensor.compress_plan`
under each mode's policy (mode "none" runs the same styles with every site native, so its wire
bytes are counted alike); the model and the plan are in `taco_triton.examples.llama`. Data,
optimizer (AdamW on FP32 master weights), logging and the summary are `train_gpt`'s: this command
is `python -m taco_triton.examples.train_gpt --dtensor`. `--sequence-parallel` uses the plan's
sequence-parallel variant.

Not in wire_bytes in any mode (left to DTensor, native): the token embedding's output reduction
and the gradient reduction of replicated norm weights under sequence parallelism.
"""
from __future__ import annotations

import sys

from taco_triton.examples import train_gpt
# The model and plan live in `llama` (train_gpt imports them from there); named here too, as
# before that split.
from taco_triton.examples.llama import (  # noqa: F401
    Attention,
    Block,
    FeedForward,
    TinyLlama,
    build_model,
    parallelize,
    rope_table,
    rotate,
    tp_plan,
)


def main(argv=None):
    cli = train_gpt.parser(prog="python -m taco_triton.examples.train_dtensor", doc=__doc__)
    return train_gpt.main(["--dtensor", *(sys.argv[1:] if argv is None else argv)], cli=cli)


if __name__ == "__main__":
    main()
