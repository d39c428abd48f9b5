"""The one place the collectives and p2p touch CUDA streams and events, or ask about graph capture.

Everything here answers for the caller's current stream, on which the collectives run today (see
`_driver`): what tells the host that the work queued so far is complete (`completion`), how a
waiting stream is ordered after it (`wait_for`), whether a CUDA graph is being captured, and which
wire buffers a call may reuse (`buffer_key`). CPU tensors need none of it: their work is complete
when the call returns. Tests replace these functions to drive the CUDA rules on CPU (callers look
them up on this module at each call).
"""
from __future__ import annotations

import threading

import torch

#: `completion` while a CUDA graph is being captured: every replay writes the call's error record
#: again, so it is read after a device synchronization and never given back.
IN_GRAPH = "captured in a CUDA graph"


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no event query or sync then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def graph_seeds(device: torch.device) -> bool:
    """Whether a stochastic call on `device` takes its seeds from the device counter
    (`slots.seed_counter`): while a CUDA graph is captured, so that every replay rounds afresh.
    Outside graphs the seeds are the host's, salted with the call number."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def completion(device: torch.device):
    """What tells the host the work queued so far on `device` is done: None on CPU (done at once),
    a recorded CUDA event, or `IN_GRAPH` while a CUDA graph is being captured."""
    if device.type != "cuda":
        return None
    if torch.cuda.is_current_stream_capturing():
        return IN_GRAPH
    event = torch.cuda.Event()
    event.record()
    return event


def wait_for(done) -> None:
    """Order the current stream after `done` (a `completion`); nothing for None or `IN_GRAPH`."""
    if done is not None and done is not IN_GRAPH:
        torch.cuda.current_stream().wait_event(done)


def synchronize() -> None:
    """Wait on the host for all work on the current CUDA device."""
    torch.cuda.synchronize()


def buffer_key(device: torch.device):
    """Which of a plan's wire-buffer sets a call may reuse: one per calling thread and, on CUDA,
    current stream (see `Plan.buffers` for why that is safe); None while a CUDA graph is being
    captured: the call gets fresh buffers (from the graph's pool), which replays then own."""
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        return threading.get_ident(), torch.cuda.current_stream(device).cuda_stream
    return threading.get_ident()
