"""`CompressionPolicy`: which config each communication site uses, and a data-driven plan;
`decide`: the one decision every user of a policy makes for a message.

A site is a named communication point: "<module name>.<role>" (for example
"layers.3.mlp.fc2.reduce" or "layers.0.attn.qkv.copy"), in one direction ("forward" or
"backward"). The policy answers `config_for(site, direction)` with a `CompressionConfig`, or
None for the native collective. Its users (the TP mappings, the megatron and DTensor
integrations, the compressing process group) sit above the collectives; the policy only needs
the collectives' `DEFAULT_MIN_BYTES`.

Data-driven plan: with `calibrate_steps=K > 0`, the first K training steps communicate with the
default config while the policy keeps a few finite samples per site on every rank (samples
holding NaN/Inf, as on an AMP overflow step, are skipped and counted); at the end of step K every
rank measures the candidates on its own samples (`taco_triton.calibrate.measure`), the
measurements are gathered, and every rank decides the same plan from all of them (or raises the
same ValueError: no rank waits on another's exception). An error budget is thus checked against
every rank's tensors, with the margin for later steps' tensors (`calibrate`'s `rel_l2_bound`).
The plan is frozen and saved to `plan` (JSON). A later run that finds the file loads it instead.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .calibrate import check_budget, choose, default_candidates, measure, merge
from .collectives.compressed import DEFAULT_MIN_BYTES
from .config import INPUT_DTYPES, CompressionConfig

DIRECTIONS = ("forward", "backward")
"""The directions a site's message flows in: activations forward, gradients backward."""
_PLAN_VERSION = 1
#: What a calibrated plan records per site (columns of `calibrate`'s table).
_MEASURED = ("rate_bytes_per_element", "rel_l2_mean", "rel_l2_max", "rel_l2_bound", "margin")


def _key(site: str, direction: str) -> str:
    return f"{site}|{direction}"


