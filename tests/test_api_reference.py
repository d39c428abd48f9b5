"""The API reference (docs/api/*.md) documents every public name, and each says what it takes,
returns and raises.

The public names: `__all__` of each module in `PUBLIC_MODULES` (the names a module defines and
does not underscore where it has no `__all__`), and the public methods and properties of every
public class. The reference is read from its `::: identifier` directives the way mkdocstrings
renders them (mkdocs.yml: members without a docstring are left out, an identifier that names a
module is the module even where the package re-exports a function of the same name), without
building the site.

Each public function, method and class has a docstring; a Google-style `Args:` section names
every parameter (a class: those of its constructor); a function that returns a value has a
`Returns:` section (a generator `Yields:`); a function that raises has a `Raises:` section
naming each exception type it raises itself. A constant has a docstring (the string after its
assignment, which is what mkdocstrings shows; a `#:` comment is not). Methods that implement a
base class from outside the package (torch's `ProcessGroup`, `nn.Module.forward`,
`ParallelStyle`) are documented by that base and not checked.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import textwrap
import types
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))

# The modules whose names are the public API (docs/api/index.md says the same to users).
PUBLIC_MODULES = [
    "taco_triton",
    "taco_triton.collectives",
    "taco_triton.collectives.p2p",
    "taco_triton.policy",
    "taco_triton.parallel",
    "taco_triton.integrations.megatron",
    "taco_triton.integrations.dtensor",
    "taco_triton.integrations.process_group",
    "taco_triton.integrations.sites",
    "taco_triton.calibrate",
    "taco_triton.estimate",
    "taco_triton.plan",
    "taco_triton.bounds",
    "autotune.runtime",
    "autotune.space",
    "autotune.sweep",
    "autotune.show",
]
PACKAGES = ("taco_triton", "autotune")
SECTIONS = ("Args", "Arguments", "Parameters", "Returns", "Yields", "Raises", "Attributes", "Examples",
            "Example", "Note", "Notes", "Warns", "Warnings", "See Also", "Other Parameters")
DIRECTIVE = re.compile(r"^::: (\S+)\n((?:[ \t]+\S.*\n?)*)", re.M)


# ---- the source: ast of a module, of a function -------------------------------------------------

@lru_cache(maxsize=None)
def module_ast(name: str) -> ast.Module:
    return ast.parse(Path(importlib.util.find_spec(name).origin).read_text())


def is_module_path(path: str) -> bool:
    try:
        spec = importlib.util.find_spec(path)
    except (ImportError, ValueError):
        return False
    return spec is not None


def own_nodes(fn: ast.AST):
    """The nodes of a function's body, without those of functions and classes defined inside it."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def function_node(fn) -> ast.FunctionDef | None:
    fn = inspect.unwrap(fn)
    try:
        src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    node = ast.parse(src).body[0]
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def assignments(module: str) -> dict[str, bool]:
    """{name: has a docstring} of the module-level assignments of `module`."""
    out, body = {}, module_ast(module).body
    for i, node in enumerate(body):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        nxt = body[i + 1] if i + 1 < len(body) else None
        documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                      and isinstance(nxt.value.value, str))
        for t in targets:
            if isinstance(t, ast.Name):
                out[t.id] = documented
    return out


def home_of_constant(module: str, name: str) -> tuple[str, str]:
    """(module, name) where a constant is assigned, following `from x import name` re-exports."""
    if name in assignments(module):
        return module, name
    package = module if Path(importlib.util.find_spec(module).origin).name == "__init__.py" else \
        module.rpartition(".")[0]
    for node in module_ast(module).body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    src = importlib.util.resolve_name("." * node.level + (node.module or ""), package) \
                        if node.level else node.module
                    return home_of_constant(src, alias.name)
    return module, name


# ---- what is public -----------------------------------------------------------------------------

def is_ours(obj) -> bool:
    mod = getattr(obj, "__module__", None) or ""
    return mod.split(".")[0] in PACKAGES


