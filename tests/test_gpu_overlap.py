"""An async compressed all_reduce overlaps compute on the caller's stream (GPU only; a step of
bench/gpu_check.sh).

On a one-rank NCCL group (TACO_TRITON_COMPRESS_SINGLE_RANK=1: the whole compressed path runs),
a 64 MiB bf16 all_reduce is issued async, then a GEMM of about the same duration is queued on
the current stream, then the Work is waited. The device time from before the call to after the
wait must be at most 1.2 x the longer of the two alone: with the call's codec and communication
on the communication stream they overlap; run on the caller's stream (before issue 30) they add
up. The host issues everything while the device sleeps, so only device time is measured.
"""
import statistics

import pytest
import torch

import taco_triton as taco

from .test_cuda_graphs import one_rank_nccl  # noqa: F401 - the fixture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="the overlap needs a CUDA device (run by bench/gpu_check.sh)")

#: 64 MiB of bf16.
NUMEL = 32 << 20
#: Device cycles the current stream sleeps before each measurement, so that the host has issued
#: everything before the measured work starts (~10 ms at 2 GHz).
SLEEP_CYCLES = 20_000_000


def _device_ms(body, repeats: int = 5) -> float:
    """Median device time of `body()` (queued while the current stream sleeps), in ms."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        body()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def test_async_all_reduce_overlaps_a_gemm_on_the_current_stream(one_rank_nccl):  # noqa: F811
    x = torch.randn(NUMEL, device="cuda").bfloat16()

    def all_reduce():
        taco.all_reduce(x, min_bytes=0, async_op=True).wait()

    all_reduce()  # plan, tables, compilation
    torch.cuda.synchronize()
    t_comm = _device_ms(all_reduce)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    one = _device_ms(lambda: a @ a)
    reps = max(1, round(t_comm / one))  # a GEMM of about the collective's duration

    def gemm():
        for _ in range(reps):
            a @ a

    t_gemm = _device_ms(gemm)

    def both():
        work = taco.all_reduce(x, min_bytes=0, async_op=True)
        gemm()
        work.wait()

    t_both = _device_ms(both)
    assert t_both <= 1.2 * max(t_comm, t_gemm), (t_both, t_comm, t_gemm, reps)
    taco.check_errors()