@dataclass
class CompressionPolicy:
    """Per-site compression of communication (tensor-, pipeline- and data-parallel).

    What is observed: every message that could be compressed - a bf16, fp16 or fp32 tensor of
    at least `min_bytes` (the whole buffer, as the collectives count it: all_reduce the tensor,
    reduce_scatter the input, all_gather the output), over more than one rank, with a reduce op
    the collectives compress (sum, avg) - is shown to `observe(site, direction, tensor)` before
    `config_for` decides it (`decide`), whatever the site's config; nothing else is (a smaller
    message, an integer tensor, a receive buffer). `observe` keeps samples only while
    calibrating, and only of sites the policy compresses.

    Args:
        default: config for every site not exempt or overridden; None compresses nothing.
        min_bytes: messages smaller than this run natively (see the collectives).
        exempt: fnmatch patterns of site names that always communicate natively.
        forward: compress what flows forward (activations; megatron's DP parameter all-gather);
            False: native.
        backward: compress the gradients (TP dgrads, PP activation gradients, megatron's DP
            gradient reductions); False: native.
        overrides: pattern -> config for particular sites (first matching pattern wins).
        plan: JSON path. If it exists it is loaded (and the plan frozen) at construction;
            otherwise calibration writes it.
        calibrate_steps: K > 0 collects samples for K steps, then calibrates every site.
        max_bytes_per_element: the calibration budget (see `taco_triton.calibrate`), a positive
            finite number. Calibration varies codec, group size and Hadamard around each site's
            configured config (default or override) and keeps its scales, rounding and seed.
        max_error: an error budget for calibration (needs `calibrate_steps` > 0; ValueError
            otherwise): each site gets the config with the fewest bytes whose worst relative L2
            error on every rank's samples, plus the margin for held-out tensors of the site
            (`rel_l2_bound`), is within it (see `taco_triton.calibrate`). A number applies to both directions; a dict such as
            {"forward": 0.025, "backward": 0.01} sets each direction (a direction left out is
            calibrated for the lowest error within the byte budget). `plan_table()` shows each
            site's choice and its measured error.
        samples_per_site: how many tensors per site calibration keeps.
        comm_dtype: dtype activations and gradients are communicated in (None: their own).
            torch.bfloat16 reproduces bf16 training's communication while computing in FP32.
            Applied by our TP layers and the DTensor integration; the megatron integration
            communicates in megatron's own dtypes on every axis and does not apply it.

    Example:
        >>> p = CompressionPolicy(exempt=["layers.0.*"], backward=False)
        >>> p.config_for("layers.0.mlp.reduce", "forward") is None
        True
        >>> p.config_for("layers.1.mlp.reduce", "forward").codec
        'fp8_e4m3'
        >>> p.config_for("layers.1.mlp.reduce", "backward") is None
        True
    """

    default: CompressionConfig | None = field(default_factory=CompressionConfig)
    min_bytes: int = DEFAULT_MIN_BYTES
    exempt: Sequence[str] = ()
    forward: bool = True
    backward: bool = True
    overrides: Mapping[str, CompressionConfig] = field(default_factory=dict)
    plan: str | os.PathLike | None = None
    calibrate_steps: int = 0
    max_bytes_per_element: float = 1.0625
    max_error: float | Mapping[str, float] | None = None
    samples_per_site: int = 4
    comm_dtype: torch.dtype | None = None
    _plan: dict = field(default_factory=dict, init=False, repr=False)
    _measured: dict = field(default_factory=dict, init=False, repr=False)
    _frozen: bool = field(default=False, init=False, repr=False)
    _samples: dict = field(default_factory=dict, init=False, repr=False)
    _steps: int = field(default=0, init=False, repr=False)
    skipped_nonfinite: dict = field(default_factory=dict, init=False, repr=False)
    """{"site|direction": count} of samples skipped because they held NaN/Inf."""

    def __post_init__(self) -> None:
        if self.default is not None and not isinstance(self.default, CompressionConfig):
            raise TypeError(f"default must be a CompressionConfig or None, got {type(self.default).__name__}")
        if isinstance(self.exempt, str) or not isinstance(self.exempt, (list, tuple)) or not all(
            isinstance(p, str) for p in self.exempt
        ):
            raise TypeError(f"exempt must be a list or tuple of fnmatch patterns (str), not a single string; got {self.exempt!r}")
        for name, value, low in (("min_bytes", self.min_bytes, 0), ("calibrate_steps", self.calibrate_steps, 0),
                                 ("samples_per_site", self.samples_per_site, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        check_budget("max_bytes_per_element", self.max_bytes_per_element)
        budgets = self.max_error if isinstance(self.max_error, Mapping) else {}
        if set(budgets) - set(DIRECTIONS):
            raise ValueError(f"max_error keys must be among {DIRECTIONS}, got {sorted(budgets)}")
        for value in budgets.values() if budgets else [self.max_error]:
            if value is not None:
                check_budget("max_error", value, f" per direction or None (got max_error={self.max_error!r})")
        if self.max_error is not None and self.calibrate_steps == 0:  # an error budget nothing would apply
            raise ValueError(f"max_error={self.max_error!r} needs calibrate_steps > 0: the budget is applied "
                             "by calibrating on the first calibrate_steps steps' samples")
        for pat, cfg in dict(self.overrides).items():
            if not isinstance(pat, str) or not (cfg is None or isinstance(cfg, CompressionConfig)):
                raise TypeError(f"overrides must map patterns (str) to CompressionConfig or None, got {pat!r}: {cfg!r}")
        if self.comm_dtype not in (None, torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"comm_dtype must be None, bf16, fp16 or fp32, got {self.comm_dtype}")
        if self.plan is not None and os.path.exists(self.plan):
            self.load_plan(self.plan)

    # ------------------------------------------------------------------ answering
    @property
    def frozen(self) -> bool:
        """True once a plan is in force (loaded or calibrated)."""
        return self._frozen

    @property
    def calibrating(self) -> bool:
        """True while samples are collected (`calibrate_steps` > 0 and no plan in force yet)."""
        return self.calibrate_steps > 0 and not self._frozen

    def config_for(self, site: str, direction: str) -> CompressionConfig | None:
        """The config for `site` in `direction`: the frozen plan's, else the first matching
        override's, else `default`; None where the direction is off or the site exempt.

        Args:
            site: the site name.
            direction: "forward" or "backward".

        Returns:
            The config, or None for the native collective.

        Raises:
            ValueError: `direction` is not one of `DIRECTIONS`.
        """
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if not (self.forward if direction == "forward" else self.backward):
            return None
        if any(fnmatch.fnmatchcase(site, pat) for pat in self.exempt):
            return None
        if self._frozen and _key(site, direction) in self._plan:
            cfg = self._plan[_key(site, direction)]
        else:
            cfg = next((c for pat, c in self.overrides.items() if fnmatch.fnmatchcase(site, pat)), self.default)
        return cfg if cfg is not None and cfg.enabled else None

    # ------------------------------------------------------------------ calibration
    def observe(self, site: str, direction: str, tensor: torch.Tensor) -> None:
        """Keep a sample of what `site` communicates (only while calibrating; cheap otherwise).

        A sample holding NaN/Inf is skipped and counted in `skipped_nonfinite`.

        Args:
            site: the site name.
            direction: "forward" or "backward".
            tensor: the message (copied to CPU float32 when kept).
        """
        if not self.calibrating or self.config_for(site, direction) is None:
            return
        key = _key(site, direction)
        bucket = self._samples.setdefault(key, [])
        if len(bucket) < self.samples_per_site:
            sample = tensor.detach().to("cpu", torch.float32, copy=True)
            if bool(torch.isfinite(sample).all()):
                bucket.append(sample)
            else:
                self.skipped_nonfinite[key] = self.skipped_nonfinite.get(key, 0) + 1

    def step(self, group=None) -> None:
        """Call once per training step. At the end of step `calibrate_steps` every rank of `group`
        measures the candidates on its own samples, the measurements are gathered, and every rank
        decides the same plan from all of them (or raises the same ValueError); the plan is frozen
        and (if `plan` is a path) saved by rank 0.

        Args:
            group: the torch.distributed group whose ranks calibrate together (a collective on
                that step: every rank of it must call); None is the world.

        Raises:
            ValueError: calibration failed on some rank (no candidate within the budgets, a
                bad sample): the same error on every rank, naming the site and the step.
        """
        if not self.calibrating:
            return
        self._steps += 1
        if self._steps < self.calibrate_steps:
            return
        import torch.distributed as dist

        distributed = dist.is_available() and dist.is_initialized()
        rank = dist.get_rank(group) if distributed else 0
        try:
            mine = (self._measure_local(), None)
        except (ValueError, TypeError) as e:  # every rank raises it below, none waits
            mine = (None, f"rank {rank}: {type(e).__name__}: {e}")
        everyone = [mine]
        if distributed:
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
        self._samples = {}
        errors = [err for _, err in everyone if err is not None]
        try:
            if errors:
                raise ValueError(errors[0])
            self._plan, self._measured = self._decide([tables for tables, _ in everyone])
        except ValueError as e:  # the same inputs on every rank: the same error everywhere
            raise ValueError(f"CompressionPolicy calibration failed at step {self._steps}: {e}") from None
        self._frozen = True
        if self.plan is not None and rank == 0:
            self.save_plan(self.plan)

    def error_budget(self, direction: str) -> float | None:
        """The calibration error budget of one direction.

        Args:
            direction: "forward" or "backward".

        Returns:
            The budget, or None (lowest error within the byte budget).
        """
        if isinstance(self.max_error, Mapping):
            return self.max_error.get(direction)
        return self.max_error

    def _measure_local(self) -> dict:
        """{"site|direction": `calibrate.measure` table} of this rank's samples. The candidates
        vary codec, group size and Hadamard around the site's configured config and keep its
        scales, rounding and seed, so each is measured as it will run."""
        tables = {}
        for key, samples in sorted(self._samples.items()):
            if not samples:  # every sample was non-finite: the site keeps its configured default
                continue
            site, _, direction = key.rpartition("|")
            base = self.config_for(site, direction) or CompressionConfig()
            tables[key] = measure(samples, default_candidates(base), backend="torch")
        return tables

    def _decide(self, per_rank: list[dict]) -> tuple[dict, dict]:
        """The plan and its measurements from every rank's tables (a site merges the ranks that
        sampled it)."""
        plan, measured = {}, {}
        for key in sorted({k for tables in per_rank for k in tables}):
            site, _, direction = key.rpartition("|")
            try:
                res = choose(merge([t[key] for t in per_rank if key in t]), self.max_bytes_per_element,
                             self.error_budget(direction))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            plan[key] = res.config
            row = res.table[res.table.chosen].iloc[0]
            measured[key] = {k: float(row[k]) for k in _MEASURED}
        return plan, measured

    # ------------------------------------------------------------------ persistence
    def plan_dict(self) -> dict:
        """The frozen plan.

        Returns:
            {"site|direction": config} (a copy; empty before a plan is in force).
        """
        return dict(self._plan)

    def plan_table(self):
        """The plan as a pandas DataFrame, one row per site and direction: the chosen codec,
        group size and Hadamard, and what calibration measured on the site's samples of every
        rank: wire bytes per element, mean and worst relative L2 error, the bound on held-out
        tensors that an error budget is compared with (`rel_l2_bound`) and its `margin` over
        the worst sample (NaN for a loaded plan saved without them).

        Returns:
            The DataFrame (no rows before a plan is in force).
        """
        import pandas as pd

        rows = []
        for key, cfg in sorted(self._plan.items()):
            site, _, direction = key.rpartition("|")
            got = self._measured.get(key, {})
            rows.append(dict(site=site, direction=direction, codec=cfg.codec, group_size=cfg.group_size,
                             hadamard=cfg.hadamard, **{k: got.get(k, float("nan")) for k in _MEASURED}))
        return pd.DataFrame(rows, columns=["site", "direction", "codec", "group_size", "hadamard", *_MEASURED])

    def save_plan(self, path) -> None:
        """Write the frozen plan and its measurements as JSON (replaced atomically).

        Args:
            path: the JSON file (`load_plan` and the `plan` argument read it back).
        """
        doc = {"version": _PLAN_VERSION, "entries": {k: dataclasses.asdict(c) for k, c in sorted(self._plan.items())},
               "measured": dict(sorted(self._measured.items()))}
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
        os.replace(tmp, path)

    def load_plan(self, path) -> None:
        """Load and freeze a plan saved by `save_plan`.

        Args:
            path: the JSON file.

        Raises:
            ValueError: the file cannot be read or is malformed (naming the path and why).
        """
        try:
            with open(path) as f:
                doc = json.load(f)
            if doc.get("version") != _PLAN_VERSION:
                raise ValueError(f"plan version {doc.get('version')!r}, expected {_PLAN_VERSION}")
            plan = {}
            for key, cfg in doc["entries"].items():
                site, _, direction = key.rpartition("|")
                if not site or direction not in DIRECTIONS:
                    raise ValueError(f"bad plan key {key!r}")
                plan[key] = CompressionConfig.from_dict(cfg)
            measured = doc.get("measured", {})  # plans saved before it was recorded have none
            if not isinstance(measured, dict) or not all(
                    isinstance(m, dict) and set(m) <= set(_MEASURED) for m in measured.values()):
                raise ValueError(f"bad 'measured' section: {measured!r:.200}")
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"cannot load compression plan {os.fspath(path)!r}: {e}") from None
        self._plan, self._measured, self._frozen = plan, {k: dict(m) for k, m in measured.items()}, True


def eligible(policy, tensor: torch.Tensor, nbytes: int | None = None, ranks: int = 2,
             compressible: bool = True) -> bool:
    """Whether a message could be compressed under `policy` (see `CompressionPolicy`).

    Args:
        policy: anything with `min_bytes`.
        tensor: what is sent.
        nbytes: the message's bytes as the collectives count them (default: the tensor's).
        ranks: processes in the group.
        compressible: False for a reduce op the collectives do not compress, or a message its
            caller keeps native.

    Returns:
        True for a strided bf16/fp16/fp32 tensor of at least `policy.min_bytes` bytes over more
        than one rank that is `compressible`.
    """
    if nbytes is None:
        nbytes = tensor.numel() * tensor.element_size()
    return (compressible and ranks > 1 and tensor.dtype in INPUT_DTYPES and tensor.layout == torch.strided
            and nbytes >= policy.min_bytes)


def decide(policy, site: str, direction: str, tensor: torch.Tensor, *, nbytes: int | None = None, ranks: int = 2,
           compressible: bool = True, observe: bool = True) -> CompressionConfig | None:
    """The config one message at `site` travels with, or None for the native path: the one
    decision the TP mappings, the megatron integration and the compressing process group make.

    A message that could be compressed (`eligible`) is first shown to `policy.observe` (unless
    `observe` is False: a receive buffer holds nothing yet), then `policy.config_for` decides it;
    any other message is native and not observed.

    Args:
        policy: a `CompressionPolicy`, or anything with `config_for(site, direction)`,
            `observe(site, direction, tensor)` and `min_bytes`; None: native.
        site: the site name.
        direction: "forward" or "backward".
        tensor: what is sent (all_gather: this rank's shard; a receive: its buffer).
        nbytes: the message's bytes as the collectives count them (all_gather: the output,
            P times the shard); default the tensor's.
        ranks: processes in the group.
        compressible: False for a message the caller keeps native whatever the policy says (a
            reduce op the collectives do not compress, megatron's parameter all-gather).
        observe: show the tensor to `policy.observe` when it could be compressed.

    Returns:
        The site's `CompressionConfig`, or None (native).

    Raises:
        ValueError: `direction` is not "forward" or "backward" (from `config_for`).

    Example:
        >>> import torch
        >>> p = CompressionPolicy(min_bytes=1024)
        >>> decide(p, "fc2.reduce", "forward", torch.zeros(512, dtype=torch.bfloat16)).codec
        'fp8_e4m3'
        >>> decide(p, "fc2.reduce", "forward", torch.zeros(511, dtype=torch.bfloat16)) is None
        True
    """
    if policy is None or not eligible(policy, tensor, nbytes, ranks, compressible):
        return None
    if observe:
        policy.observe(site, direction, tensor)
    return policy.config_for(site, direction)
