"""Public API behaviour: validation, edge cases, torch.compile, stochastic rounding, calibrate."""
import pytest
import torch

import taco_triton as taco

from .helpers import DEVICE, make_input


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.float8_e4m3fn, torch.bool], ids=str)
def test_unsupported_dtype_raises_type_error_naming_it(dtype):
    with pytest.raises(TypeError, match=str(dtype)):
        taco.compress(torch.zeros(8, dtype=dtype))


def test_bad_arguments():
    x = torch.randn(8)
    with pytest.raises(TypeError, match="list"):
        taco.compress([1.0, 2.0])
    with pytest.raises(TypeError, match="dict"):
        taco.compress(x, {"codec": "int8"})
    with pytest.raises(ValueError, match="'cuda'"):
        taco.compress(x, backend="cuda")
    with pytest.raises(TypeError, match="Tensor"):
        taco.decompress(x)
    c = taco.compress(x)
    with pytest.raises(ValueError, match="out must have 8 elements"):
        taco.decompress(c, out=torch.empty(9))
    with pytest.raises(ValueError, match="1-D uint8 with"):
        taco.decompress(c._replace(data=c.data[:-1]))


def test_triton_backend_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        taco.compress(torch.randn(8), backend="triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_round_trip_keeps_shape_dtype_device(dtype):
    x = make_input("dense", (2, 3, 130), dtype)
    c = taco.compress(x)
    assert c.data.dtype == torch.uint8 and c.data.dim() == 1 and c.data.is_contiguous()
    assert c.shape == x.shape and c.dtype == dtype and c.config == taco.CompressionConfig()
    y = taco.decompress(c)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device


def test_saturates_instead_of_overflowing():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        big = torch.finfo(dtype).max
        x = torch.full((4, 128), big, dtype=dtype, device=DEVICE)
        x[1] = -big
        x[2, ::2] = -big
        for cfg in (taco.CompressionConfig(), taco.CompressionConfig(codec="int8", group_size=512),
                    taco.CompressionConfig(codec="fp8_e5m2", hadamard=False)):
            y = taco.decompress(taco.compress(x, cfg))
            assert bool(torch.isfinite(y).all()), (dtype, cfg)
            assert float((y.double() - x.double()).abs().max()) <= 0.07 * big  # E5M2's half step: 2^-3 relative


def test_torch_compile_fullgraph():
    cfg = taco.CompressionConfig(codec="int8")

    def round_trip(t):
        return taco.decompress(taco.compress(t, cfg)) * 2

    x = make_input("dense", (4, 256), torch.bfloat16)
    compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager" if DEVICE == "cpu" else "inductor")
    assert torch.equal(compiled(x), round_trip(x))


def test_stochastic_rounding_is_unbiased_and_seeded():
    x = make_input("outliers", (4, 384), torch.float32, seed=4)
    n = 64

    def mean_of(rounding, hadamard):
        outs = [taco.decompress(taco.compress(x, taco.CompressionConfig(hadamard=hadamard, rounding=rounding, seed=s))).double()
                for s in range(n)]
        return torch.stack(outs).mean(0), outs[0]

    # Without Hadamard each element's rounding error has |e| < step and mean 0: by the CLT the
    # mean over n seeds is within 6 * (step / 2) / sqrt(n) of x (6 sigma over 1536 elements).
    cfg = taco.CompressionConfig(hadamard=False)
    c = taco.compress(x, cfg)
    from taco_triton.bounds import group_sigma

    sigma = group_sigma(c)[:, None].expand(-1, cfg.group_size).reshape(-1)[: x.numel()].view(x.shape)
    step = 2 * cfg.spec.half_ulp(x.double() / sigma) * sigma
    mean, one = mean_of("stochastic", False)
    assert bool(((mean - x.double()).abs() <= 6 * (step / 2) / n**0.5 + 1e-12).all())
    # With Hadamard: the error of the mean shrinks like 1/sqrt(n) (0.125 here); nearest rounding
    # is deterministic, so its mean keeps the whole error (ratio 1) - the check can fail.
    mean, one = mean_of("stochastic", True)
    assert float((mean - x).norm() / (one - x).norm()) < 0.25
    mean, one = mean_of("nearest", True)
    assert float((mean - x).norm() / (one - x).norm()) > 0.99
    a = taco.compress(x, taco.CompressionConfig(rounding="stochastic", seed=3)).data
    assert torch.equal(a, taco.compress(x, taco.CompressionConfig(rounding="stochastic", seed=3)).data)
    assert not torch.equal(a, taco.compress(x, taco.CompressionConfig(rounding="stochastic", seed=4)).data)


def test_outputs_are_poisoned_in_tests():
    from taco_triton import alloc

    assert alloc.poisoning() and bool(alloc.empty(4, torch.float32, "cpu").isnan().all())


def test_calibrate_picks_lowest_error_within_budget():
    samples = [make_input("outliers", (8, 384), torch.bfloat16, seed=s) for s in range(2)]
    res = taco.calibrate(samples, backend="torch")
    t = res.table
    assert len(t) == 50 and int(t.chosen.sum()) == 1
    chosen = t[t.chosen].iloc[0]
    assert chosen.rel_l2_mean == t[t.within_budget].rel_l2_mean.min()
    assert res.config.codec == chosen.codec and res.config.group_size == chosen.group_size
    tight = taco.calibrate(samples, max_bytes_per_element=1.01, backend="torch")
    assert tight.config.group_size >= 128 and bool(tight.table[tight.table.chosen].within_budget.all())
    with pytest.raises(ValueError, match="cheapest needs 0.50"):  # int4, G=512: 1/2 + 1/512 + 4/4096
        taco.calibrate(samples, max_bytes_per_element=0.5, backend="torch")
    with pytest.raises(ValueError, match="NaN"):
        taco.calibrate([torch.tensor([1.0, float("nan")])])


def test_calibrate_by_error_budget_picks_the_fewest_bytes_within_it():
    samples = [make_input("outliers", (8, 384), torch.bfloat16, seed=s) for s in range(2)]
    for budget in (0.05, 0.025, 0.01):
        res = taco.calibrate(samples, max_error=budget, backend="torch")
        t = res.table
        chosen = t[t.chosen].iloc[0]
        # the budget is compared with the bound on held-out tensors: the samples' worst error plus the margin
        assert t.rel_l2_bound.tolist() == pytest.approx((t.rel_l2_max + t.margin).tolist(), rel=1e-12)
        assert bool((t.margin >= 0).all())
        assert chosen.rel_l2_bound <= budget and bool((t.within_budget == (t.rel_l2_bound <= budget)).all())
        assert chosen.rate_bytes_per_element == t[t.rel_l2_bound <= budget].rate_bytes_per_element.min()
        assert res.config.codec == chosen.codec and res.config.group_size == chosen.group_size
    both = taco.calibrate(samples, max_bytes_per_element=0.7, max_error=0.2, backend="torch")
    assert both.config.codec == "int4"  # the byte budget leaves only int4
    with pytest.raises(ValueError, match=r"max_error=1e-05.*worst relative L2 error 0.00"):
        taco.calibrate(samples, max_error=1e-5, backend="torch")
    with pytest.raises(ValueError, match="max_error must be a positive number"):
        taco.calibrate(samples, max_error=0.0)
