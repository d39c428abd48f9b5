"""`ModelSpec` (what is trained, one micro-batch's shape) and `Layout` (how it is split over GPUs)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["Layout", "ModelSpec"]

#: Megatron pads the vocabulary to a multiple of this many entries per TP rank
#: (`--make-vocab-size-divisible-by`, default 128).
VOCAB_DIVISIBLE_BY = 128


def _positive_int(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


def _get(config: Any, *names, default=None):
    """The first of `names` that `config` (a mapping or an object) has and is not None."""
    for n in names:
        v = config.get(n) if isinstance(config, Mapping) else getattr(config, n, None)
        if v is not None:
            return v
    return default


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer and the shape of one micro-batch.

    Args:
        layers: transformer layers.
        hidden: model width h.
        ffn: MLP width (of one of the two gated branches for a gated MLP).
        heads: attention (query) heads.
        vocab: vocabulary size (padded as megatron pads it, `padded_vocab`).
        seq: tokens per sequence s.
        micro_batch: sequences per micro-batch b.
        kv_heads: key/value heads (grouped-query attention); None: `heads`.
        gated_mlp: a gated MLP (SwiGLU: fc1 is 2 x ffn wide, fc2 ffn -> h).
        parallel_embedding: vocabulary-parallel embedding and output layer (megatron's: the
            embedding all-reduces its output, the output layer all-reduces its input's gradient);
            False: both replicated, no communication (taco_triton.examples' TinyGPT).
        dtype: the dtype activations and their gradients are communicated in.
        compute_dtype: the dtype of the activations the layers compute in (their non-GEMM
            passes move it, and a TP message in another dtype is cast down and up around its
            collective; None: `dtype`).
        name: a label.

    Raises:
        ValueError: a size that is not a positive int, or heads that do not divide hidden.
    """

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    seq: int
    micro_batch: int
    kv_heads: int | None = None
    gated_mlp: bool = False
    parallel_embedding: bool = True
    dtype: torch.dtype = torch.bfloat16
    compute_dtype: torch.dtype | None = None
    name: str = ""

    def __post_init__(self):
        for n in ("layers", "hidden", "ffn", "heads", "vocab", "seq", "micro_batch"):
            _positive_int("ModelSpec", n, getattr(self, n))
        if self.kv_heads is not None:
            _positive_int("ModelSpec", "kv_heads", self.kv_heads)
        if self.hidden % self.heads:
            raise ValueError(f"ModelSpec: heads ({self.heads}) must divide hidden ({self.hidden})")

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): kv_heads x head dim."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch, b x s."""
        return self.micro_batch * self.seq

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of 128 x `tp` (megatron's default).

        Args:
            tp: the tensor-parallel degree.

        Returns:
            The padded size.
        """
        m = VOCAB_DIVISIBLE_BY * tp
        return -(-self.vocab // m) * m

    def layer_params(self) -> int:
        """Weights of one layer.

        Returns:
            The weights of its four linear layers (norms and biases left out).
        """
        h = self.hidden
        return h * (h + 2 * self.kv_dim) + h * h + (3 if self.gated_mlp else 2) * h * self.ffn

    def layer_flops(self) -> float:
        """Forward FLOPs of one layer for one micro-batch.

        Returns:
            The GEMMs' FLOPs (2 per multiply-add) and attention's two batched products,
            4 b s^2 h (no causal saving). A GPT layer (ffn = 4h, no GQA, no gating) gives
            24 b s h^2 + 4 b s^2 h.
        """
        return 2.0 * self.tokens * self.layer_params() + 4.0 * self.micro_batch * self.seq ** 2 * self.hidden

    def layer_elementwise_elements(self, tp: int, sequence_parallel: bool = False) -> tuple[float, float]:
        """Elements one layer's non-GEMM passes read and write for one micro-batch on one TP rank,
        (forward, backward): each pass unfused, as PyTorch and megatron run them.

        Per token, forward: the two norms (read h, write h), the two residual adds (read 2h,
        write h), the attention output's change of layout (read and write h / tp: heads to
        rows) and the MLP's activation (read and write ffn / tp; gated: read 2 ffn / tp).
        Backward: each norm reads its input and the gradient and writes the input's gradient
        (3h), each residual sums the gradients of its two branches (3h), the layout change
        again (2h / tp) and the activation's gradient (read input and gradient, write the
        input's gradient: 3 ffn / tp; gated: 5 ffn / tp). The norms and residuals run on every
        token of a TP rank, or on tokens / tp under sequence parallelism. Left out: biases (in
        the GEMMs' epilogues), dropout, softmax (inside the attention kernel).

        Args:
            tp: the tensor-parallel degree.
            sequence_parallel: megatron's sequence parallelism.

        Returns:
            (forward elements, backward elements).
        """
        h, f = self.hidden, self.ffn
        replicated = self.tokens / (tp if sequence_parallel else 1)
        split = self.tokens / tp
        act_fwd, act_bwd = (3, 5) if self.gated_mlp else (2, 3)
        fwd = replicated * (2 * 2 * h + 2 * 3 * h) + split * (2 * h + act_fwd * f)
        bwd = replicated * (2 * 3 * h + 2 * 3 * h) + split * (2 * h + act_bwd * f)
        return fwd, bwd

    def edge_elementwise_elements(self, tp: int, sequence_parallel: bool, first: bool, last: bool) -> tuple[float, float]:
        """Elements the first stage's embedding and the last stage's final norm and loss read and
        write for one micro-batch on one TP rank, (forward, backward).

        Embedding: the lookup writes h per token and the position add reads 2h and writes h;
        backward, the lookup's gradient reads and writes h, the positions' reads h. Final norm
        as a layer's (2h, 3h); the loss's softmax over the logits each rank holds (the
        vocabulary, or its 1 / tp share when parallel): read and write them forward, read the
        softmax and the gradient and write the logits' gradient backward.

        Args:
            tp: the tensor-parallel degree.
            sequence_parallel: megatron's sequence parallelism (the embedding and final norm on
                tokens / tp).
            first: the stage holds the embedding.
            last: the stage holds the final norm and the loss.

        Returns:
            (forward elements, backward elements).
        """
        h = self.hidden
        local = self.tokens / (tp if sequence_parallel else 1)
        v = self.padded_vocab(tp) // tp if self.parallel_embedding else self.vocab
        fwd = first * local * 4 * h + last * (local * 2 * h + self.tokens * 2 * v)
        bwd = first * local * 3 * h + last * (local * 3 * h + self.tokens * 3 * v)
        return fwd, bwd

    def output_flops(self, tp: int) -> float:
        """Forward FLOPs of the output layer (logits) for one micro-batch, over the padded
        vocabulary when it is parallel, the vocabulary itself when replicated.

        Args:
            tp: the tensor-parallel degree.

        Returns:
            The FLOPs of the whole layer (not divided by `tp`).
        """
        v = self.padded_vocab(tp) if self.parallel_embedding else self.vocab
        return 2.0 * self.tokens * self.hidden * v

    @classmethod
    def from_hf_config(cls, config: Mapping | str | os.PathLike, seq: int, micro_batch: int, **kwargs) -> "ModelSpec":
        """From a Hugging Face `config.json` (Llama, Qwen2, Mistral: `hidden_size`,
        `intermediate_size`, `num_key_value_heads`, a gated MLP for the SiLU family; GPT-2:
        `n_embd`, `n_layer`, `n_head`, `n_inner`).

        Args:
            config: the parsed dict, or the path of config.json.
            seq: tokens per sequence.
            micro_batch: sequences per micro-batch.
            **kwargs: other `ModelSpec` fields, replacing what the config gives.

        Returns:
            The `ModelSpec`.

        Raises:
            ValueError: the config lacks the model's sizes.
        """
        if not isinstance(config, Mapping):
            with open(config) as f:
                config = json.load(f)
        hidden = _get(config, "hidden_size", "n_embd", "d_model")
        layers = _get(config, "num_hidden_layers", "n_layer", "num_layers")
        heads = _get(config, "num_attention_heads", "n_head")
        vocab = _get(config, "vocab_size")
        if None in (hidden, layers, heads, vocab):
            raise ValueError("config lacks the model's sizes (hidden_size/n_embd, num_hidden_layers/n_layer, "
                             f"num_attention_heads/n_head, vocab_size): keys {sorted(config)}")
        act = str(_get(config, "hidden_act", "activation_function", default="gelu"))
        fields = dict(layers=int(layers), hidden=int(hidden), heads=int(heads), vocab=int(vocab),
                      ffn=int(_get(config, "intermediate_size", "n_inner", default=4 * hidden)),
                      kv_heads=_get(config, "num_key_value_heads"), gated_mlp=act in ("silu", "swish", "swiglu"),
                      seq=seq, micro_batch=micro_batch, name=str(_get(config, "model_type", default="")))
        fields.update(kwargs)
        return cls(**fields)

    @classmethod
    def from_megatron_args(cls, args: Mapping | Any, **kwargs) -> "ModelSpec":
        """From megatron's arguments (an argparse Namespace or a dict): `num_layers`,
        `hidden_size`, `ffn_hidden_size`, `num_attention_heads`, `num_query_groups` (with
        `group_query_attention`), `padded_vocab_size` or `vocab_size`, `seq_length`,
        `micro_batch_size`, `swiglu`.

        Args:
            args: the arguments.
            **kwargs: other `ModelSpec` fields, replacing what the arguments give.

        Returns:
            The `ModelSpec`.

        Raises:
            ValueError: a size missing.
        """
        hidden = _get(args, "hidden_size")
        fields = dict(layers=_get(args, "num_layers"), hidden=hidden, heads=_get(args, "num_attention_heads"),
                      ffn=_get(args, "ffn_hidden_size", default=4 * hidden if hidden else None),
                      vocab=_get(args, "padded_vocab_size", "vocab_size"), seq=_get(args, "seq_length"),
                      micro_batch=_get(args, "micro_batch_size"), gated_mlp=bool(_get(args, "swiglu", default=False)),
                      kv_heads=_get(args, "num_query_groups") if _get(args, "group_query_attention") else None)
        fields.update(kwargs)
        missing = sorted(k for k, v in fields.items() if v is None and k != "kv_heads")
        if missing:
            raise ValueError(f"megatron arguments lack {missing}")
        return cls(**fields)


@dataclass(frozen=True)
class Layout:
    """How a step is split over tp x pp x dp GPUs (megatron's rank order: TP ranks adjacent,
    then DP, then PP), and which overlaps run.

    Args:
        tp: tensor-parallel degree.
        pp: pipeline stages.
        dp: data-parallel degree.
        sequence_parallel: megatron's sequence parallelism (all-gather / reduce-scatter instead
            of all-reduce).
        micro_batches: micro-batches per step on each pipeline (global batch / (micro_batch x dp)).
        virtual_pp: model chunks per stage (interleaved 1F1B); 1: plain 1F1B.
        overlap_grad_reduce: DP gradient reductions run under the backward pass (megatron's
            `--overlap-grad-reduce`; off by default there, as here).
        tp_comm_overlap: TP communication overlaps the GEMMs (megatron's userbuffers).
        distributed_optimizer: gradients reduce-scattered and parameters all-gathered over DP
            (megatron's distributed optimizer) instead of all-reduced.
        overlap_param_gather: the parameter all-gather runs under the next forward.
        grad_reduce_in_fp32: gradients reduced in FP32 (else the communication dtype).
        bucket_elems: gradient elements per DP bucket (megatron's default 40M).
        sp_regather: under sequence parallelism, re-gather each column-parallel layer's input in
            backward for its weight gradient (megatron-core does; taco_triton.parallel's layers
            keep the gathered input instead).

    Raises:
        ValueError: a degree or count that is not a positive int.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    micro_batches: int = 1
    virtual_pp: int = 1
    overlap_grad_reduce: bool = False
    tp_comm_overlap: bool = False
    distributed_optimizer: bool = False
    overlap_param_gather: bool = False
    grad_reduce_in_fp32: bool = False
    bucket_elems: int = 40_000_000
    sp_regather: bool = True

    def __post_init__(self):
        for n in ("tp", "pp", "dp", "micro_batches", "virtual_pp", "bucket_elems"):
            _positive_int("Layout", n, getattr(self, n))

    @property
    def gpus(self) -> int:
        """tp x pp x dp."""
        return self.tp * self.pp * self.dp

    def stage_layers(self, layers: int) -> list[int]:
        """Layers on each pipeline stage (megatron's even split; a remainder goes to the first
        stages).

        Args:
            layers: the model's layers.

        Returns:
            One count per stage.

        Raises:
            ValueError: fewer layers than stages x virtual_pp.
        """
        chunks = self.pp * self.virtual_pp
        if layers < chunks:
            raise ValueError(f"{layers} layers cannot fill {self.pp} stages x {self.virtual_pp} virtual stages")
        base, extra = divmod(layers, self.pp)
        return [base + (s < extra) for s in range(self.pp)]

    @classmethod
    def from_megatron_args(cls, args: Mapping | Any, world_size: int, **kwargs) -> "Layout":
        """From megatron's arguments: `tensor_model_parallel_size`, `pipeline_model_parallel_size`,
        `sequence_parallel`, `global_batch_size`, `micro_batch_size`,
        `num_layers_per_virtual_pipeline_stage`, `overlap_grad_reduce`, `tp_comm_overlap`,
        `use_distributed_optimizer`, `overlap_param_gather`, `accumulate_allreduce_grads_in_fp32`.

        Args:
            args: the arguments (a Namespace or a dict).
            world_size: GPUs in the job.
            **kwargs: other `Layout` fields, replacing what the arguments give.

        Returns:
            The `Layout`.

        Raises:
            ValueError: a world size that tp x pp does not divide, or a global batch that
                micro_batch x dp does not divide.
        """
        tp = int(_get(args, "tensor_model_parallel_size", default=1))
        pp = int(_get(args, "pipeline_model_parallel_size", default=1))
        if world_size % (tp * pp):
            raise ValueError(f"world_size {world_size} is not a multiple of tp x pp = {tp * pp}")
        dp = world_size // (tp * pp)
        mb, gb = _get(args, "micro_batch_size", default=1), _get(args, "global_batch_size")
        gb = mb * dp if gb is None else gb
        if gb % (mb * dp):
            raise ValueError(f"global_batch_size {gb} is not a multiple of micro_batch_size x dp = {mb * dp}")
        layers, per_virtual = _get(args, "num_layers"), _get(args, "num_layers_per_virtual_pipeline_stage")
        virtual = layers // (pp * per_virtual) if layers and per_virtual else 1
        fields = dict(tp=tp, pp=pp, dp=dp, sequence_parallel=bool(_get(args, "sequence_parallel", default=False)),
                      micro_batches=gb // (mb * dp), virtual_pp=max(1, virtual),
                      overlap_grad_reduce=bool(_get(args, "overlap_grad_reduce", default=False)),
                      tp_comm_overlap=bool(_get(args, "tp_comm_overlap", default=False)),
                      distributed_optimizer=bool(_get(args, "use_distributed_optimizer", default=False)),
                      overlap_param_gather=bool(_get(args, "overlap_param_gather", default=False)),
                      grad_reduce_in_fp32=bool(_get(args, "accumulate_allreduce_grads_in_fp32", default=False)))
        fields.update(kwargs)
        return cls(**fields)

    def bubble_fraction(self) -> float:
        """The idle share of the 1F1B schedule relative to its useful work.

        Returns:
            (pp - 1) / (virtual_pp x micro_batches).
        """
        return (self.pp - 1) / (self.virtual_pp * self.micro_batches)