def public_names(module: str) -> list[str]:
    mod = importlib.import_module(module)
    if hasattr(mod, "__all__"):
        return list(mod.__all__)
    names = [n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)
             and (getattr(v, "__module__", None) == module if callable(v) else n in assignments(module))]
    return sorted(names)


def key(module: str, name: str, obj) -> tuple:
    """One key per documented thing, whichever module it is reached from."""
    if isinstance(obj, types.ModuleType):
        return ("module", obj.__name__)
    if callable(obj) and is_ours(obj):
        return ("object", id(obj))
    return ("constant", *home_of_constant(module, name))


def foreign_base_member(cls: type, name: str) -> bool:
    return any(name in vars(base) for base in cls.__mro__[1:] if not is_ours(base) and base is not object)


def class_members(cls: type, inherited=()) -> dict[str, object]:
    """The public methods and properties a class defines itself or inherits from a class of ours
    (a private base); with `inherited` given, the inherited ones only where named there (what
    mkdocstrings' `inherited_members` option shows)."""
    out = {}
    for owner in reversed([c for c in cls.__mro__ if is_ours(c)]):
        for n, v in vars(owner).items():
            if n.startswith("_") or foreign_base_member(cls, n):
                continue
            if owner is not cls and inherited is not None and inherited is not True and n not in inherited:
                continue
            if isinstance(v, (staticmethod, classmethod)):
                v = v.__func__
            if isinstance(v, (property, types.FunctionType)):
                out[n] = v
    return out


@lru_cache(maxsize=None)
def public_api() -> dict[tuple, tuple[str, object]]:
    """{key: (dotted name, object)} of every public name, and of the members of public classes."""
    out = {}
    for module in PUBLIC_MODULES:
        mod = importlib.import_module(module)
        for name in public_names(module):
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType):
                out.setdefault(key(module, name, obj), (obj.__name__, obj))
                continue
            out.setdefault(key(module, name, obj), (f"{module}.{name}", obj))
            if isinstance(obj, type) and is_ours(obj):
                for m, v in class_members(obj, inherited=None).items():
                    out.setdefault(("member", id(obj), m), (f"{module}.{name}.{m}", v))
    return out


# ---- what the reference renders -----------------------------------------------------------------

def directives() -> list[tuple[str, str, str]]:
    """(page, identifier, options text) of every `::: identifier` on the API pages."""
    return [(p.name, m.group(1), m.group(2)) for p in API_PAGES for m in DIRECTIVE.finditer(p.read_text())]


def resolve(identifier: str):
    """(module it is reached from, name in it, object) the way mkdocstrings resolves an identifier:
    a dotted path that names a module is the module."""
    if is_module_path(identifier):
        return None, None, importlib.import_module(identifier)
    parts = identifier.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if is_module_path(module):
            obj, owner, name = importlib.import_module(module), module, None
            for j, attr in enumerate(parts[i:]):
                if j == 1:
                    owner = None  # a class member
                obj, name = getattr(obj, attr), attr
            return owner, name, obj
    raise ValueError(identifier)


def rendered_members(module: str, excluded=None) -> list[tuple[str, str, object]]:
    """(module, name, object) of the members a module directive shows, only those with a docstring
    (mkdocstrings leaves the others out). mkdocs.yml's `filters: public`: its `__all__`, or what it
    defines itself. A page's own `filters` list (`excluded`: its "!" patterns): what it defines
    itself and its `__all__`, less the names the patterns match."""
    mod, out = importlib.import_module(module), []
    own = [n for n, v in vars(mod).items() if not isinstance(v, types.ModuleType) and (
        getattr(v, "__module__", None) == module if callable(v) else n in assignments(module))]
    if excluded is None:
        names = list(mod.__all__) if hasattr(mod, "__all__") else own
    else:
        names = [n for n in dict.fromkeys([*own, *getattr(mod, "__all__", [])])
                 if not any(re.search(pat, n) for pat in excluded)]
    for n in names:
        if n.startswith("_"):
            continue
        obj = getattr(mod, n)
        if isinstance(obj, types.ModuleType) or callable(obj):
            shown = isinstance(obj, types.ModuleType) or bool(own_doc(obj))
        else:  # a constant, perhaps re-exported: shown with the docstring where it is assigned
            shown = assignments(home_of_constant(module, n)[0]).get(home_of_constant(module, n)[1], False)
        if shown:
            out.append((module, n, obj))
    return out


