"""The house rules of the code, read from the source: each fused op builds its own launches, and
each fact of the wire format has one home.

A rule that names a file fails when the text it forbids appears anywhere else in the library or the
benchmarks, so a second copy of a fact (a tag width, the vector unit, the salt's formula) or a
second launch builder is caught when it is written, not when the copies drift apart.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "taco_triton").rglob("*.py"), *(ROOT / "bench").glob("*.py"), *(ROOT / "autotune").rglob("*.py")])


def _code(path: Path) -> str:
    """The file's code without comments and docstrings' prose lines (a rule is about code)."""
    out = []
    for line in path.read_text().splitlines():
        code = line.split("#", 1)[0]
        out.append(code)
    return "\n".join(out)


def offenders(pattern: str, homes: set[str]) -> list[str]:
    """`file:line: text` of every match of `pattern` outside `homes` (paths relative to the root)."""
    found = []
    rx = re.compile(pattern)
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        if rel in homes:
            continue
        for i, line in enumerate(_code(path).splitlines(), 1):
            if rx.search(line):
                found.append(f"{rel}:{i}: {line.strip()}")
    return found


KERNEL_OPS = {"taco_triton/kernels/compress.py", "taco_triton/kernels/decompress.py", "taco_triton/kernels/reduce.py"}


@pytest.mark.parametrize("builder", [
    "compress_launch", "compress_launches", "compress_slots_launch", "decompress_launch", "decompress_launches",
    "decompress_slots_launch", "reduce_launch", "Prepared",
])
def test_only_the_fused_ops_build_and_bind_launches(builder):
    """`ops`, the collectives' plans, p2p and bench/aot.py ask `CompressOp`, `DecompressOp` and
    `ReduceOp`: a change of a kernel's parameters is a change of its own module."""
    found = offenders(rf"\b{builder}\(", KERNEL_OPS | {"taco_triton/kernels/_launch.py"})
    assert not found, found


def test_every_point_to_point_message_goes_through_the_process_group_calls():
    """p2p's payloads, its handshakes and the integrations' sends are issued by `_pg` (`isend`,
    `irecv`, `send_fingerprint`), which counts them in `WireStats`."""
    found = offenders(r"\bdist\.(isend|irecv|send|recv)\(", {"taco_triton/collectives/_pg.py"})
    assert not [f for f in found if f.startswith("taco_triton/")], found


def test_only_the_cuda_seam_touches_cuda_in_the_collectives():
    """Streams, events and device queries of the collectives go through `_streams` (which tests
    replace with recording fakes, `host_audit.fake_streams`)."""
    found = [f for f in offenders(r"\btorch\.cuda\.", {"taco_triton/collectives/_streams.py"})
             if f.startswith("taco_triton/collectives/")]
    assert not found, found


def test_the_rule_reader_finds_a_copy():
    """The reader sees a builder call outside its home (it would be blind if `offenders` skipped all)."""
    assert offenders(r"\bcompress_slots_launch\(", set()), "the kernel module itself calls it"


# ------------------------------------------------------------------------------------------- state
MUTATORS_CALLS = {"dict", "list", "set", "deque", "defaultdict", "OrderedDict", "WeakKeyDictionary",
                 "WeakValueDictionary", "WeakSet", "count", "Counter"}


MUTATORS = {"append", "add", "update", "pop", "popitem", "clear", "setdefault", "extend", "remove", "insert", "discard"}


