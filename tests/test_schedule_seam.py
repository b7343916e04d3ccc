# test_schedule_seam.py: two seams kept narrow. (1) What the device schedule (offload/schedule/)
# reads of the StateEngine is exactly the list of names the StateEngine docstring gives for it: a
# read outside the list, or a listed name no longer read, fails here. (2) engine/grow.py changes
# the engine's per-group lists, the registry's, the tracker's and the layout's only through their
# owners' methods, never in place. Both checkers are also run on small sources that break the rule,
# so that they cannot pass by finding nothing.
import ast
import pathlib
import re
import textwrap

import torch

from offload.engine.engine import StateEngine

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCHEDULE = ROOT / "offload" / "schedule"
GROW = ROOT / "offload" / "engine" / "grow.py"

# the per-group lists and the layout's fields that only their owners change
OWNED = {"groups", "local_groups", "amsgrad", "dtypes", "numels", "seen", "steps", "ready",
         "buckets", "of_param", "nbytes", "__dict__"}
MUTATORS = {"append", "extend", "insert", "pop", "clear", "remove", "setdefault", "update",
            "__setitem__", "__delitem__"}


def _is_engine(node) -> bool:
    """The schedule names the StateEngine ``engine`` or ``eng`` (also as ``<x>.engine``)."""
    return (isinstance(node, ast.Name) and node.id in ("engine", "eng")) or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def engine_reads(sources: dict) -> dict:
    """name -> ['file:line', ...]: attributes of the engine read in ``sources`` (file -> text),
    as ``engine.name`` or ``getattr(engine, "name")`` / ``hasattr``."""
    found: dict = {}
    for name, text in sources.items():
        for n in ast.walk(ast.parse(text)):
            attr = None
            if isinstance(n, ast.Attribute) and _is_engine(n.value):
                attr = n.attr
            elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr", "setattr") and len(n.args) >= 2
                  and _is_engine(n.args[0]) and isinstance(n.args[1], ast.Constant)):
                attr = n.args[1].value
            if attr is not None:
                found.setdefault(attr, []).append(f"{name}:{n.lineno}")
    return found


def seam_of(doc: str) -> set:
    """The names of the paragraph of ``doc`` that begins 'The device schedule', as ``name`` or
    ``name()``."""
    para = re.search(r"The device schedule.*?(?:\n\s*\n|\Z)", doc, re.S)
    assert para, "the StateEngine docstring has no paragraph 'The device schedule ...'"
    return set(re.findall(r"``(\w+)(?:\(\))?``", para.group(0)))


def in_place_edits(text: str) -> list:
    """'line: what' for each place ``text`` changes an owned list of ``eng`` (or of an object
    reached from it) itself: assigned, deleted, augmented, or a mutating method called on it."""
    out = []

    def owned_chain(node) -> bool:
        names = []
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            if isinstance(node, ast.Attribute):
                names.append(node.attr)
            node = node.value
        rooted = isinstance(node, ast.Name) and node.id in ("eng", "lay")
        return rooted and bool(OWNED & set(names))

    for n in ast.walk(ast.parse(text)):
        targets = []
        if isinstance(n, (ast.Assign, ast.Delete)):
            targets = n.targets
        elif isinstance(n, ast.AugAssign):
            targets = [n.target]
        for t in targets:
            if owned_chain(t):
                out.append(f"{n.lineno}: {ast.unparse(t)}")
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in MUTATORS and owned_chain(n.func.value)):
            out.append(f"{n.lineno}: {ast.unparse(n.func)}()")
    return out


def test_the_schedule_reads_exactly_the_engines_documented_seam():
    sources = {p.name: p.read_text() for p in sorted(SCHEDULE.glob("*.py"))}
    reads = engine_reads(sources)
    seam = seam_of(StateEngine.__doc__)
    outside = {k: v for k, v in reads.items() if k not in seam}
    assert not outside, (
        f"offload/schedule/ reads StateEngine attributes its docstring does not list for the "
        f"schedule: {outside}. Use a listed name, or add the name to that paragraph")
    unused = seam - set(reads)
    assert not unused, f"listed for the schedule but not read there (drop them): {sorted(unused)}"
    assert len(reads) >= 10   # it did find the schedule's reads


def test_every_name_of_the_seam_is_an_attribute_of_an_engine():
    eng = StateEngine([[torch.nn.Parameter(torch.zeros(8))]], [False], mode="ram",
                      host_budget="64MiB")
    try:
        missing = [k for k in seam_of(StateEngine.__doc__) if not hasattr(eng, k)]
    finally:
        eng.close()
    assert not missing, missing


def test_the_seam_checker_finds_reads_outside_the_list():
    src = textwrap.dedent("""
        def f(self, engine):
            eng = self.engine
            engine.groups[0]
            eng.registry.ready
            self.feed.engine._grads
            getattr(engine, "plans", None)
    """)
    reads = engine_reads({"x.py": src})
    assert set(reads) == {"groups", "registry", "_grads", "plans"}
    assert reads["_grads"] == ["x.py:6"]
    doc = ("StateEngine.\n\nThe device schedule reads ``groups``, ``lock`` and ``begin()``."
           "\n\nMore: ``step()``.")
    assert seam_of(doc) == {"groups", "lock", "begin"}


def test_grow_changes_no_owned_list_in_place():
    found = in_place_edits(GROW.read_text())
    assert not found, f"engine/grow.py edits another object's lists itself: {found}"


def test_the_in_place_checker_finds_edits():
    src = textwrap.dedent("""
        def add(eng, params, lay):
            eng.groups.append(list(params))
            del eng.registry.steps[2:]
            lay.nbytes = 0
            eng.layout.of_param[(0, 1)] = []
            eng.__dict__.setdefault("_cache", {})
            eng.layout.extend(other)
            eng.append_group(params, False)
    """)
    found = in_place_edits(src)
    assert sorted(int(f.split(":")[0]) for f in found) == [3, 4, 5, 6, 7], found
