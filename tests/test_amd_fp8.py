"""AMD-only code paths: the identities behind the gfx94x FP8 encoder and E4M3 decoder (`kernels._common.encode_fp8_fnuz`,
`decode_fp8_fnuz`).

AMD CDNA3 converts FP32 to FP8 only in the FNUZ flavours (e4m3fnuz, e5m2fnuz: exponent bias one
above OCP's e4m3fn / e5m2, no -0, no Inf). The kernels there take the FNUZ code of v / 2,
round-to-nearest-even like the hardware, keep its low 7 bits and put v's sign bit back; this
must be the OCP code of v (what `reference.encode_codes` gives) for every |v| <= code_max. The
kernel path itself only runs on that GPU (Triton's interpreter does not round its FP8 casts to
nearest even); here torch's FNUZ casts stand in for the hardware's.
"""
import pytest
import torch

from taco_triton import reference
from taco_triton.config import CODEC_SPECS

FNUZ = {"fp8_e4m3": torch.float8_e4m3fnuz, "fp8_e5m2": torch.float8_e5m2fnuz}


def _fnuz_route(v: torch.Tensor, codec: str) -> torch.Tensor:
    """The kernel's formula: FNUZ code of v / 2, low 7 bits, v's sign bit."""
    fnuz = (v * 0.5).to(FNUZ[codec]).view(torch.uint8)
    sign = ((v.view(torch.int32) >> 24) & 0x80).to(torch.uint8)
    return (fnuz & 0x7F) | sign


def _probe_values(codec: str) -> torch.Tensor:
    """Every code's value, the midpoints between neighbours (ties) and one FP32 ulp either side,
    zeros, FP32 subnormals, and random values over the whole range and near zero; both signs."""
    spec = CODEC_SPECS[codec]
    grid = reference.decode_codes(torch.arange(256, dtype=torch.uint8), spec)
    grid = grid[torch.isfinite(grid) & (grid >= 0) & (grid <= spec.code_max)].unique().double()
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    g = torch.Generator().manual_seed(0)
    parts = [
        grid.float(), mids,
        torch.nextafter(mids, torch.full_like(mids, float("inf"))),
        torch.nextafter(mids, torch.zeros_like(mids)),
        torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 1e-30]),
        torch.rand(200_000, generator=g) * spec.code_max,
        torch.exp2(torch.rand(50_000, generator=g) * -30.0) * float(grid[1]) * 4,
    ]
    v = torch.cat(parts).clamp(max=spec.code_max)
    return torch.cat([v, -v])


@pytest.mark.parametrize("codec", ["fp8_e4m3", "fp8_e5m2"])
def test_fnuz_code_of_half_is_the_ocp_code(codec):
    v = _probe_values(codec)
    want = reference.encode_codes(v, CODEC_SPECS[codec])
    got = _fnuz_route(v, codec)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(v[i]), int(got[i]), int(want[i])) for i in bad[:8]]
    # the route reaches -0 (0x80) and the largest code, where the two formats differ
    assert int(_fnuz_route(torch.tensor([-0.0]), codec)) == 0x80
    assert int(_fnuz_route(torch.tensor([CODEC_SPECS[codec].code_max]), codec)) == int(
        reference.encode_codes(torch.tensor([CODEC_SPECS[codec].code_max]), CODEC_SPECS[codec]))


def test_fnuz_value_of_every_e4m3_code_doubled_is_its_ocp_value():
    """The decoder's formula: a code read as e4m3fnuz, times 2, with its NaN (0x80) made -0 and
    its +-240 (+-0x7F) made NaN."""
    codes = torch.arange(256, dtype=torch.uint8)
    want = reference.decode_codes(codes, CODEC_SPECS["fp8_e4m3"])
    f = codes.view(torch.float8_e4m3fnuz).float()
    got = torch.where(f.abs() == 240.0, float("nan"), f * 2.0)
    got = torch.where(f.isnan(), -0.0, got)
    assert torch.equal(got.isnan(), want.isnan())
    ok = ~want.isnan()
    assert torch.equal(got[ok].view(torch.int32), want[ok].view(torch.int32))  # bits: -0 included


def test_cdna_generation_of_targets():
    """The CDNA constexpr: 3 (FNUZ FP8 conversions) only on gfx94x; 0 on NVIDIA and the interpreter."""
    from taco_triton.kernels._launch import INTERPRETER, Target, target_flags

    gens = {a: Target("hip", a, 64).cdna for a in ("gfx908", "gfx90a", "gfx940", "gfx942", "gfx950", "gfx1100")}
    assert gens == {"gfx908": 1, "gfx90a": 2, "gfx940": 3, "gfx942": 3, "gfx950": 4, "gfx1100": 0}
    assert target_flags(Target("cuda", 90))["CDNA"] == 0
    assert target_flags(INTERPRETER)["CDNA"] == 0