@lru_cache(maxsize=None)
def rendered() -> dict[tuple, str]:
    """{key: "page: identifier"} of everything the API pages show."""
    out = {}

    def add(k, where):
        out.setdefault(k, where)

    for page, ident, options in directives():
        module, name, obj = resolve(ident)
        where = f"{page}: {ident}"
        inh = re.search(r"^\s*inherited_members:\s*(.*)", options, re.M)
        inherited = () if not inh else True if inh.group(1).strip() == "true" else {
            s.strip() for s in inh.group(1).strip("[] ").split(",")}
        if isinstance(obj, types.ModuleType):
            add(key("", "", obj), where)
            listed = re.search(r"^\s*members:\s*(.*)", options, re.M)
            if listed and listed.group(1).strip() == "false":
                continue
            filters = re.search(r"^\s*filters:\s*\[(.*)\]", options, re.M)
            excluded = None if not filters else [
                f.strip().strip("'\"")[1:] for f in filters.group(1).split(",") if f.strip().strip("'\"").startswith("!")]
            members = rendered_members(obj.__name__, excluded)
            if listed and listed.group(1).strip().startswith("["):
                wanted = {s.strip() for s in listed.group(1).strip("[] ").split(",")}
                members = [m for m in members if m[1] in wanted]
            for mod, n, o in members:
                add(key(mod, n, o), f"{where}.{n}")
                if isinstance(o, type) and is_ours(o):
                    for m, v in class_members(o, inherited).items():
                        if own_doc(v):
                            add(("member", id(o), m), f"{where}.{n}.{m}")
        elif module is None:  # a class member named directly
            owner = resolve(ident.rpartition(".")[0])[2]
            add(("member", id(owner), name), where)
        else:
            add(key(module, name, obj), where)
            if isinstance(obj, type) and is_ours(obj):
                for m, v in class_members(obj, inherited).items():
                    if own_doc(v):
                        add(("member", id(obj), m), f"{where}.{m}")
    return out


# ---- what a docstring says ----------------------------------------------------------------------

def own_doc(obj) -> str:
    if isinstance(obj, property):
        obj = obj.fget
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, type) and dataclasses.is_dataclass(obj) and doc and doc.startswith(obj.__name__ + "("):
        return ""  # the signature dataclasses writes when a class has no docstring
    return inspect.cleandoc(doc or "")


def sections(doc: str) -> dict[str, str]:
    """{section title: its indented body} of a Google-style docstring."""
    out, title = {}, None
    for line in doc.splitlines():
        m = re.match(r"^(\w[\w ]*):\s*$", line)
        if m and m.group(1) in SECTIONS:
            title = m.group(1)
            out[title] = ""
        elif title and (line.startswith((" ", "\t")) or not line.strip()):
            out[title] += line + "\n"
        else:
            title = None
    return out


def documented_params(body: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^\s{2,8}\**(\w+)\s*(?:\([^)]*\))?\s*:", body, re.M)}


def documented_fields(cls: type) -> set[str]:
    """Class-level names followed by a docstring (a dataclass field documented where it is declared)."""
    try:
        node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    except (OSError, TypeError):
        return set()
    out = set()
    for field, nxt in zip(node.body, node.body[1:]):
        target = field.target if isinstance(field, ast.AnnAssign) else (
            field.targets[0] if isinstance(field, ast.Assign) else None)
        if (isinstance(target, ast.Name) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            out.add(target.id)
    return out


def signature_params(obj) -> list[str]:
    target = obj
    if isinstance(obj, type):
        target = obj.__init__ if "__init__" in vars(obj) or dataclasses.is_dataclass(obj) else None
        if target is None or target is object.__init__:
            return []
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters if p not in ("self", "cls")]


