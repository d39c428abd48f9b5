"""The fused Triton kernels against the torch reference (interpreter on CPU, compiled on GPU).

Without Hadamard the kernels do the same FP32 operations as the reference, so the wire bytes
must be bit-identical. With Hadamard the transform sums G products in a different order; a code
may then differ from the reference's only where the reference's scaled value lies within the two
transforms' summation error of a rounding midpoint - the test checks each such code is explained
that way and reports how many there were.
"""
import pytest
import torch

import taco_triton as taco
from taco_triton import env
from taco_triton import reference as ref
from taco_triton.bounds import _gamma, group_sigma
from taco_triton.layout import WireLayout

from .helpers import DEVICE, DTYPES, ON_GPU, U_DOT_HERE, all_configs, cfg_id, make_input

SHAPES = [(3, 384), (6, 42, 17), (1, 1), (2, 4097), (8192 // 384 + 1, 384)]
SHAPE_IDS = ["3x384", "6x42x17", "1x1", "2x4097", "22x384"]


def _triton(x, cfg):
    return taco.compress(x, cfg, backend="triton")


def _reference_bytes(x, cfg):
    return ref.compress_reference(x.cpu(), cfg)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("cfg", [c for c in all_configs() if not c.hadamard], ids=cfg_id)
def test_codes_and_scales_bit_identical_without_hadamard(cfg, dtype):
    for shape, kind in zip(SHAPES[:3], ("outliers", "heavy", "dense")):
        x = make_input(kind, shape, DTYPES[dtype], seed=len(shape))
        assert torch.equal(_triton(x, cfg).data.cpu(), _reference_bytes(x, cfg))


@pytest.mark.parametrize("codec", taco.config.CODECS)
def test_stochastic_codes_bit_identical_without_hadamard(codec):
    cfg = taco.CompressionConfig(codec=codec, hadamard=False, rounding="stochastic", seed=11)
    x = make_input("outliers", (5, 384), torch.bfloat16, seed=3)
    assert torch.equal(_triton(x, cfg).data.cpu(), _reference_bytes(x, cfg))


def _explained_code_differences(x, cfg, got: torch.Tensor, want: torch.Tensor):
    """Count differing codes; assert each is an adjacent code at a midpoint within summation error."""
    lay = WireLayout.of(x.numel(), cfg)
    spec = cfg.spec
    c_got, _, b_got = lay.split(got)
    c_want, _, b_want = lay.split(want)
    c_got, c_want = ref.unpack_codes(c_got, spec.bits), ref.unpack_codes(c_want, spec.bits)
    groups = ref.to_groups(x.cpu(), cfg.group_size).double()
    delta = 2 * _gamma(cfg.group_size, U_DOT_HERE) * groups.abs().sum(1, keepdim=True) / (2 * cfg.group_size)
    # groups whose E4M4 scale code differs: the ratio amax/sb_amax sat on a rounding-up boundary
    same_scale = b_got == b_want if cfg.scales == "dual" else torch.ones(lay.n_groups, dtype=torch.bool)
    n_scale_diff = int((~same_scale).sum())
    assert n_scale_diff <= max(1, lay.n_groups // 50), f"{n_scale_diff} of {lay.n_groups} group scales differ"
    sigma = group_sigma(taco.Compressed(want, x.shape, x.dtype, cfg))[:, None]
    diff = (c_got != c_want) & same_scale[:, None]
    if not bool(diff.any()):
        return 0
    a = ref.decode_codes(c_got, spec).double()[diff]
    b = ref.decode_codes(c_want, spec).double()[diff]
    steps = 2 * spec.half_ulp(torch.maximum(a.abs(), b.abs()))
    assert bool(((a - b).abs() <= steps * (1 + 1e-9)).all()), "differing codes must be neighbours"
    y_ref = ref.transform(x.cpu(), cfg).double()[diff]
    v = y_ref / sigma.expand_as(diff)[diff]
    midpoint = (a + b) / 2
    slack = delta.expand_as(diff)[diff] / sigma.expand_as(diff)[diff] + 4 * 2.0**-24 * v.abs()
    assert bool(((v - midpoint).abs() <= slack).all()), "a differing code not explained by summation order"
    return int(diff.sum())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("cfg", [c for c in all_configs() if c.hadamard] + [taco.CompressionConfig(scales="taco_fp32x2")], ids=cfg_id)
def test_hadamard_codes_match_up_to_summation_order(cfg, dtype, record_property):
    total, n_diff = 0, 0
    for shape, kind in zip(SHAPES, ("outliers", "heavy", "dense", "zero_groups", "outliers")):
        x = make_input(kind, shape, DTYPES[dtype], seed=7)
        got, want = _triton(x, cfg).data.cpu(), _reference_bytes(x, cfg)
        if cfg.scales == "taco_fp32x2":  # pre-scale from an FP32 sum of squares: order-dependent bits
            lay = WireLayout.of(x.numel(), cfg)
            pre_got, pre_want = lay.split(got)[1], lay.split(want)[1]
            assert bool(((pre_got.double() - pre_want.double()).abs() <= 2 * 2.0**-24 * 64 * pre_want.double()).all())
            continue
        n_diff += _explained_code_differences(x, cfg, got, want)
        total += x.numel()
    record_property("differing_codes", f"{n_diff}/{total}")


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("cfg", [c for c in all_configs() if c.group_size in (32, 128, 512)], ids=cfg_id)
def test_decompress_kernel_matches_reference(cfg, dtype):
    x = make_input("outliers", (7, 384), DTYPES[dtype], seed=5)
    data = _reference_bytes(x, cfg)
    c = taco.Compressed(data.to(DEVICE), x.shape, x.dtype, cfg)
    got = taco.decompress(c, backend="triton").cpu()
    want = ref.decompress_reference(data, x.numel(), cfg, x.dtype).view(x.shape)
    if not cfg.hadamard or not cfg.spec.is_float:  # exact: same FP32 operations (integer sums are exact)
        assert torch.equal(got, want)
    else:  # codes @ H summed in another order: within gamma_G of the absolute sum, then one rounding
        vals = ref.decode_codes(WireLayout.of(x.numel(), cfg).split(data)[0], cfg.spec).double()
        absum = 2 * vals.abs().sum(1, keepdim=True) * group_sigma(c)[:, None]
        tol = _gamma(cfg.group_size, U_DOT_HERE) * absum.expand_as(vals).reshape(-1)[: x.numel()]
        tol = tol + torch.finfo(x.dtype).eps * want.double().abs().reshape(-1)
        assert bool(((got.double() - want.double()).abs().reshape(-1) <= tol).all())


@pytest.mark.parametrize("cfg", [taco.CompressionConfig(), taco.CompressionConfig(codec="int8", hadamard=False),
                                 taco.CompressionConfig(codec="int6", group_size=32),
                                 taco.CompressionConfig(codec="int4", group_size=64, hadamard=False)], ids=cfg_id)
def test_tails_empty_and_tiny_shapes(cfg):
    for shape in [(0,), (0, 384), (1,), (5,), (3, 7), (2, 129), (4097,)]:
        x = make_input("dense", shape, torch.bfloat16) if 0 not in shape else torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        c = _triton(x, cfg)
        assert c.nbytes == WireLayout.of(x.numel(), cfg).nbytes
        y = taco.decompress(c, backend="triton")
        assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
        assert not bool(y.isnan().any()), "unwritten (NaN-poisoned) output"
        assert torch.equal(y.cpu(), taco.decompress(taco.Compressed(_reference_bytes(x, cfg), x.shape, x.dtype, cfg), backend="torch"))


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("cfg", [taco.CompressionConfig(), taco.CompressionConfig(hadamard=False, codec="int8"), taco.CompressionConfig(scales="taco_fp32x2"),
                                 taco.CompressionConfig(codec="int6", group_size=32)], ids=cfg_id)
def test_nonfinite_group_decompresses_to_nan_and_spares_the_rest(cfg, backend):
    x = make_input("dense", (4, 384), torch.float32, seed=2)
    g = cfg.group_size
    bad = x.clone()
    bad.view(-1)[g + 3] = float("nan")
    bad.view(-1)[3 * g + 1] = float("inf")
    zeroed = x.clone()
    zeroed.view(-1)[g : 2 * g] = 0
    zeroed.view(-1)[3 * g : 4 * g] = 0
    y = taco.decompress(taco.compress(bad, cfg, backend=backend), backend=backend).view(-1, g)
    y0 = taco.decompress(taco.compress(zeroed, cfg, backend=backend), backend=backend).view(-1, g)
    assert bool(y[1].isnan().all()) and bool(y[3].isnan().all())
    keep = [0, 2] + list(range(4, y.shape[0]))
    assert not bool(y[keep].isnan().any())
    assert torch.equal(y[keep], y0[keep])  # the NaN groups do not touch the others' scales
    with pytest.raises(ValueError, match="2 group"):
        taco.compress(bad, cfg, backend=backend, check_finite=True)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_non_contiguous_input_and_out(backend):
    base = make_input("outliers", (384, 10), torch.bfloat16)
    x = base.t()  # non-contiguous view
    assert not x.is_contiguous()
    c = taco.compress(x, backend=backend)
    assert torch.equal(c.data, taco.compress(x.contiguous(), backend=backend).data)
    y = taco.decompress(c, backend=backend)
    out = torch.empty(384, 10, dtype=torch.float32, device=DEVICE).t()
    taco.decompress(c, out=out, backend=backend)
    assert torch.equal(out, y.float()) or torch.allclose(out, y.float(), rtol=2**-8, atol=0)
    flat = torch.empty(x.numel(), dtype=torch.bfloat16, device=DEVICE)
    assert torch.equal(taco.decompress(c, out=flat, backend=backend).view(x.shape), y)


@pytest.mark.skipif(not ON_GPU, reason="a >2^31-element tensor needs a GPU (run by bench/gpu_check.sh)")
def test_int64_offsets_beyond_2_pow_31():
    """Groups past element 2^31 are read, scaled and written where they belong (int64 offsets)."""
    cfg = taco.CompressionConfig(hadamard=False)
    n = 2**31 + 3 * 4096 + 77
    x = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    x[-20000:] = make_input("outliers", (20000,), torch.bfloat16, seed=9)
    c = taco.compress(x, cfg)
    start = (n - 20000) // 4096 * 4096  # a super-block boundary: the tail compresses alone the same way
    tail = x[start:].cpu()
    want = ref.compress_reference(tail, cfg)
    lay, lay_t = WireLayout.of(n, cfg), WireLayout.of(tail.numel(), cfg)
    got_codes, got_sb, got_g = lay.split(c.data)
    w_codes, w_sb, w_g = lay_t.split(want)
    g0, sb0 = start // cfg.group_size, start // 4096
    assert torch.equal(got_codes[g0:].cpu(), w_codes)
    assert torch.equal(got_sb[sb0:].cpu(), w_sb) and torch.equal(got_g[g0:].cpu(), w_g)
    y = taco.decompress(c)
    assert torch.equal(y[start:].cpu(), ref.decompress_reference(want, tail.numel(), cfg, x.dtype))


def test_int6_codes_move_as_words_when_aligned_and_as_bytes_otherwise():
    """Aligned INT6 codes move as 32-bit words (16 codes in three words), codes at an address
    that is not a multiple of 4 byte by byte; both write and read the same wire bytes."""
    from taco_triton.kernels._common import INT6_WORD_CODES, codec_constexprs
    from taco_triton.kernels._launch import heuristic, target_of
    from taco_triton.kernels.compress import compress_launch
    from taco_triton.kernels.decompress import decompress_launch

    cfg = taco.CompressionConfig(codec="int6", group_size=32, hadamard=False)
    x = make_input("outliers", (24, 96), torch.bfloat16).to(DEVICE)
    lay = WireLayout.of(x.numel(), cfg)
    wire = taco.compress(x, cfg, backend="triton").data
    assert codec_constexprs(cfg.spec, wire.data_ptr())["PACK_K"] == INT6_WORD_CODES.value
    assert torch.equal(wire.cpu(), ref.compress_reference(x.cpu(), cfg))
    codes, a, b = lay.split(wire)

    raw = torch.zeros(lay.scale_a_offset + 3, dtype=torch.uint8, device=DEVICE)
    odd = raw[3:]  # codes at an address = 3 (mod 4)
    assert odd.data_ptr() % 4 == 3 and codec_constexprs(cfg.spec, odd.data_ptr())["PACK_K"] == ref.packing(6)[0]
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    target = target_of(x.device)
    compress_launch(x, odd, a2, b2, x.numel(), cfg, target, heuristic("compress", cfg), x.device).run()
    assert torch.equal(odd, codes.reshape(-1)) and torch.equal(a2, a) and torch.equal(b2, b)

    want = taco.decompress(taco.compress(x, cfg, backend="torch"), backend="torch")
    out = torch.empty_like(x)
    decompress_launch(odd, a2, b2, out, x.numel(), cfg, target, heuristic("decompress", cfg), x.device).run()
    assert torch.equal(out, want)


@pytest.mark.parametrize("cfg", [taco.CompressionConfig(codec="int4", group_size=32, hadamard=False),
                                 taco.CompressionConfig(codec="int4", group_size=256)], ids=cfg_id)
def test_int4_codes_stored_as_words_when_aligned_write_the_bytes_of_the_byte_path(cfg):
    """Aligned INT4 codes are stored as 32-bit words of 8 codes, codes at an address that is not a
    multiple of 4 two per byte: the same wire bytes (and without the transform, the reference's),
    NaN and all-zero groups included; the reduce, which stores words too, sums them as the
    reference does, as a plain sum (no multiply) and averaged; it refuses zero ranks."""
    from taco_triton.kernels._common import INT4_WORD_CODES, codec_constexprs
    from taco_triton.kernels._launch import heuristic, target_of
    from taco_triton.kernels.compress import _meta, compress_launch
    from taco_triton.kernels.reduce import reduce_triton

    x = make_input("outliers", (24, 512), torch.float32).to(DEVICE)
    x[1, 5] = float("nan")
    x[2, 256:] = 0
    lay = WireLayout.of(x.numel(), cfg)
    wire = taco.compress(x, cfg, backend="triton").data
    target = target_of(x.device)
    assert _meta(x.dtype, cfg, target, {}, wire.data_ptr())["PACK_K"] == INT4_WORD_CODES.value
    if not cfg.hadamard:
        assert torch.equal(wire.cpu(), ref.compress_reference(x.cpu(), cfg))
    codes, a, b = lay.split(wire)

    raw = torch.zeros(lay.scale_a_offset + 1, dtype=torch.uint8, device=DEVICE)
    odd = raw[1:]  # codes at an address = 1 (mod 4)
    assert codec_constexprs(cfg.spec, odd.data_ptr())["PACK_K"] == ref.packing(4)[0]
    a2, b2 = torch.empty_like(a), torch.empty_like(b)
    compress_launch(x, odd, a2, b2, x.numel(), cfg, target, heuristic("compress", cfg), x.device).run()
    assert torch.equal(odd, codes.reshape(-1)) and torch.equal(a2, a) and torch.equal(b2, b)

    stride = -(-lay.nbytes // 16) * 16
    bufs = torch.zeros(2, stride, dtype=torch.uint8, device=DEVICE)
    bufs[0, : lay.nbytes] = wire
    bufs[1, : lay.nbytes] = taco.compress(x.flip(0), cfg, backend="triton").data
    for scale in (1.0, 0.5):
        got = reduce_triton(bufs, x.numel(), cfg, scale)
        assert torch.equal(got.cpu(), ref.reduce_reference(bufs.cpu(), x.numel(), cfg, scale)), scale
    with pytest.raises(ValueError, match="n_ranks=0"):
        reduce_triton(bufs[:0], x.numel(), cfg)


@pytest.mark.parametrize("cfg", [taco.CompressionConfig(codec="int4", group_size=32, hadamard=False),
                                 taco.CompressionConfig(codec="int6", group_size=32, hadamard=False),
                                 taco.CompressionConfig(codec="int6", group_size=64)], ids=cfg_id)
def test_reduce_reads_every_sub_byte_code_at_every_position_of_its_words(cfg):
    """The reduce reads INT6/INT4 word codes straight into FP32 (`_common._field_f32`): with code
    bytes drawn at random (every bit pattern is a valid code, so each field of the words takes
    every value, -2^(BITS-1) and 2^(BITS-1) - 1 included, at every position), the sums and their
    codes equal the reference's bit for bit, as a plain sum and averaged."""
    from taco_triton.kernels._common import codec_constexprs
    from taco_triton.kernels.reduce import reduce_triton

    n, p = 64 * cfg.group_size, 3
    lay = WireLayout.of(n, cfg)
    stride = -(-lay.nbytes // 16) * 16
    bufs = torch.zeros(p, stride, dtype=torch.uint8, device=DEVICE)
    g = torch.Generator().manual_seed(11)
    for r in range(p):  # real scales (finite, some groups far apart), random codes
        x = make_input("outliers", (n,), torch.float32, seed=r).to(DEVICE)
        bufs[r, : lay.nbytes] = taco.compress(x, cfg, backend="triton").data
        codes, _, _ = lay.split(bufs[r, : lay.nbytes])
        codes.copy_(torch.randint(0, 256, codes.shape, generator=g, dtype=torch.uint8))
    assert codec_constexprs(cfg.spec, bufs.data_ptr(), stride)["PACK_K"] in (8, 16)  # the word path
    vals = ref.decode_codes(ref.unpack_codes(lay.split(bufs[0, : lay.nbytes])[0], cfg.spec.bits), cfg.spec)
    half = 1 << (cfg.spec.bits - 1)
    assert set(vals.unique().tolist()) == set(range(-half, half))
    for scale in (1.0, 1 / p):
        got = reduce_triton(bufs, n, cfg, scale)
        assert torch.equal(got.cpu(), ref.reduce_reference(bufs.cpu(), n, cfg, scale)), scale


@pytest.mark.parametrize("p", [1, 2, 3])
def test_reduce_sums_from_the_first_ranks_values_so_negative_zero_stays(p):
    """The sum starts from rank 0's values, as the reference's does (not from a zeroed tile): a
    group whose codes are -0 (E4M3 0x80) in every rank sums to -0, bit for bit, dense and as the
    compressed sum, where 0 + (-0) would give +0."""
    from taco_triton.kernels.reduce import reduce_triton

    cfg = taco.CompressionConfig(hadamard=False)
    n, g = 8 * cfg.group_size, cfg.group_size
    lay = WireLayout.of(n, cfg)
    stride = -(-lay.nbytes // 16) * 16
    bufs = torch.zeros(p, stride, dtype=torch.uint8, device=DEVICE)
    for r in range(p):
        x = make_input("dense", (n,), torch.float32, seed=r).to(DEVICE)
        bufs[r, : lay.nbytes] = taco.compress(x, cfg, backend="triton").data
        lay.split(bufs[r, : lay.nbytes])[0].view(-1, g)[3] = 0x80
    want = ref.reduce_reference(bufs.cpu(), n, cfg, 1.0, dense_dtype=torch.float32)
    assert bool((want.view(-1, g)[3].view(torch.int32) == -(2**31)).all())  # -0.0's bits
    got = torch.empty(n, dtype=torch.float32, device=DEVICE)
    reduce_triton(bufs, n, cfg, 1.0, dense_out=got)
    assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
    assert torch.equal(reduce_triton(bufs, n, cfg, 1.0).cpu(), ref.reduce_reference(bufs.cpu(), n, cfg, 1.0))


@pytest.mark.parametrize("cfg", [taco.CompressionConfig(rounding="stochastic", seed=9),
                                 taco.CompressionConfig(codec="int8", hadamard=False, rounding="stochastic", seed=4),
                                 taco.CompressionConfig(codec="int6", group_size=32, hadamard=False),
                                 taco.CompressionConfig(scales="taco_fp32x2", group_size=512)], ids=cfg_id)
def test_unaligned_size_runs_as_aligned_launch_and_tail_with_the_same_bytes(cfg):
    """A size that is not a multiple of 16 runs as an aligned main launch over the whole tiles
    plus a one-program tail; its wire bytes and decompressed values equal those of one launch over
    everything (stochastic rounding included: the tail draws the random bits of its global
    indices), and without Hadamard the reference's bytes."""
    from taco_triton.kernels._launch import heuristic, target_of
    from taco_triton.kernels._tile import TILE_ELEMS, aligned_split
    from taco_triton.kernels.compress import compress_launch, compress_launches
    from taco_triton.kernels.decompress import decompress_launch, decompress_launches

    numel = TILE_ELEMS + 37
    assert aligned_split(numel) == TILE_ELEMS and aligned_split(2 * TILE_ELEMS) == 0 and aligned_split(TILE_ELEMS - 1) == 0
    x = make_input("outliers", (numel,), torch.float32, seed=6).to(DEVICE)
    lay = WireLayout.of(numel, cfg)
    target = target_of(x.device)
    args = (cfg, target, heuristic("compress", cfg), x.device)
    assert len(compress_launches(x, *lay.split(torch.empty(lay.nbytes, dtype=torch.uint8, device=DEVICE)), numel, *args)) == 2
    split = taco.compress(x, cfg, backend="triton").data  # the eager path: main launch and tail
    one = torch.empty_like(split)
    compress_launch(x, *lay.split(one), numel, *args).run()
    assert torch.equal(split, one)
    if not cfg.hadamard:
        assert torch.equal(split.cpu(), ref.compress_reference(x.cpu(), cfg))

    dargs = (cfg, target, heuristic("decompress", cfg), x.device)
    outs = [torch.full_like(x, float("nan")) for _ in range(2)]
    launches = decompress_launches(*lay.split(split), outs[0], numel, *dargs)
    assert len(launches) == 2
    for launch in launches:
        launch.run()
    decompress_launch(*lay.split(split), outs[1], numel, *dargs).run()
    assert not bool(outs[0].isnan().any()) and torch.equal(outs[0], outs[1])
    assert torch.equal(taco.decompress(taco.Compressed(split, x.shape, x.dtype, cfg), backend="triton"), outs[1])


def test_fast_tiles_counts_the_tiles_each_fast_path_can_take():
    """A slotted launch's vector path is for tiles of a piece that starts at a multiple of 16
    elements and whose masks end at one: all of an aligned piece, the whole tiles of an odd-sized
    one, none of one that starts elsewhere. Where a piece starts elsewhere, the launch's fast path
    is the one without masks, for every piece's whole tiles."""
    from taco_triton.kernels import slots

    t, whole = slots.TILE_ELEMS, slots.WHOLE_PATH
    assert slots.fast_tiles(0, 2 * t + 5) == 2 and slots.fast_tiles(32, 32 + t - 1) == 0
    assert slots.fast_tiles(16, 16 + t + 16) == 2 and slots.fast_tiles(0, 3 * t) == 3
    assert slots.fast_tiles(5, 5 + 4 * t) == 0 and slots.fast_tiles(48, 48) == 0
    assert slots.fast_tiles(5, 5 + 4 * t, whole) == 4 and slots.fast_tiles(5, 4 + 4 * t, whole) == 3
    assert slots.fast_tiles(0, 3 * t, whole) == 3 and slots.fast_tiles(16, 16 + t + 16, whole) == 1
    assert slots.elem_align([(0, 16), (16, 48)]) == 16 and slots.elem_align([(0, 16), (16, 47)]) == 1
    assert slots.two_paths([(0, 16), (16, 47)]) == slots.VECTOR_PATH and not slots.two_paths([(0, 16), (16, 48)])
    assert slots.two_paths([(0, 17), (17, 34)]) == whole  # a piece starts off alignment
    rows = slots.descriptors([(0, 17), (17, 17 + t)], [WireLayout.of(n, taco.CompressionConfig()) for n in (17, t)],
                             [0, 4096], [4096, 8192], [1, 2], [0, 1])
    assert [r[slots.FAST_TILES] for r in rows] == [0, 1]  # the descriptors count for the launch's fast path
    # a kernel's variant of the path without masks addresses the same tiles as one run each
    from taco_triton.kernels._launch import Target

    run = slots.WHOLE_RUN_PATH
    assert slots.fast_tiles(5, 5 + 4 * t, run) == 4 and slots.fast_tiles(5, 4 + 4 * t, run) == 3
    cuda, hip, interp = Target("cuda", 90), Target("hip", "gfx942", 64), Target("interpreter")
    assert slots.kernel_paths(whole, cuda, 4) == run and slots.kernel_paths(whole, interp, 6) == run
    assert slots.kernel_paths(whole, cuda, 8) == whole and slots.kernel_paths(whole, hip, 4) == whole
    assert slots.kernel_paths(slots.VECTOR_PATH, cuda, 4) == slots.VECTOR_PATH and slots.kernel_paths(0, cuda, 4) == 0


# FP8 and INT8 take the path without masks by 2-D offsets, INT4 as one run per tile (`slots.kernel_paths`)
SLOT_CFGS = [taco.CompressionConfig(), taco.CompressionConfig(codec="int8", rounding="stochastic", seed=3),
             taco.CompressionConfig(codec="int4", group_size=32)]


_T = 8192  # slots.TILE_ELEMS: test ids name the pieces' starts and sizes in tiles
SLOT_PIECES = {
    # pieces that start aligned, odd-sized (whole tiles vector, the last element-wise) and aligned
    # ones (all vector): the vector path; FAST_TILES 2, 1, 1
    "vector": [(0, 2 * _T + 5), (2 * _T + 16, 3 * _T + 21 + 16), (3 * _T + 48, 3 * _T + 48 + _T // 2 + 16)],
    # and one that starts off alignment: every piece's whole tiles without masks; FAST_TILES 2, 1, 0
    "whole": [(0, 2 * _T + 5), (2 * _T + 5, 3 * _T + 21), (3 * _T + 32, 3 * _T + 32 + _T // 2 + 16)],
}


@pytest.mark.parametrize("paths", SLOT_PIECES)
@pytest.mark.parametrize("cfg", SLOT_CFGS, ids=cfg_id)
def test_slotted_kernels_give_the_same_bytes_on_either_path(cfg, paths):
    """A slotted launch compiled for any alignment runs each tile on its fast path or the
    element-wise one with masks (`slots.two_paths`, `slots.fast_tiles`): pieces of each kind in one
    launch (`SLOT_PIECES`). Each slot holds the plain kernel's bytes of its piece and its tag; with
    every tile forced onto the element-wise path the bytes are the same; decompressing writes the
    plain kernel's values into each piece and nothing outside the pieces."""
    from taco_triton.kernels import slots
    from taco_triton.kernels._launch import launch_params, target_of
    from taco_triton.kernels.compress import compress_slots_launch
    from taco_triton.kernels.decompress import decompress_slots_launch

    t = slots.TILE_ELEMS
    assert t == _T
    pieces = SLOT_PIECES[paths]
    x = make_input("outliers", (pieces[-1][1] + 7,), torch.bfloat16, seed=11).to(DEVICE)
    lays = [WireLayout.of(b - a, cfg) for a, b in pieces]
    ends = [slots.slot_bytes(lay.nbytes) for lay in lays]
    offs = [sum(ends[:j]) for j in range(len(ends))]
    tags = [0x01020304 + j for j in range(len(pieces))]
    rows = slots.descriptors(pieces, lays, offs, ends, tags, list(range(len(pieces))))
    kind = {"vector": slots.VECTOR_PATH, "whole": slots.WHOLE_PATH}[paths]
    assert [r[slots.FAST_TILES] for r in rows] == ([2, 1, 1] if paths == "vector" else [2, 1, 0])
    assert slots.alignment(pieces) == {"elem_align": 1, "two_paths": kind}
    target, n_tiles = target_of(x.device), slots.total_tiles(lays)

    def compress(rows):
        out = torch.full((sum(ends),), 0xAB, dtype=torch.uint8, device=DEVICE)
        compress_slots_launch(x, out, slots.table(rows, DEVICE), len(pieces), n_tiles, cfg, target,
                              launch_params("compress_slots", x.device, x.dtype, cfg, t), x.device, elem_align=1,
                              two_paths=kind).run()
        return out

    def decompress(wire, rows):
        y = torch.full_like(x, 7.0)
        err = torch.zeros(slots.ERR_FIELDS, dtype=torch.int64, device=DEVICE)
        decompress_slots_launch(wire, y, slots.table(rows, DEVICE), err, len(pieces), n_tiles, cfg, target,
                                launch_params("decompress_slots", x.device, x.dtype, cfg, t), x.device,
                                elem_align=1, two_paths=kind).run()
        assert not bool(err.any())
        return y

    slow_rows = [r[:slots.FAST_TILES] + [0] + r[slots.FAST_TILES + 1:] for r in rows]
    wire, wire_slow = compress(rows), compress(slow_rows)
    assert torch.equal(wire, wire_slow)
    y, y_slow = decompress(wire, rows), decompress(wire, slow_rows)
    assert torch.equal(y, y_slow)
    outside = torch.ones_like(x, dtype=torch.bool)
    for j, ((a, b), lay, off, tag) in enumerate(zip(pieces, lays, offs, tags)):
        piece_cfg = slots.salted(cfg, j)  # a slot's stochastic seed is salted with its index
        plain = taco.compress(x[a:b], piece_cfg, backend="triton").data
        assert torch.equal(wire[off:off + lay.nbytes], plain), f"slot {j}"
        assert wire[off + lay.nbytes:off + lay.nbytes + 4].tolist() == list(tag.to_bytes(4, "little"))
        assert not bool(wire[off + lay.nbytes + 4:off + ends[j]].any())
        want = taco.decompress(taco.Compressed(plain, (b - a,), x.dtype, piece_cfg), backend="triton")
        assert torch.equal(y[a:b], want), f"piece {j}"
        outside[a:b] = False
    assert bool((y[outside] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_dense_reduce_of_an_odd_size_stores_its_whole_tiles_as_vectors_with_the_same_values(dtype):
    """The collectives' (tagged) dense reduce of a size that is not a multiple of 16 stores its
    whole tiles through the vector path and its last, partial tile element by element (SPLIT): the
    same values as the launch with one path, and nothing written past the size."""
    from taco_triton.kernels import slots
    from taco_triton.kernels._launch import launch_params, target_of
    from taco_triton.kernels.reduce import reduce_launch

    cfg = taco.CompressionConfig()
    numel = 2 * slots.TILE_ELEMS + 5
    lay = WireLayout.of(numel, cfg)
    stride = slots.round_up(lay.nbytes, 16)
    bufs = torch.zeros(3, stride, dtype=torch.uint8, device=DEVICE)
    for r in range(3):
        bufs[r, : lay.nbytes] = taco.compress(make_input("outliers", (numel,), torch.float32, seed=20 + r).to(DEVICE),
                                              cfg, backend="triton").data
        bufs[r, lay.nbytes : lay.nbytes + 4] = torch.tensor([4, 3, 2, 1], dtype=torch.uint8)  # the tag
    err = torch.zeros(slots.ERR_FIELDS, dtype=torch.int64, device=DEVICE)
    outs = []
    for split in (True, False):
        out = torch.full((numel + 11,), 3.0, dtype=dtype, device=DEVICE)
        launch = reduce_launch(bufs, bufs, bufs, (stride, stride // 4, stride), 3, out, out, out, out, numel, cfg, 0.5,
                               True, target_of(bufs.device), launch_params("reduce", bufs.device, torch.uint8, cfg, numel),
                               bufs.device, tags=(err, 0x01020304, 0, stride))
        assert launch.meta["SPLIT"]
        launch.meta["SPLIT"] = split
        launch.run()
        assert bool((out[numel:] == 3.0).all()) and not bool(err.any())
        outs.append(out[:numel])
    assert bool(torch.isfinite(outs[0]).all()) and torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("g", [256, 512])
@pytest.mark.parametrize("kind", ["constant", "random_sign"])
def test_two_stage_hadamard_of_values_near_the_fp32_maximum_stays_finite(g, kind):
    """G = 256, 512 transform in two stages; 16 same-sign inputs of 1e38 summed by a +-1 first
    stage overflowed to Inf and the whole group decompressed to NaN. Finite inputs give finite
    outputs within the format's L2 bound."""
    from taco_triton import bounds

    gen = torch.Generator().manual_seed(g)
    x = torch.full((4, g), 1e38, dtype=torch.float32)
    if kind == "random_sign":
        x = x * (torch.randint(0, 2, x.shape, generator=gen) * 2 - 1) * torch.rand(x.shape, generator=gen).add(0.5)
    cfg = taco.CompressionConfig(codec="int8", group_size=g)
    c = taco.compress(x.to(DEVICE), cfg, backend="triton")
    out = taco.decompress(c, backend="triton").cpu()
    assert bool(torch.isfinite(out).all())
    c_cpu = taco.Compressed(c.data.cpu(), c.shape, c.dtype, c.config)
    assert float((out.double() - x.double()).norm()) <= bounds.l2_error_bound(x, c_cpu, x.dtype, U_DOT_HERE)


@pytest.mark.parametrize("g", [256, 512])
def test_batched_second_stage_gives_the_transposed_forms_bytes(g, monkeypatch):
    """G = 256, 512: the second stage of the transform as a batched dot with the table on the
    left (KRON 1, sm_90) against the transposes around a second dot
    (KRON 0): the same products, so the same bytes in compress (bf16 and FP32 input) and
    decompress; the reduce to dense sums its FP32 operands in another order there, so its
    outputs agree within twice gamma_G of the rows' absolute sums. The interpreter runs both forms
    in FP32."""
    from taco_triton.kernels import _launch
    from taco_triton.kernels.reduce import reduce_triton

    flags = _launch.target_flags
    cfg = taco.CompressionConfig(group_size=g)
    xs = [make_input(kind, (3, 8192 + 3 * g), torch.float32, seed=g) for kind in ("outliers", "dense")]
    numel = xs[0].numel()
    lay = WireLayout.of(numel, cfg)
    stride = -(-lay.nbytes // 16) * 16
    got = {}
    for kron in (0, 1):
        monkeypatch.setattr(_launch, "target_flags", lambda target, k=kron: {**flags(target), "KRON": k})
        cs = [taco.compress(x.to(dt), cfg, backend="triton") for x in xs for dt in (torch.bfloat16, torch.float32)]
        ds = [taco.decompress(c, backend="triton") for c in cs]
        bufs = torch.zeros(2, stride, dtype=torch.uint8, device=DEVICE)
        bufs[0, : lay.nbytes], bufs[1, : lay.nbytes] = cs[1].data, cs[3].data
        dense = reduce_triton(bufs, numel, cfg, dense_out=torch.empty(numel, device=DEVICE))
        got[kron] = ([c.data for c in cs] + ds, dense.cpu().double())
    assert all(torch.equal(a, b) for a, b in zip(got[0][0], got[1][0], strict=True))
    acc = sum(vals * sigma[:, None] for vals, sigma, _ in (ref.load_codes(b[: lay.nbytes].cpu(), numel, cfg) for b in bufs))
    # the reduce's table is the +-1 matrix and the sum is doubled: each form is within
    # gamma_G * 2 * sum |acc| of the exact value
    tol = 2 * _gamma(g, 2.0**-24) * 2 * acc.double().abs().sum(1, keepdim=True)
    diff = (got[0][1] - got[1][1]).view(-1, g).abs()
    assert bool((diff <= tol).all()) and bool(torch.isfinite(got[1][1]).all())


def test_bf16_subnormals_decode_as_the_interpreter_loads_them():
    """Triton's interpreter converts bf16 subnormals wrongly on load (7.6e-39 loads as 3.5e-39),
    so the Triton backend run in it loses them (its result is outside the format's bound); the torch reference keeps them.
    That is why the property tests draw magnitudes from 1e-30 up, above bf16's subnormals."""
    x = (torch.arange(1, 128, dtype=torch.float32) * 2.0**-133).to(torch.bfloat16)  # all subnormal in bf16
    assert bool((x.float().abs() < torch.finfo(torch.bfloat16).tiny).all())
    cfg = taco.CompressionConfig(hadamard=False)
    ref = taco.decompress(taco.compress(x, cfg, backend="torch"), backend="torch")
    rel = float((ref.double() - x.double()).norm() / x.double().norm())
    assert rel <= 2 * cfg.spec.relative_rounding
    if env.interpreting():
        got = taco.decompress(taco.compress(x, cfg, backend="triton"), backend="triton")
        assert float((got.double() - x.double()).norm() / x.double().norm()) > 2 * cfg.spec.relative_rounding


# ---------------------------------------------------------------- launches by parameter name
def _all_launches():
    """Every launch builder's launches (ShapedPointers, no device) for a spread of configs and
    targets: the dense and slotted compress/decompress (odd size: main and tail), the reduce to a
    compressed and to a dense sum, with and without tags."""
    from taco_triton.kernels._launch import INTERPRETER, ShapedPointer as P, Target
    from taco_triton.kernels.compress import compress_launches, compress_slots_launch
    from taco_triton.kernels.decompress import decompress_launches, decompress_slots_launch
    from taco_triton.kernels.reduce import reduce_launch

    u8, f32, params = P(torch.uint8), P(torch.float32), {"num_warps": 4, "num_stages": 2}
    configs = [taco.CompressionConfig(), taco.CompressionConfig(codec="int6", group_size=256, rounding="stochastic"),
               taco.CompressionConfig(codec="int4", scales="taco_fp32x2", group_size=128, hadamard=False)]
    for target in (INTERPRETER, Target("cuda", 90), Target("cuda", 80), Target("hip", "gfx942", 64)):
        for cfg in configs:
            b = u8 if cfg.scales == "dual" else f32
            for dtype in (torch.bfloat16, torch.float32):
                x = P(dtype)
                yield from compress_launches(x, u8, f32, b, 8195, cfg, target, params)
                yield compress_slots_launch(x, u8, u8, 2, 3, cfg, target, params, elem_align=16)
                yield from decompress_launches(u8, f32, b, x, 8195, cfg, target, params)
                yield decompress_slots_launch(u8, x, u8, P(torch.int64), 2, 3, cfg, target, params)
            for dense, tags in ((False, None), (True, None), (False, (P(torch.int64), 1, 2, 9000))):
                out = f32 if dense else u8
                yield reduce_launch(u8, u8, u8, (8208, 2052, 8208), 4, out, out, out, out, 8192, cfg, 0.5, dense,
                                    target, params, tags=tags)


def _kernels(*modules) -> dict:
    """The kernels (the launched `@triton.jit` functions, `_..._kernel`) defined in `modules`."""
    return {name: k for m in modules for name, k in vars(m).items()
            if name.startswith("_") and name.endswith("_kernel") and k.fn.__module__ == m.__name__}


def test_every_launch_passes_exactly_its_kernels_parameters_by_name():
    """Each kernel receives its runtime parameters by name and exactly the constexprs it declares
    (no shared dict with another kernel's), plus the launch options; the names come from Triton's
    own reading of the signature (`JITFunction.arg_names` / `constexprs`)."""
    from triton.runtime.jit import JITFunction

    from taco_triton.kernels import compress, decompress, reduce
    from taco_triton.kernels._launch import LAUNCH_OPTIONS, kernel_parameters

    seen = set()
    for launch in _all_launches():
        jit = JITFunction(launch.fn.fn)  # the compiled view of the kernel, whatever TRITON_INTERPRET is
        runtime, constexprs = kernel_parameters(launch.fn)
        assert constexprs == {jit.arg_names[i] for i in jit.constexprs}
        assert list(launch.args) == list(runtime) == [n for n in jit.arg_names if n not in constexprs]
        assert set(launch.meta) == constexprs | LAUNCH_OPTIONS, launch.fn.__name__
        seen.add(launch.fn)
    assert seen == set(_kernels(compress, decompress, reduce).values())


def test_every_constexpr_a_kernel_declares_is_used():
    """A kernel declares no constexpr that its body does not read (a dead one is a value passed
    for nothing, and a name that suggests it matters)."""
    import ast
    import inspect

    from taco_triton.kernels import compress, decompress, reduce
    from taco_triton.kernels._launch import kernel_parameters

    for name, kernel in _kernels(compress, decompress, reduce).items():
        fn = ast.parse(inspect.getsource(kernel.fn).lstrip()).body[0]
        used = {n.id for stmt in fn.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        assert kernel_parameters(kernel)[1] <= used, (name, kernel_parameters(kernel)[1] - used)


def test_launch_and_prepared_name_unknown_parameters():
    from taco_triton.kernels._launch import INTERPRETER, Launch, Prepared, ShapedPointer as P
    from taco_triton.kernels.compress import compress_launch

    cfg = taco.CompressionConfig()
    u8 = P(torch.uint8)
    launch = compress_launch(P(torch.bfloat16), u8, P(torch.float32), u8, 8192, cfg, INTERPRETER,
                             {"num_warps": 4, "num_stages": 2})
    with pytest.raises(ValueError, match=r"missing \['seed'\], unknown \['sed'\]"):
        Launch(launch.fn, 1, {**{k: v for k, v in launch.args.items() if k != "seed"}, "sed": 0}, launch.meta)
    with pytest.raises(ValueError, match=r"constexprs and options missing \['TAIL'\], unknown \['SUB'\]"):
        Launch(launch.fn, 1, launch.args, {**{k: v for k, v in launch.meta.items() if k != "TAIL"}, "SUB": 1.0})
    with pytest.raises(ValueError, match=r"unknown \['x', 'G'\] \(constexprs \['G'\]"):
        Prepared(launch, ("x", "codes_ptr", "G"))
    with pytest.raises(ValueError, match="distinct"):
        Prepared(launch, ("x_ptr", "x_ptr"))


def test_prepared_call_by_position_and_by_name_writes_the_bytes_of_a_launch():
    """A prepared compress called with its varying arguments in the order they were named, or by
    name in another order, writes what `compress_triton` writes."""
    from taco_triton.kernels._launch import Prepared, heuristic, target_of
    from taco_triton.kernels.compress import compress_launch, compress_triton

    cfg = taco.CompressionConfig()
    x = make_input("outliers", (2, 4096), torch.bfloat16, seed=3).to(DEVICE)
    lay = WireLayout.of(x.numel(), cfg)
    want = compress_triton(x, cfg)
    got = [torch.zeros(lay.nbytes, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    c, a, b = lay.split(got[0])
    prepared = Prepared(compress_launch(x, c, a, b, x.numel(), cfg, target_of(x.device), heuristic("compress", cfg),
                                        x.device), ("codes_ptr", "scale_a_ptr", "scale_b_ptr", "x_ptr"))
    prepared(c, a, b, x)
    c, a, b = lay.split(got[1])
    prepared(x_ptr=x, scale_b_ptr=b, codes_ptr=c, scale_a_ptr=a)
    assert torch.equal(got[0], want) and torch.equal(got[1], want)


def test_launch_params_alone_choose_the_warps_of_the_slotted_compress():
    """The slotted compress shares the dense one's choice, raised to `WARP_FLOORS`' 8 warps at
    single-scale G = 256, whatever chose fewer (the heuristic, a forced block)."""
    from taco_triton.kernels import _launch

    cpu, cfg = torch.device("cpu"), taco.CompressionConfig(scales="taco_fp32x2", group_size=256)
    assert _launch.launch_params("compress", cpu, torch.bfloat16, cfg, 8192)["num_warps"] == 4
    assert _launch.launch_params("compress_slots", cpu, torch.bfloat16, cfg, 8192) == {"num_warps": 8, "num_stages": 1}
    with _launch.forced({"num_warps": 2, "num_stages": 3}):
        assert _launch.launch_params("compress_slots", cpu, torch.bfloat16, cfg, 8192) == {"num_warps": 8, "num_stages": 3}
        assert _launch.launch_params("compress_slots", cpu, torch.bfloat16, cfg.replace(group_size=128), 8192) == {
            "num_warps": 2, "num_stages": 3}


def test_prepared_call_arguments_may_fill_several_parameters():
    """A fused op's call names its arguments (`ReduceOp.SLOTS_CALL`: one wire-row tensor fills the
    codes and both scale pointers); a parameter filled twice, or a call name that is no identifier
    or starts with an underscore (the generated call's own names do), is refused with the names."""
    from taco_triton.kernels._launch import INTERPRETER, Prepared, ShapedPointer as P
    from taco_triton.kernels.compress import compress_launch

    u8 = P(torch.uint8)
    launch = compress_launch(P(torch.bfloat16), u8, P(torch.float32), u8, 8192, taco.CompressionConfig(), INTERPRETER,
                             {"num_warps": 4, "num_stages": 2})
    prepared = Prepared(launch, {"x": "x_ptr", "wire": ("codes_ptr", "scale_b_ptr")})
    assert prepared.varying == ("x", "wire")
    with pytest.raises(ValueError, match="distinct"):
        Prepared(launch, {"x": "x_ptr", "y": ("x_ptr", "codes_ptr")})
    with pytest.raises(ValueError, match=r"without a leading underscore, not \['_c_x'\]"):
        Prepared(launch, {"_c_x": "x_ptr"})