def module_state(path: Path) -> list[str]:
    """`line: name` of each module-level name bound to a mutable container (a literal, a
    comprehension or a container's constructor) that is state: a lower-case name, or an
    UPPER-CASE one (a constant table by convention) that the module changes (item assignment or
    deletion, a mutating method); and each `global` statement, in `path`."""
    import ast

    tree = ast.parse(path.read_text())
    changed = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Subscript) and isinstance(n.ctx, (ast.Store, ast.Del)) and isinstance(n.value, ast.Name):
            changed.add(n.value.id)
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS
                and isinstance(n.func.value, ast.Name)):
            changed.add(n.func.value.id)
    found = []
    for node in tree.body:
        targets, value = ([], None)
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and (getattr(value.func, "id", None) or getattr(value.func, "attr", None))
            in MUTATORS_CALLS)
        names = [t.id for t in targets if isinstance(t, ast.Name) and t.id != "__all__"
                 and (not t.id.lstrip("_").isupper() or t.id in changed)]
        if names and mutable:
            found.append(f"{node.lineno}: {', '.join(names)}")
    found += [f"{n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    return found


def test_no_module_level_mutable_state_outside_STATE():
    """Workers, handshakes, streams, seed counters, tuned lookups, eager launches, sites: every
    thing taco_triton keeps between calls lives in `taco_triton.state.STATE`, where one rule
    forgets a destroyed group's share of it. Constants (tuples, frozensets) and per-thread
    contexts (`threading.local`, `ContextVar`) are not state between calls."""
    found = {path.relative_to(ROOT).as_posix(): module_state(path) for path in sorted((ROOT / "taco_triton").rglob("*.py"))
             if path.relative_to(ROOT).as_posix() != "taco_triton/state.py"}
    found = {k: v for k, v in found.items() if v}
    assert not found, found


def test_the_state_reader_finds_module_state(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import weakref\n__all__ = []\nA = (1, 2)\n_cache: dict = {}\n_w = weakref.WeakKeyDictionary()\n"
                 "TABLE = {1: 2}\n_MEMO = {}\n\ndef f(k):\n    global A\n    _MEMO[k] = TABLE[k]\n")
    assert module_state(f) == ["4: _cache", "5: _w", "7: _MEMO", "10: global A"]


# ---------------------------------------------------------------------------- the wire's facts
SLOTS_HOME = {"taco_triton/kernels/slots.py"}
FACTS = {
    "tag width": r"to_bytes\(\s*4\b|int\.from_bytes\(|arange\(0,\s*4\)|<\s*4\s*,\s*\(tag",
    "salt formula": r"0x9E3779B9|2654435769|2147483648",  # its addend and modulus (the multiplier is a common prime)
    "vector unit": r"%\s*16\b|multiple_of\([^()]*(\([^()]*\))?[^()]*,\s*16\)|//\s*16\)\s*\*\s*16",
    "tag hash": r"crc32\(struct\.pack",
}


@pytest.mark.parametrize("fact", sorted(FACTS))
def test_each_fact_of_the_wire_has_one_home(fact):
    """The tag width, the stochastic salt, the 16-element vector unit (and 16-byte slot alignment)
    and the tag's CRC live in `kernels/slots.py` (host) and reach the kernels as `_slot_io`'s
    constexprs made from them."""
    found = offenders(FACTS[fact], SLOTS_HOME)
    assert not found, found


@pytest.mark.parametrize("fact, line", [
    ("tag width", '    list(self.tag.to_bytes(4, "little"))'),
    ("tag width", "    i = tl.arange(0, 4)"),
    ("salt formula", "    return (h.to(tl.int64) * 1000003 + s + 2654435769) % 2147483648"),
    ("salt formula", "cfg.replace(seed=(cfg.seed * 1_000_003 + call + 0x9E3779B9) % 2**31)"),
    ("vector unit", "    if numel % 16 == 0 or numel < TILE_ELEMS:"),
    ("vector unit", "slot = out_ptr + tl.multiple_of(tl.load(d + SLOT_OFF), 16)"),
    ("vector unit", "    return (v // 16) * 16"),
    ("tag hash", '    return struct.pack("<I", zlib.crc32(struct.pack(f"<I{len(where)}q", fp, *where)))'),
], ids=lambda v: v.strip()[:24].replace(" ", "_"))
def test_the_fact_reader_finds_the_copies_that_were_there(fact, line):
    """Each pattern matches the copies the code held before each fact got one home (p2p's tag
    bytes, the kernels' salt and tag literals, calibrate's salt, the aligned-split check)."""
    assert re.search(FACTS[fact], line)