def problems(name: str, obj) -> list[str]:
    """What the docstring of one public name lacks (empty when nothing)."""
    if isinstance(obj, types.ModuleType):
        return [] if own_doc(obj) else [f"{name}: no module docstring"]
    doc = own_doc(obj)
    if not doc:
        return [f"{name}: no docstring"]
    if isinstance(obj, property) or not callable(obj):
        return []
    secs = sections(doc)
    if isinstance(obj, type):
        init_doc = own_doc(obj.__init__) if "__init__" in vars(obj) else ""
        secs = {**sections(init_doc), **secs}
        args = documented_params(secs.get("Args", "") + secs.get("Attributes", "")) | documented_fields(obj)
    else:
        args = documented_params(secs.get("Args", ""))
    out = []
    missing = [p for p in signature_params(obj) if p not in args]
    if missing:
        out.append(f"{name}: Args lacks {', '.join(missing)}")
    if isinstance(obj, type):
        return out
    node = function_node(obj)
    if node is None:
        return out
    nodes = list(own_nodes(node))
    if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in nodes):
        if "Yields" not in secs:
            out.append(f"{name}: no Yields section")
    elif any(isinstance(n, ast.Return) and n.value is not None and not (
            isinstance(n.value, ast.Constant) and n.value.value is None) for n in nodes) and "Returns" not in secs:
        out.append(f"{name}: no Returns section")
    raised = sorted({(n.exc.func if isinstance(n.exc, ast.Call) else n.exc).id for n in nodes
                     if isinstance(n, ast.Raise) and n.exc is not None
                     and isinstance(n.exc.func if isinstance(n.exc, ast.Call) else n.exc, ast.Name)
                     and (n.exc.func if isinstance(n.exc, ast.Call) else n.exc).id[:1].isupper()})
    if raised:
        if "Raises" not in secs:
            out.append(f"{name}: no Raises section ({', '.join(raised)})")
        else:
            unnamed = [e for e in raised if not re.search(rf"\b{e}\b", secs["Raises"])]
            if unnamed:
                out.append(f"{name}: Raises lacks {', '.join(unnamed)}")
    return out


# ---- the tests ----------------------------------------------------------------------------------

def test_the_reference_directives_resolve():
    assert len(directives()) >= 10
    for page, ident, _ in directives():
        resolve(ident)  # raises on a name that no longer exists


def test_every_public_name_is_in_the_reference():
    shown = rendered()
    missing = sorted(name for k, (name, _) in public_api().items() if k not in shown)
    assert not missing, "not in docs/api/*.md (or left out for want of a docstring):\n  " + "\n  ".join(missing)


def test_the_reference_shows_no_internal_name():
    """A module directive shows only public names (an internal helper in the reference reads as API)."""
    public = public_api()
    internal = sorted(where for k, where in rendered().items() if k not in public and k[0] != "module")
    assert not internal, "the reference shows names no public module exports:\n  " + "\n  ".join(internal)


@pytest.mark.parametrize("module", [pytest.param(m, id=m) for m in PUBLIC_MODULES])
def test_each_public_name_says_what_it_takes_returns_and_raises(module):
    found = []
    for k, (name, obj) in public_api().items():
        if name.rpartition(".")[0] == module or (k[0] == "member" and name.rsplit(".", 2)[0] == module):
            if k[0] == "constant":
                home, n = k[1], k[2]
                if not assignments(home).get(n, False):
                    found.append(f"{name}: no docstring (a string after the assignment; `#:` is not shown)")
            else:
                found += problems(name, obj)
    assert not found, "\n  " + "\n  ".join(found)
