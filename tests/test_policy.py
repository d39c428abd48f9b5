"""CompressionPolicy: site rules (pure), plan files, and the policy driving real TP layers on gloo ranks."""
import json

import pytest
import torch

import taco_triton as taco
from taco_triton.parallel import CompressionPolicy

from . import parallel_cases as cases
from .dist_utils import run_ranks

INT8 = taco.CompressionConfig(codec="int8")


def test_config_for_rules():
    p = CompressionPolicy(exempt=["layers.0.*", "*.copy"], overrides={"*.fc2.*": INT8, "*.fc*": None})
    assert p.config_for("layers.0.mlp.fc2.reduce", "forward") is None  # exempt beats override
    assert p.config_for("layers.1.attn.qkv.copy", "backward") is None
    assert p.config_for("layers.1.mlp.fc2.reduce", "forward") == INT8  # first matching override
    assert p.config_for("layers.1.mlp.fc1.gather", "forward") is None  # an override to None
    assert p.config_for("layers.1.attn.out.reduce", "forward") == taco.CompressionConfig()
    assert CompressionPolicy(default=None).config_for("a.reduce", "forward") is None
    assert CompressionPolicy(default=taco.CompressionConfig(enabled=False)).config_for("a.reduce", "forward") is None
    assert CompressionPolicy(forward=False).config_for("a.reduce", "forward") is None
    assert CompressionPolicy(backward=False).config_for("a.copy", "backward") is None
    with pytest.raises(ValueError, match="direction must be one of"):
        p.config_for("a.reduce", "sideways")
    with pytest.raises(TypeError, match="single string"):
        CompressionPolicy(exempt="layers.0.*")


def test_single_process_calibration_saves_and_loads(tmp_path):
    path = tmp_path / "plan.json"
    p = CompressionPolicy(calibrate_steps=2, plan=path)
    for step in range(2):
        p.observe("a.reduce", "forward", torch.randn(8, 256))  # small: calibration tries 50 configs
        p.observe("a.reduce", "backward", torch.randn(8, 256))
        p.step()
    assert p.frozen and path.exists()
    q = CompressionPolicy(plan=path)
    assert q.frozen and q.plan_dict() == p.plan_dict() and set(q.plan_dict()) == {"a.reduce|forward", "a.reduce|backward"}



def test_calibration_to_an_error_budget_per_direction(tmp_path):
    """Forward gets a loose budget (a sub-byte codec), backward a tight one (int8); the plan table
    shows each choice with the error measured on the site's samples, and survives save/load."""
    path = tmp_path / "plan.json"
    p = CompressionPolicy(calibrate_steps=1, plan=path, max_error={"forward": 0.05, "backward": 0.01})
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0))
    p.observe("a.reduce", "forward", x)
    p.observe("a.reduce", "backward", x)
    p.step()
    t = p.plan_table().set_index("direction")
    assert t.loc["forward", "rel_l2_max"] <= 0.05 and t.loc["backward", "rel_l2_max"] <= 0.01
    assert t.loc["forward", "codec"] in ("int6", "int4") and t.loc["backward", "codec"] == "int8"
    assert t.loc["forward", "rate_bytes_per_element"] < 0.8 < t.loc["backward", "rate_bytes_per_element"]
    assert CompressionPolicy(plan=path).plan_table().equals(p.plan_table())
    for bad in (0, -0.1, {"sideways": 0.1}, {"forward": "0.1"}, True):
        with pytest.raises(ValueError, match="max_error"):
            CompressionPolicy(max_error=bad)


_ENTRY = taco.CompressionConfig().to_dict()
MALFORMED = {
    "not_json": "{not json",
    "wrong_version": json.dumps({"version": 99, "entries": {}}),
    "no_entries": json.dumps({"version": 1}),
    "key_without_direction": json.dumps({"version": 1, "entries": {"a.reduce": _ENTRY}}),
    "bad_direction": json.dumps({"version": 1, "entries": {"a.reduce|sideways": _ENTRY}}),
    "unknown_field": json.dumps({"version": 1, "entries": {"a.reduce|forward": {**_ENTRY, "bogus": 1}}}),
    "bad_codec": json.dumps({"version": 1, "entries": {"a.reduce|forward": {**_ENTRY, "codec": "fp9"}}}),
    "entry_not_object": json.dumps({"version": 1, "entries": {"a.reduce|forward": 3}}),
    "top_level_list": "[]",
    "entries_list": json.dumps({"version": 1, "entries": []}),
    "bad_measured": json.dumps({"version": 1, "entries": {}, "measured": {"a.reduce|forward": {"bogus": 1}}}),
}


@pytest.mark.parametrize("text", list(MALFORMED.values()), ids=list(MALFORMED))
def test_malformed_plan_file_is_value_error(tmp_path, text):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="cannot load compression plan"):
        CompressionPolicy(plan=path)


