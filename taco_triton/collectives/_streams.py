"""The one place the collectives and p2p touch CUDA streams and events, or ask about graph capture.

Two schedules use them (`_driver`): a synchronous call runs on the caller's current stream; an
async call runs on the device's communication stream (`comm`), forked from the caller's stream
by one event and joined back by one event at `wait()`.

One communication stream per device, not per process group: every compressed async call on a
device then runs in issue order on one stream, so reusing a call's wire buffers stays a
single-stream argument (`Plan.buffers`), and NCCL's own ordering per communicator is unchanged
(its work is issued while that stream is current, so NCCL orders itself after it). Streams per
group would let calls on different groups run at the same time, but they would compete for the
same SMs with the compute they are meant to overlap, and double the wire-buffer sets.

CPU tensors need none of this: their work is complete when the call that ran it returns (the
group's worker thread runs async calls, `_worker`). Tests replace the primitives below with
recording fakes (`taco_triton.host_audit.fake_streams`) to drive the CUDA schedule on CPU: every
caller, this module included, looks them up on this module at each call.
"""
from __future__ import annotations

import threading

import torch

from ..state import STATE

#: `completion` while a CUDA graph is being captured: every replay writes the call's error record
#: again, so it is read after a device synchronization and never given back.
IN_GRAPH = "captured in a CUDA graph"


# ---------------------------------------------------------------- primitives (replaced by fakes)
def on_streams(device: torch.device) -> bool:
    """Whether work on `device` runs on CUDA streams (False: CPU, complete when it returns)."""
    return device.type == "cuda"


def current(device: torch.device):
    """The caller's current stream on `device`."""
    return torch.cuda.current_stream(device)


def comm(device: torch.device):
    """The communication stream of `device` (one per device; see the module docstring): from the
    high-priority pool (as ProcessGroupNCCL's can be), so that it is never a stream the caller took
    from torch's default pool, which would run the call on the caller's own stream (no overlap);
    made once, never the stream current when it is made."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = STATE.comm_streams.get(index)
    if stream is None:
        where = torch.device("cuda", index)
        stream = torch.cuda.Stream(where, priority=-1)
        while stream == torch.cuda.current_stream(where):  # the caller runs on a high-priority pool stream
            stream = torch.cuda.Stream(where, priority=-1)
        STATE.comm_streams[index] = stream
    return stream


def event():
    """A new event (no timing)."""
    return torch.cuda.Event()


def record(ev, stream) -> None:
    """Record `ev` on `stream`: it completes when the work queued on `stream` so far has."""
    ev.record(stream)


def wait_event(stream, ev) -> None:
    """Make `stream` wait for `ev` (no host synchronization)."""
    stream.wait_event(ev)


def indexed(device: torch.device) -> torch.device:
    """`device` with its index (a bare "cuda" is the current device)."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


def use(stream):
    """A context in which `stream` is the current stream."""
    return torch.cuda.stream(stream)


def record_stream(tensor: torch.Tensor, stream) -> None:
    """Tell the caching allocator that `stream` uses `tensor`: its memory is not handed to another
    allocation until the work queued on `stream` by then has completed."""
    tensor.record_stream(stream)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no event query or sync then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def synchronize(device: torch.device | None = None) -> None:
    """Wait on the host for all work on `device` (None: the current CUDA device)."""
    torch.cuda.synchronize(device)


# ---------------------------------------------------------------- built on the primitives
def graph_seeds(device: torch.device) -> bool:
    """Whether a stochastic call on `device` takes its seeds from the device counter
    (`slots.seed_counter`): while a CUDA graph is captured, so that every replay rounds afresh.
    Outside graphs the seeds are the host's, salted with the call number."""
    return device.type == "cuda" and capturing()


def completion(device: torch.device):
    """What tells the host the work queued so far on the current stream of `device` is done: None
    on CPU (done at once), a recorded event, or `IN_GRAPH` while a CUDA graph is being captured."""
    if not on_streams(device):
        return None
    if capturing():
        return IN_GRAPH
    ev = event()
    record(ev, current(device))
    return ev


def wait_for(done, device: torch.device | None = None) -> None:
    """Order the current stream (of `device`, default the current device) after `done` (a
    `completion`); nothing for None. While a graph is captured, the capturing stream waits for
    an event recorded in the same capture (the join of a fork); `IN_GRAPH` itself needs nothing."""
    if done is not None and done is not IN_GRAPH:
        wait_event(current(device if device is not None else torch.device("cuda")), done)


def allocation_stream(device: torch.device):
    """The stream a tensor allocated now on `device` belongs to (the current one), or None on CPU."""
    return current(device) if on_streams(device) else None


def used_here(tensor: torch.Tensor, allocated_on) -> None:
    """Before `tensor` (allocated with `allocated_on` current, see `allocation_stream`) is used on
    the current stream: if that is another stream, record it there, so the allocator does not hand
    its memory to another allocation before this stream is done with it (a received wire buffer
    decoded at `wait()` on another stream than the receive's)."""
    if allocated_on is None or capturing():
        return
    here = current(tensor.device)
    if here != allocated_on:
        record_stream(tensor, here)


def buffer_key(device: torch.device):
    """Which of a plan's wire-buffer sets a call may reuse: one per calling thread and, on CUDA,
    current stream (see `Plan.buffers` for why that is safe); None while a CUDA graph is being
    captured: the call gets fresh buffers (from the graph's pool), which replays then own."""
    if on_streams(device):
        if capturing():
            return None
        return threading.get_ident(), current(device)
    return threading.get_ident()
