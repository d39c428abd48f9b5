"""The kernels' FP8 encoder and decoder (`kernels._common`) against the reference, value by value.

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
from taco_triton.kernels._common import CODEC_IDS, NEAREST, _dot_k_chunks, encode_codes

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
    out = torch.empty(v.numel(), dtype=torch.uint8)
    _encode_kernel[(triton.cdiv(v.numel(), BLOCK),)](v, out, v.numel(), CODEC=CODEC_IDS[codec], MBITS=spec.mbits,
                                                    EMIN=spec.emin, HW=hw, BLOCK=BLOCK)
    return out


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
    out = torch.empty(16, 32)
    _k_chunks_kernel[(1,)](a, b, out, M=16, K=128, N=32)
    want = a.double() @ b.double()
    bound = 128 * 2.0**-24 * (a.double().abs() @ b.double().abs())  # gamma_K |a| |b|
    assert bool(((out.double() - want).abs() <= bound).all())
