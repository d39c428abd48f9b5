"""The kernels' FP8 encoder and decoder (`kernels._common`) against the reference, value by value,
and the two dot arrangements sm_80 uses (K chunks, transposed) against x @ T.

Every FP32 bit pattern's top 16 bits (sign, all exponents, 7 mantissa bits: every position of
the FP8 rounding cut, normal and subnormal) with the low 16 bits at 0, 1, 2, around the half
(0x7FFF, 0x8000, 0x8001), at the top (0xFFFE, 0xFFFF) and at random: ties, their neighbours and
round-ups into the next binade at every exponent. They run through the production functions in
Triton's interpreter, whose FP32 arithmetic is IEEE (round to nearest even, subnormals kept) as
on the GPUs the kernels compile for.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

from taco_triton import reference as ref
from taco_triton.config import CODEC_SPECS
from .helpers import DEVICE, ON_GPU
from taco_triton.kernels._common import CODEC_IDS, NEAREST, _dot_k_chunks, decode_codes, encode_codes, hadamard_rows

FP8 = ["fp8_e4m3", "fp8_e5m2"]
BLOCK = 1 << 16


@triton.jit
def _encode_kernel(v_ptr, out_ptr, n, CODEC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                   HW: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, encode_codes(v, 0, CODEC, MBITS, EMIN, NEAREST, HW, False), mask=ok)


def _sweep() -> torch.Tensor:
    """FP32 values: every top-16-bit pattern with 8 fixed and 4 random low halves."""
    top = torch.arange(1 << 16, dtype=torch.int64) << 16
    low = torch.tensor([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF], dtype=torch.int64)
    rnd = torch.randint(0, 1 << 16, (top.numel(), 4), generator=torch.Generator().manual_seed(5))
    bits = torch.cat([(top[:, None] | low[None, :]).flatten(), (top[:, None] | rnd).flatten()])
    return (bits - ((bits >> 31) << 32)).to(torch.int32).view(torch.float32)  # two's complement view


def _midpoint_past_max(spec) -> float:
    """Halfway between code_max and the next step of the code grid: anything below rounds to code_max."""
    top_exponent = math.frexp(spec.code_max)[1] - 1
    return spec.code_max + 2.0 ** (top_exponent - spec.mbits - 1)


def _kernel_codes(v: torch.Tensor, codec: str, hw: bool) -> torch.Tensor:
    spec = CODEC_SPECS[codec]
    out = torch.empty(v.numel(), dtype=torch.uint8, device=DEVICE)
    _encode_kernel[(triton.cdiv(v.numel(), BLOCK),)](v.to(DEVICE), out, v.numel(), CODEC=CODEC_IDS[codec],
                                                    MBITS=spec.mbits, EMIN=spec.emin, HW=hw, BLOCK=BLOCK)
    return out.cpu()


@pytest.mark.parametrize("hw", [True, False], ids=["compiled", "interpreter"])
@pytest.mark.parametrize("codec", FP8)
def test_fp8_encoder_equals_reference_for_every_exponent_tie_and_neighbour(codec, hw):
    spec = CODEC_SPECS[codec]
    v = _sweep()
    v = v[v.abs() <= _midpoint_past_max(spec)]  # finite, and at most the midpoint past code_max
    got = _kernel_codes(v, codec, hw)
    want = ref.encode_codes_bits(v, spec)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, (f"{bad.numel()} of {v.numel()} codes differ, e.g. v={v[bad[:4]].tolist()} "
                              f"got {got[bad[:4]].tolist()} want {want[bad[:4]].tolist()}")
    inside = v.abs() <= spec.code_max  # torch's cast is the definition there
    assert torch.equal(got[inside], ref.encode_codes(v[inside], spec))


@pytest.mark.parametrize("codec", FP8)
def test_fp8_encoder_edge_values(codec):
    spec = CODEC_SPECS[codec]
    step_min = 2.0 ** (spec.emin - spec.mbits)  # the subnormal spacing
    below_mid = float(torch.tensor(_midpoint_past_max(spec)).nextafter(torch.tensor(0.0)))
    top = 0x7E if codec == "fp8_e4m3" else 0x7B  # the code of +code_max
    cases = [  # (v, code); a list, as 0.0 == -0.0 would merge as dict keys
        (0.0, 0x00), (-0.0, 0x80),
        (step_min / 2, 0x00), (-step_min / 2, 0x80),      # tie: to the even code 0
        (1.5 * step_min, 0x02), (2.5 * step_min, 0x02),    # ties: to the even codes 2, 2
        (step_min, 0x01), (2.0 ** spec.emin, 1 << spec.mbits),  # the smallest subnormal and normal
        (spec.code_max, top), (-spec.code_max, top | 0x80),
        (below_mid, top), (-below_mid, top | 0x80),        # just below the midpoint past code_max
    ]
    v = torch.tensor([c[0] for c in cases], dtype=torch.float32)
    want = torch.tensor([c[1] for c in cases], dtype=torch.uint8)
    assert torch.equal(_kernel_codes(v, codec, True), want)
    assert torch.equal(ref.encode_codes_bits(v, spec), want)


@triton.jit
def _k_chunks_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    i, k, j = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + i[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * N + j[None, :])
    tl.store(out_ptr + i[:, None] * N + j[None, :], _dot_k_chunks(a, b, "ieee"))


def test_dot_by_k_chunks_pairs_each_column_chunk_with_its_row_chunk():
    """`_dot_k_chunks` (the FP32-input compress dot on sm_80) equals a @ b up to FP32 summation:
    a wrong pairing of a's column chunks with b's row chunks would be off by O(1)."""
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 128, generator=g)
    b = torch.randint(-1, 2, (128, 32), generator=g).float()  # +-1, 0: a table-like operand
    out = torch.empty(16, 32, device=DEVICE)
    _k_chunks_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, M=16, K=128, N=32)
    out = out.cpu()
    want = a.double() @ b.double()
    bound = 128 * 2.0**-24 * (a.double().abs() @ b.double().abs())  # gamma_K |a| |b|
    assert bool(((out.double() - want).abs() <= bound).all())


@triton.jit
def _decode_kernel(c_ptr, out_ptr, CODEC: tl.constexpr, NV: tl.constexpr, OUT: tl.constexpr):
    i = tl.arange(0, 256)
    tl.store(out_ptr + i, decode_codes(tl.load(c_ptr + i), CODEC, False, OUT, NV).to(tl.float32))


@pytest.mark.parametrize("out", ["fp16", "fp32"])
@pytest.mark.parametrize("nv", [True, False], ids=["nvidia", "generic"])
@pytest.mark.parametrize("codec", FP8)
def test_fp8_decoder_equals_reference_for_every_code(codec, nv, out):
    """Every byte, NaN codes and -0 included. The NVIDIA path (E4M3 read as fp8e4b15) runs on GPUs
    only: the interpreter's own fp8e4b15 conversion gets subnormals wrong, Triton's PTX does not
    (`test_fp8e4b15_ptx_places_e4m3_bits_in_fp16_fields`)."""
    if nv and not ON_GPU:
        pytest.skip("the fp8e4b15 conversion is exact in Triton's PTX, not in its interpreter")
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    got = torch.empty(256, device=DEVICE)
    _decode_kernel[(1,)](codes, got, CODEC=CODEC_IDS[codec], NV=nv, OUT=tl.float16 if out == "fp16" else tl.float32)
    got, want = got.cpu(), ref.decode_codes(codes.cpu(), CODEC_SPECS[codec])
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()].view(torch.int32), want[~want.isnan()].view(torch.int32))  # -0 too


def test_fp8e4b15_ptx_places_e4m3_bits_in_fp16_fields():
    """Triton's fp8e4b15 -> fp16 conversion on NVIDIA (`triton.language.extra.cuda.utils`, four
    codes per 32-bit word, the instructions below) is pure bit placement: each code's sign to fp16
    bit 15, its 7 other bits to bits 13..7, i.e. the fp16 of the E4M3 value times 2^-8, for every
    code (subnormals exact; 0x7F / 0xFF give +-1.875, which `decode_codes` turns into NaN)."""
    codes = torch.arange(256, dtype=torch.int64)
    words = codes[:, None] | (codes.roll(1)[:, None] << 8) | (codes.roll(2)[:, None] << 16) | (codes.roll(3)[:, None] << 24)
    w = words.flatten()
    byte = [(w >> (8 * k)) & 0xFF for k in range(4)]
    a0 = byte[2] | (byte[0] << 8) | (byte[3] << 16) | (byte[1] << 24)  # prmt.b32 a0, 0, w, 0x5746
    b0 = (a0 & 0x7F007F00) >> 1                                         # and, shr
    b1 = (a0 & 0x00FF00FF) + (a0 & 0x00800080)                          # and, and, add
    out0 = b0 | (a0 & 0x80008000)                                       # lop3 0xf8: b0 | (0x80008000 & a0)
    out1 = (b1 << 7) & 0xFFFFFFFF                                       # shl
    halves = [out0 & 0xFFFF, out0 >> 16, out1 & 0xFFFF, out1 >> 16]     # codes 0, 1, 2, 3 of the word
    got = torch.stack(halves, 1).to(torch.int16).view(torch.float16).float() * 256.0
    want = ref.decode_codes(torch.stack(byte, 1).to(torch.uint8), CODEC_SPECS["fp8_e4m3"])
    nan = want.isnan()
    assert torch.equal(got[nan].abs(), torch.full_like(got[nan], 480.0))  # 1.875 * 256: the NaN codes
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


@triton.jit
def _rows_kernel(x_ptr, h_ptr, out_ptr, R: tl.constexpr, G: tl.constexpr, TRANSPOSED: tl.constexpr):
    i, k = tl.arange(0, R), tl.arange(0, G)
    x = tl.load(x_ptr + i[:, None] * G + k[None, :])
    h = tl.load(h_ptr + k[:, None] * G + k[None, :])
    tl.store(out_ptr + i[:, None] * G + k[None, :], hadamard_rows(x, h, h, R, G, "ieee", False, TRANSPOSED))


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "plain"])
def test_hadamard_rows_transposed_dot_is_x_times_table(transposed):
    """The transposed dot (decompress of E4M3 on sm_80) computes x @ T, not x @ T^T: checked with a
    table that is not symmetric, up to FP32 summation of exact fp16 products."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randint(-64, 65, (16, 64), generator=g).float() / 8).half()  # exact in fp16
    t = (torch.randint(0, 2, (64, 64), generator=g) * 2 - 1).half()  # +-1, not symmetric
    assert not torch.equal(t, t.T)
    out = torch.empty(16, 64, device=DEVICE)
    _rows_kernel[(1,)](x.to(DEVICE), t.to(DEVICE), out, R=16, G=64, TRANSPOSED=transposed)
    out = out.cpu()
    assert torch.equal(out.double(), x.double() @ t.double())  # sums of multiples of 1/8 below 2^24: exact
