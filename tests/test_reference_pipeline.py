"""The reference's pipeline functions against its stage functions, bit for bit.

`compress_reference`, `decompress_reference` and `reduce_reference` take faster routes than the
stages (see reference.py); here the stages are composed the plain way, one per step, and every
byte and output bit must agree: every codec x G x Hadamard x scales x rounding x input dtype, on
inputs with partial super-blocks and groups, zero groups, NaN/Inf, subnormal and huge values.
A second test checks that a group's bits never depend on how a tensor is sliced into
super-block-aligned pieces (what the collectives' pipeline depth does).
"""
import contextlib
import itertools

import pytest
import torch

import taco_triton as taco
from taco_triton import reference as ref
from taco_triton.config import CODEC_SPECS, CODECS, GROUP_SIZES, SUPERBLOCK_ELEMS
from taco_triton.layout import WireLayout

from .helpers import DTYPES, SUB_BYTE_GROUP_SIZES, cfg_id

CONFIGS = [
    taco.CompressionConfig(codec=c, group_size=g, hadamard=h, scales=s, rounding=r, seed=7)
    for c, g, h, s, r in itertools.product(
        CODECS, GROUP_SIZES, (False, True), ("dual", "taco_fp32x2"), ("nearest", "stochastic"))
    if CODEC_SPECS[c].bits == 8 or g in SUB_BYTE_GROUP_SIZES
]


# --------------------------------------------------------------------------- the stages, composed
def _staged_quantize(y, finite, pre, cfg, numel):
    spec, layout = cfg.spec, WireLayout.of(numel, cfg)
    if cfg.scales == "dual":
        scale_a, scale_b, sigma = ref.dual_scales(y, finite, spec, layout.groups_per_superblock)
    else:
        scale_a, sigma = pre, ref.taco_scales(y, finite, spec)
        scale_b = sigma
    v = ref.scale_to_codes(y, sigma, spec)
    if cfg.stochastic:
        idx = torch.arange(v.numel(), dtype=torch.int64).view_as(v)
        codes = ref.encode_codes_bits(v, spec, "stochastic", ref.random_bits(cfg.seed, idx))
    else:
        codes = ref.encode_codes(v, spec)
    data = torch.zeros(layout.nbytes, dtype=torch.uint8)
    c, a, b = layout.split(data)
    c.copy_(ref.pack_codes(codes, spec.bits))
    a.copy_(scale_a)
    b.copy_(scale_b)
    return data


def _staged_compress(x, cfg):
    groups = ref.to_groups(x, cfg.group_size)
    finite = ref.group_finite(groups)
    pre = None
    if cfg.scales == "taco_fp32x2":
        pre = ref.taco_prescale(ref.mean_square(groups), finite, cfg.spec)
        groups = groups * pre[:, None]
    y = ref.hadamard_forward(groups) if cfg.hadamard else groups
    return _staged_quantize(y, finite, pre, cfg, x.numel())


def _staged_values(data, numel, cfg):
    """Each group's dequantized values in the transformed domain."""
    layout = WireLayout.of(numel, cfg)
    codes, a, b = layout.split(data)
    vals = ref.decode_codes(ref.unpack_codes(codes, cfg.spec.bits), cfg.spec)
    if cfg.scales == "dual":
        sigma = a.repeat_interleave(layout.groups_per_superblock)[: layout.n_groups] * ref.decode_ue4m4(b)
        return vals, sigma, None
    return vals, b, a


def _staged_decompress(data, numel, cfg, dtype):
    vals, sigma, pre = _staged_values(data, numel, cfg)
    if pre is not None:  # one factor per group: sigma / pre
        sigma = sigma / pre
    y = ref.hadamard_inverse(vals) * sigma[:, None] if cfg.hadamard else vals * sigma[:, None]
    return ref.saturate_cast(y.reshape(-1)[:numel], dtype)


def _staged_reduce(bufs, numel, cfg, scale, dense_dtype=None):
    nbytes = WireLayout.of(numel, cfg).nbytes
    acc = None
    for p in range(bufs.shape[0]):
        vals, sigma, pre = _staged_values(bufs[p, :nbytes], numel, cfg)
        t = vals * (sigma if pre is None else sigma / pre)[:, None]
        acc = t if acc is None else acc + t  # not 0 + t: that would turn -0.0 into +0.0
    acc = acc * scale
    finite = ref.group_finite(acc)
    if dense_dtype is not None:
        y = ref.hadamard_inverse(acc) if cfg.hadamard else acc
        return ref.saturate_cast(y.reshape(-1)[:numel], dense_dtype)
    pre = None
    if cfg.scales == "taco_fp32x2":
        ms = ref.mean_square(acc) * (4.0 * cfg.group_size if cfg.hadamard else 1.0)
        pre = ref.taco_prescale(ms, finite, cfg.spec)
        acc = acc * pre[:, None]
    return _staged_quantize(acc, finite, pre, cfg, numel)