def test_policy_drives_the_layers_on_two_ranks(tmp_path):
    """Exemptions, forward/backward switches, min_bytes, overrides (checked through WireStats and
    bitwise against direct collectives), then calibration: frozen after exactly 2 steps, the same
    plan on both ranks although they would choose differently (rank 0's choice), saved and loaded."""
    path = str(tmp_path / "plan.json")
    reports = run_ranks(cases.policy_battery, 2, path)
    cal = reports[0]["calibration"]
    assert cal == reports[1]["calibration"]
    saved = json.loads(open(path).read())
    assert saved["version"] == 1 and set(saved["entries"]) == {"cal.reduce|forward", "cal.copy|backward"}


@pytest.mark.parametrize("kwargs", [
    {"exempt": None}, {"exempt": [1]}, {"exempt": "layers.*"}, {"min_bytes": "1MB"}, {"min_bytes": -1},
    {"samples_per_site": 0}, {"calibrate_steps": 1.5}, {"max_bytes_per_element": "1"},
    {"overrides": {"a.*": "fp8"}},
], ids=lambda k: repr(k))
def test_policy_rejects_bad_arguments_at_construction(kwargs):
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        CompressionPolicy(**kwargs)


class _Observing(CompressionPolicy):
    """Keeps the (numel, dtype) of every tensor shown to `observe`."""

    def observe(self, site, direction, tensor):
        self.__dict__.setdefault("seen", []).append((tensor.numel(), tensor.dtype))
        super().observe(site, direction, tensor)


MIN_BYTES = 4096
#: (kind, what is sent): at and just below min_bytes, a non-float dtype, an all_gather shard below
#: min_bytes whose gathered message (the whole buffer, as the collectives count it) is not
DECIDED = [
    pytest.param("all_reduce", torch.zeros(2048, dtype=torch.bfloat16), id="bf16-at-min_bytes"),
    pytest.param("all_reduce", torch.zeros(2047, dtype=torch.bfloat16), id="bf16-below"),
    pytest.param("all_reduce", torch.zeros(1024, dtype=torch.float32), id="fp32-at"),
    pytest.param("all_reduce", torch.zeros(1024, dtype=torch.int32), id="int32-at"),
    pytest.param("all_gather", torch.zeros(1024, dtype=torch.bfloat16), id="all_gather-shard-below-output-at"),
    pytest.param("all_gather", torch.zeros(1023, dtype=torch.bfloat16), id="all_gather-output-below"),
]


@pytest.fixture
def two_fake_ranks():
    """torch's fake process group, rank 0 of 2: nothing moves (the collectives are recorded)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.distributed_c10d._get_default_group()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind, tensor", DECIDED)
def test_the_policy_callers_decide_and_observe_alike(kind, tensor, two_fake_ranks, monkeypatch):
    """The TP mappings, the megatron integration and the compressing process group (collectives
    and p2p) make one decision per message (`taco_triton.policy.decide`): they compress and
    observe exactly the messages that could be compressed - a float dtype, the whole buffer at
    least min_bytes - and nothing else (before, the mappings observed every message and megatron
    measured an all_gather by its shard)."""
    from taco_triton.collectives import compressed
    from taco_triton.integrations.megatron.mappings_mode import MegatronHandle
    from taco_triton.integrations.process_group import CompressingProcessGroup
    from taco_triton.parallel import gather_from_sp_region, reduce_from_tp_region

    p, nbytes = 2, tensor.numel() * tensor.element_size()
    message = p * nbytes if kind == "all_gather" else nbytes
    could = tensor.dtype in (torch.bfloat16, torch.float16, torch.float32) and message >= MIN_BYTES
    outcomes = {}

    issued = []
    for name in ("all_reduce", "all_gather"):
        monkeypatch.setattr(compressed, name, lambda *a, **k: issued.extend(
            c for c in a if isinstance(c, taco.CompressionConfig)))  # the config it was handed
    pol = _Observing(min_bytes=MIN_BYTES)
    mapping = reduce_from_tp_region if kind == "all_reduce" else gather_from_sp_region
    mapping(tensor, "s", pol)
    outcomes["mappings"] = (issued[-1].enabled, pol.__dict__.get("seen", []))

    pol = _Observing(min_bytes=MIN_BYTES)
    cfg, _ = MegatronHandle(pol)._decide("tp", "s", "forward", kind, tensor, p)
    outcomes["megatron"] = (cfg is not None, pol.__dict__.get("seen", []))

    pol = _Observing(min_bytes=MIN_BYTES)
    group = CompressingProcessGroup(0, p, two_fake_ranks, pol, [0, 1])
    cfg = group._decide(kind, tensor, message, "sum")
    outcomes["process_group"] = (cfg is not None, pol.__dict__.get("seen", []))
    if kind == "all_reduce":
        pol = _Observing(min_bytes=MIN_BYTES)
        group = CompressingProcessGroup(0, p, two_fake_ranks, pol, [0, 1])
        cfg = group._p2p_config([tensor], sending=True)
        outcomes["process_group_p2p"] = (cfg is not None, pol.__dict__.get("seen", []))

    want = (could, [(tensor.numel(), tensor.dtype)] if could else [])
    assert outcomes == {caller: want for caller in outcomes}
