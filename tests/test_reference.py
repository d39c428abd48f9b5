"""The reference's building blocks against torch's own casts and the format definitions."""
import pytest
import torch

from taco_triton import reference as ref
from taco_triton.config import CODEC_SPECS, GROUP_SIZES


def _fp32_sweep(n: int = 200_000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mant = torch.rand(n, generator=g) + 1.0
    expo = torch.randint(-40, 20, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    ties = torch.arange(0, 2**12).float() * 2.0**-12  # exact halfway points of every FP8 binade
    return torch.cat([sign * mant * torch.exp2(expo), ties, -ties, torch.tensor([0.0, -0.0])])


@pytest.mark.parametrize("codec", list(CODEC_SPECS))
def test_integer_bit_encoder_equals_torch_cast(codec):
    spec = CODEC_SPECS[codec]
    v = _fp32_sweep().clamp(-spec.code_max, spec.code_max)
    bf16_all = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bf16_all = bf16_all[torch.isfinite(bf16_all)].clamp(-spec.code_max, spec.code_max)
    for vals in (v, bf16_all):
        assert torch.equal(ref.encode_codes_bits(vals, spec), ref.encode_codes(vals, spec))


@pytest.mark.parametrize("codec", list(CODEC_SPECS))
def test_stochastic_encoder_picks_a_neighbour(codec):
    spec = CODEC_SPECS[codec]
    v = _fp32_sweep(50_000).clamp(-spec.code_max, spec.code_max)
    rand = ref.random_bits(3, torch.arange(v.numel()))
    got = ref.decode_codes(ref.encode_codes_bits(v, spec, "stochastic", rand), spec).double()
    step = 2 * spec.half_ulp(v)
    assert bool(((got - v.double()).abs() < step).all())


def test_ue4m4_encoder_returns_the_smallest_code_not_below():
    codes = torch.arange(0, 241)
    vals = ref.decode_ue4m4(codes)
    assert bool((vals[1:] > vals[:-1]).all()) and vals[240] == 1.0
    assert torch.equal(ref.encode_ue4m4_ceil(vals), codes)  # representable values map to themselves
    r = torch.rand(100_000, generator=torch.Generator().manual_seed(1)) ** 6
    c = ref.encode_ue4m4_ceil(r)
    assert bool((ref.decode_ue4m4(c) >= r).all())
    assert bool((ref.decode_ue4m4((c - 1).clamp_min(0)) < r).all())
    assert torch.isnan(ref.decode_ue4m4(torch.tensor([255]))).all()


@pytest.mark.parametrize("g", GROUP_SIZES)
def test_hadamard_is_orthogonal_up_to_scale(g):
    h = ref.hadamard_matrix(g, torch.float64)
    assert torch.equal(h @ h, g * torch.eye(g, dtype=torch.float64))
    x = torch.randn(5, g, dtype=torch.float64)
    assert torch.allclose(ref.hadamard_inverse(ref.hadamard_forward(x)), x, rtol=0, atol=1e-12 * x.abs().max())


def test_random_bits_are_reproducible_and_seeded():
    idx = torch.arange(1 << 16) + (5 << 32)
    a, b, c = ref.random_bits(1, idx), ref.random_bits(1, idx), ref.random_bits(2, idx)
    assert torch.equal(a, b) and (a != c).float().mean() > 0.99
    bits = torch.stack([(a >> k) & 1 for k in range(32)]).double().mean(dim=1)
    assert bool(((bits - 0.5).abs() < 6 * 0.5 / (1 << 8)).all())  # 6 sigma of a fair coin over 2^16 draws