# --------------------------------------------------------------------------- inputs
def _awkward_input(dtype, seed=0):
    """A super-block and a partial one; zero, NaN, +-Inf, near-maximum and subnormal groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SUPERBLOCK_ELEMS + 1000, generator=g)
    x[:600] = 0.0
    x[700] = float("nan")
    x[1500] = float("inf")
    x[2600], x[2610] = float("inf"), float("-inf")
    x[3000:3600] = torch.sign(x[3000:3600]) * torch.finfo(dtype).max * torch.rand(600, generator=g)
    x[4096:4600] *= torch.finfo(dtype).tiny / 4  # subnormal in every dtype
    x[4600:] *= 1e-3
    return x.to(dtype)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _aligned_rows(*bufs):
    """The wire buffers as rows of one [P, stride] uint8 tensor (stride a multiple of 16)."""
    stride = 16 + -(-max(b.numel() for b in bufs) // 16) * 16
    out = torch.zeros(len(bufs), stride, dtype=torch.uint8)
    for p, b in enumerate(bufs):
        out[p, : b.numel()] = b
    return out


# --------------------------------------------------------------------------- tests
@contextlib.contextmanager
def _torch_threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    """The bits do not depend on the thread count (the slicing test checks two), and on a loaded
    machine a multi-threaded BLAS call on these small inputs costs far more than the work."""
    with _torch_threads(1):
        yield


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    with _torch_threads(request.param) as n:
        yield n


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("cfg", CONFIGS, ids=cfg_id)
def test_pipeline_equals_composed_stages(cfg, dtype, one_thread):
    for x in (_awkward_input(DTYPES[dtype]), torch.randn(5).to(DTYPES[dtype]), torch.zeros(0, dtype=DTYPES[dtype])):
        data = ref.compress_reference(x, cfg)
        assert torch.equal(data, _staged_compress(x, cfg))
        for out_dtype in {torch.float32, DTYPES[dtype]}:
            got = ref.decompress_reference(data, x.numel(), cfg, out_dtype)
            assert torch.equal(_bits(got), _bits(_staged_decompress(data, x.numel(), cfg, out_dtype)))
        bufs = _aligned_rows(data, ref.compress_reference(x.flip(0), cfg))
        assert torch.equal(ref.reduce_reference(bufs, x.numel(), cfg, 0.5), _staged_reduce(bufs, x.numel(), cfg, 0.5))
        got = ref.reduce_reference(bufs, x.numel(), cfg, 0.5, torch.float32)
        assert torch.equal(_bits(got), _bits(_staged_reduce(bufs, x.numel(), cfg, 0.5, torch.float32)))


def _wire_parts(data, numel, cfg):
    codes, a, b = WireLayout.of(numel, cfg).split(data)
    return [codes.reshape(-1), a, b]


@pytest.mark.parametrize("scales", ["dual", "taco_fp32x2"])
@pytest.mark.parametrize("g", GROUP_SIZES, ids=[f"G{g}" for g in GROUP_SIZES])
def test_slicing_at_super_blocks_never_changes_a_bit(g, scales, threads):
    """Compressing, decompressing or reducing super-block-aligned slices gives the whole tensor's
    bytes, concatenated: 4096*5 + 7 elements cut into 2 and 6 slices (the last holds one
    partial group), so the Hadamard runs on 1 to 161 rows at a time."""
    cfg = taco.CompressionConfig(group_size=g, scales=scales)
    numel = 5 * SUPERBLOCK_ELEMS + 7
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(g), dtype=torch.float32).to(dtype)
        whole = ref.compress_reference(x, cfg)
        other = ref.compress_reference(-x * 0.7, cfg)
        parts = _wire_parts(whole, numel, cfg)
        decoded = ref.decompress_reference(whole, numel, cfg, dtype)
        pair = _aligned_rows(whole, other)
        reduced = ref.reduce_reference(pair, numel, cfg, 0.5)
        reduced_dense = ref.reduce_reference(pair, numel, cfg, 0.5, torch.float32)
        for n_slices in (2, 6):
            step = -(-numel // n_slices // SUPERBLOCK_ELEMS) * SUPERBLOCK_ELEMS
            cuts = [(s, min(s + step, numel)) for s in range(0, numel, step)]
            sliced = [ref.compress_reference(x[s:e], cfg) for s, e in cuts]
            for k in range(3):
                assert torch.equal(parts[k], torch.cat([_wire_parts(d, e - s, cfg)[k] for d, (s, e) in zip(sliced, cuts)]))
            dec = torch.cat([ref.decompress_reference(d, e - s, cfg, dtype) for d, (s, e) in zip(sliced, cuts)])
            assert torch.equal(_bits(dec), _bits(decoded))
            pairs = [_aligned_rows(d, ref.compress_reference(-x[s:e] * 0.7, cfg)) for d, (s, e) in zip(sliced, cuts)]
            red = [ref.reduce_reference(pr, e - s, cfg, 0.5) for pr, (s, e) in zip(pairs, cuts)]
            for k in range(3):
                want = _wire_parts(reduced, numel, cfg)[k]
                assert torch.equal(want, torch.cat([_wire_parts(r, e - s, cfg)[k] for r, (s, e) in zip(red, cuts)]))
            dense = torch.cat([ref.reduce_reference(pr, e - s, cfg, 0.5, torch.float32) for pr, (s, e) in zip(pairs, cuts)])
            assert torch.equal(_bits(dense), _bits(reduced_dense))
