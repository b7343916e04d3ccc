# test_side_branches.py: where the parameters are (host memory or a device) is decided once, by
# the factories, and never asked again: the state engine holds a parameter side
# (offload/params/side.py) and the optimizer a face (offload/optim/faces.py). This test parses
# offload/ (not device/, where a device is torch's, nor bench/) and counts what asks which one it
# has: `x is None` / `x is not None` with x named device, _gpu, gpu, offload_device, schedule,
# side, face (getattr(o, "x", d) too); getattr/hasattr probing a side or face; isinstance against a
# side or face class. The counts per function must be those of FACTORIES: a new one is refused by
# file and line; a count that fell must be lowered here (the list only shrinks).
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
SKIP = ("offload/device/", "offload/bench/")
NAMES = {"device", "_gpu", "gpu", "offload_device", "schedule", "side", "_side", "face", "_face"}
PROBED = {"side", "_side", "face", "_face", "schedule"}
CLASSES = {"ParamSide", "SideOver", "HostParams", "DeviceParams", "HeldParams", "StepFace",
           "HostFace", "DeviceFace", "DeviceStep"}

# (path, function): how many such questions it may ask; each is where the choice is made or checked
FACTORIES = {
    ("offload/params/__init__.py", "side_maker"): 1,       # the engine's side: host or device
    ("offload/optim/faces.py", "start"): 1,                # the optimizer's face: host or device
    ("offload/optim/gpu.py", "split_params"): 2,           # the mode, from where parameters are
    ("offload/optim/gpu.py", "make_state_engine"): 1,      # bucket size, small parameters: device
    ("offload/optim/engine_slot.py", "EngineSlot.configure"): 1,   # an option of device mode
    ("offload/optim/engine_slot.py", "EngineSlot.on_device"): 1,   # the mode the engine is for
    ("offload/schedule/delayed.py", "DelayedUpdates.__init__"): 1,  # the side it was built with
    ("offload/optim/adam.py", "_AdamBase._check_usable"): 1,   # no face yet: torch's constructor
    ("offload/optim/adam.py", "_settled"): 1,                  # (the same)
}


def _name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)):
        return node.args[1].value
    return None


def _asks(node) -> bool:
    if (isinstance(node, ast.Compare) and len(node.ops) == 1
            and isinstance(node.ops[0], (ast.Is, ast.IsNot))):
        a, b = node.left, node.comparators[0]
        for x, y in ((a, b), (b, a)):
            if isinstance(y, ast.Constant) and y.value is None and _name(x) in NAMES:
                return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
        if node.func.id in ("getattr", "hasattr") and _name(node.args[0]) in PROBED:
            return True
        if node.func.id == "isinstance" and len(node.args) == 2:
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            return any(_name(k) in CLASSES for k in kinds)
    return False


def _questions(path: pathlib.Path) -> list:
    """[(function's qualified name or "<module>", line)] of every question in the file."""
    out = []

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, scope + [child.name])
                continue
            if _asks(child):
                out.append((".".join(scope) or "<module>", child.lineno))
            visit(child, scope)
    visit(ast.parse(path.read_text(), str(path)), [])
    return out


def _found() -> dict:
    found = {}
    for path in sorted((ROOT / "offload").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(SKIP):
            continue
        for fn, line in _questions(path):
            found.setdefault((rel, fn), []).append(line)
    return found


def test_the_side_is_asked_only_where_it_is_chosen():
    found = _found()
    new = [f"{p}:{line} ({fn}): {len(lines)} > {FACTORIES.get((p, fn), 0)}"
           for (p, fn), lines in sorted(found.items()) for line in lines[:1]
           if len(lines) > FACTORIES.get((p, fn), 0)]
    assert not new, ("where the parameters are is asked outside the factories; make what differs "
                     "a method of the side (offload/params/side.py) or of the face "
                     "(offload/optim/faces.py):\n" + "\n".join(new))
    fell = [f"{p} {fn}: {n} -> {len(found.get((p, fn), []))}"
            for (p, fn), n in sorted(FACTORIES.items()) if len(found.get((p, fn), [])) < n]
    assert not fell, "fewer questions than FACTORIES allows: lower the counts\n" + "\n".join(fell)


def test_the_check_sees_what_it_counts(tmp_path):
    """Each kind of question is found (so that the test above cannot pass by seeing nothing)."""
    src = tmp_path / "m.py"
    src.write_text("def f(eng, opt, x):\n"
                   "    if eng.device is None: pass\n"
                   "    if getattr(opt, '_gpu', None) is not None: pass\n"
                   "    if None is x.schedule: pass\n"
                   "    getattr(eng.side, 'rows', None)\n"
                   "    isinstance(x, (int, HeldParams))\n"
                   "    if x.device == 'cuda' or eng.tier is None: pass\n")
    assert [line for _, line in _questions(src)] == [2, 3, 4, 5, 6]
