"""A private network namespace whose loopback is throttled, to emulate a slow link on one machine.

    with LinkEmulation("2") as link:                    # rate in Gbit/s, or "unlimited"
        subprocess.run(link.wrap([sys.executable, "worker.py"]), check=True)   # ranks on 127.0.0.1
        link.set_rate("0.5")                            # tc qdisc replace, same namespace

What it does (root only; loopback inside a network namespace of its own, so nothing else is throttled):

    ip netns add taco-bench-<pid>-<random>
    ip -n NAME link set lo up
    tc -n NAME qdisc replace dev lo root tbf rate <R>mbit burst <B> peakrate <1.05R>mbit mtu 70000 latency 100ms
                                                        # (nothing for "unlimited"; see tbf_args)
    ip netns exec NAME <command>                        # what `wrap` returns
    ip netns del NAME                                   # always: on errors, KeyboardInterrupt, SIGTERM

Only the loopback device *inside the new namespace* is ever touched: nothing here configures an
address, a route, or any device of the host. Every rank talks over 127.0.0.1 in that namespace.

The emulated "link" is the namespace's loopback egress: one token bucket that *all* traffic of
all ranks, in both directions, goes through. With 2 ranks sending at the same time each gets
about half of the rate, i.e. rate R behaves like a shared (half-duplex) medium of R bit/s, not
a full-duplex NIC of R bit/s per direction (which would be about 2x faster for symmetric
collectives). Timings at different rates are comparable with each other, and native and
compressed runs see the same medium. (Measured: the native bf16 all_reduce of 2 ranks reaches a
busbw of exactly R/2 per rank at 0.5 and 2 Gbit/s; at 10 Gbit/s this 2-core machine's loopback
is CPU-bound first.)

Only SIGKILL of the owning process can leave a namespace behind: `ip netns list | grep
taco-bench` and `ip netns del NAME` remove it.

`disabled=True` (the benchmark's --no-netns) runs commands unwrapped on the host loopback,
without emulation; only the rate "unlimited" is accepted then, labelled "unlimited (no emulation)".
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys

UNLIMITED = "unlimited"
NO_EMULATION = "unlimited (no emulation)"


class NetnsError(RuntimeError):
    """The namespace could not be created or configured (not root, no `ip`/`tc`, no netns support)."""


def normalize_rate(rate) -> str:
    """'unlimited' or the rate in Gbit/s as a plain decimal string ('0.5', '10')."""
    s = str(rate).strip().lower()
    if s in ("unlimited", "inf", "none"):
        return UNLIMITED
    s = s.removesuffix("gbit").removesuffix("g")
    try:
        v = float(s)
    except ValueError:
        raise ValueError(f"link rate must be Gbit/s (e.g. 0.5, 10) or 'unlimited', got {rate!r}") from None
    if not v > 0:
        raise ValueError(f"link rate must be positive, got {rate!r}")
    return f"{v:g}"


def tbf_args(rate: str) -> list[str]:
    """tc arguments of the token bucket for `rate` Gbit/s.

    Burst: 128 KiB, or 0.5 ms of traffic above 2 Gbit/s; it must exceed one 64 KiB loopback
    segment (a 64 KiB burst stalls TCP). Peak rate: 1.05x the rate (second bucket of one
    70000-byte packet), so credit banked while the ranks compute cannot be spent faster than
    the link: without it a bucket refills during every compute phase and the next transfer
    starts with a free burst - with a 1 MiB burst (the common tbf recipe) a 1 MiB message at
    "0.5 Gbit/s" went out at 1.3 Gbit/s after an idle moment (measured here), and even a 128 KiB
    burst saved ~20 ms per idle gap at 0.05 Gbit/s, which favours bursty (compressed) traffic
    at exactly the sizes where min_bytes is decided. With the peak rate a 1 MiB message after
    idle took 159 ms at 0.05 Gbit/s (ideal 168) and 16.4 ms at 0.5 (ideal 16.8).
    Measured sustained: 0.050, 0.50, 1.95 Gbit/s at 0.05, 0.5, 2; about 5-7 Gbit/s at 10
    (this 2-core machine's loopback is CPU-bound there, not the bucket).
    """
    gbit = float(rate)
    rate_bytes = gbit * 1e9 / 8
    burst = max(128 << 10, int(rate_bytes * 0.0005))
    mbit = gbit * 1000
    return ["tbf", "rate", f"{mbit:g}mbit", "burst", str(burst), "peakrate", f"{mbit * 1.05:g}mbit",
            "mtu", "70000", "latency", "100ms"]


def _run(argv: list[str]) -> None:
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {p.returncode}): {p.stderr.strip() or p.stdout.strip()}")


class LinkEmulation:
    """Context manager: a fresh namespace with `lo` up and throttled to `rate` (see module doc)."""

    def __init__(self, rate="unlimited", *, disabled: bool = False, prefix: str = "taco-bench"):
        self.disabled = disabled
        self.name = None if disabled else f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.rate = None
        self._initial = rate
        self._created = False
        self._old_handlers: dict = {}

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "LinkEmulation":
        if self.disabled:
            self.set_rate(self._initial)
            return self
        if os.geteuid() != 0:
            raise NetnsError("emulating a link needs root (ip netns / tc); run as root or pass --no-netns")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise NetnsError(f"`{tool}` not found (iproute2); install it or pass --no-netns")
        # SIGTERM/SIGHUP -> KeyboardInterrupt-like exit so __exit__ still deletes the namespace.
        for sig in (signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
            except ValueError:  # not the main thread
                pass
        try:
            _run(["ip", "netns", "add", self.name])
            self._created = True
            _run(["ip", "-n", self.name, "link", "set", "lo", "up"])
            self.set_rate(self._initial)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Delete the namespace (idempotent; never raises, warns on stderr if deletion fails)."""
        if self._created:
            p = subprocess.run(["ip", "netns", "del", self.name], capture_output=True, text=True)
            if p.returncode != 0:
                print(f"WARNING: could not delete network namespace {self.name}: {p.stderr.strip()} "
                      f"(remove it with `ip netns del {self.name}`)", file=sys.stderr)
            else:
                self._created = False
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)
        self._old_handlers.clear()

    # -- use ---------------------------------------------------------------------------------
    @property
    def label(self) -> str:
        """The `link` column: Gbit/s as a string, 'unlimited', or 'unlimited (no emulation)'."""
        if self.disabled:
            return NO_EMULATION
        return self.rate

    def set_rate(self, rate) -> None:
        """Throttle (or un-throttle, for 'unlimited') the namespace's loopback.

        Always applied (not cached), so it is right whatever a previous process left behind.
        """
        rate = normalize_rate(rate)
        if self.disabled:
            if rate != UNLIMITED:
                raise NetnsError(f"link rate {rate} Gbit/s needs the network namespace (drop --no-netns)")
            self.rate = rate
            return
        base = ["tc", "-n", self.name, "qdisc"]
        if rate == UNLIMITED:
            if "tbf" in self.qdisc():
                _run(base + ["del", "dev", "lo", "root"])
        else:
            _run(base + ["replace", "dev", "lo", "root"] + tbf_args(rate))
        self.rate = rate

    @classmethod
    def attach(cls, name: str | None) -> "LinkEmulation":
        """A handle on a namespace someone else owns (None: --no-netns): `set_rate` works, and
        closing it deletes nothing. Used by rank 0 to change the rate between cells."""
        self = cls(disabled=name is None)
        self.name = name
        return self

    def wrap(self, argv: list[str]) -> list[str]:
        """`argv` run inside the namespace (unchanged when disabled)."""
        if self.disabled:
            return list(argv)
        if not self._created:
            raise NetnsError("namespace is not active (use `with LinkEmulation(...)`)")
        return ["ip", "netns", "exec", self.name] + list(argv)

    def qdisc(self) -> str:
        """`tc qdisc show dev lo` inside the namespace (for the log)."""
        if self.disabled:
            return "(no emulation: host loopback)"
        p = subprocess.run(["tc", "-n", self.name, "qdisc", "show", "dev", "lo"], capture_output=True, text=True)
        return p.stdout.strip() or p.stderr.strip()


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main(argv=None) -> None:
    """Smoke test: create a throttled namespace, show its qdisc and loopback, delete it."""
    import argparse

    ap = argparse.ArgumentParser(prog="python bench/netns.py", description=main.__doc__,
                                 epilog="Needs root (ip netns, tc); nothing outside the new namespace is touched.")
    ap.add_argument("rate", nargs="?", default="1", help="link rate in Gbit/s (e.g. 0.5, 10) or 'unlimited'")
    args = ap.parse_args(argv)
    try:
        normalize_rate(args.rate)  # a bad rate is a usage error, before anything is created
    except ValueError as exc:
        ap.error(str(exc))
    with LinkEmulation(args.rate) as link:
        print(link.name, "->", link.qdisc())
        subprocess.run(link.wrap(["ip", "addr", "show", "lo"]), check=True)
    print("deleted:", link.name, "present" if link.name in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout else "gone")


if __name__ == "__main__":
    main()
