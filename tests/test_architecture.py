# test_architecture.py: the architecture guard in CI. The tree must be clean against tools/arch_allow.txt
# (no new violation, no allowlisted one that is gone: the list only shrinks), and the checker itself is
# tested on tiny synthetic trees, so that the guard cannot pass by finding nothing.
import importlib.util
import io
import pathlib
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_arch", ROOT / "tools" / "check_arch.py")
check_arch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_arch)


@pytest.fixture(scope="module")
def real():
    return check_arch.check(str(ROOT))


def test_tree_is_clean_against_the_allowlist(real):
    findings, ctx = real
    new, stale = check_arch.compare(findings, check_arch.read_allow(str(ROOT / check_arch.ALLOW)))
    assert not new and not stale, (
        "tools/check_arch.py: " + "; ".join([f"new: {f.key}" + (f" ({f.where()})" if f.where() else "") for f in new]
                                            + [f"no longer occurs: {a}" for a in stale])
        + ". Fix a new violation; when one is gone (or for a new baseline), run "
          "`python tools/check_arch.py --write-allow` and commit tools/arch_allow.txt")
    assert len(ctx["mods"]) > 50 and sum(map(len, ctx["graph"].values())) > 150  # it did look at the tree


def test_report_of_the_real_tree(real):
    out = io.StringIO()
    check_arch.report(*real, out=out)
    text = out.getvalue()
    assert text.startswith("import graph: ") and "function-level: offload/" in text
    assert "\ncycle: " in text and "\nnative: " in text and "lines per package:" in text


def write(root, files):
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text) if isinstance(text, str) else text)


def tree(root, extra=None):
    """A minimal clean library: offload/__init__.py and two modules with their headers."""
    files = {
        "offload/__init__.py": '"""offload: test tree."""\nfrom . import a\n',
        "offload/a.py": '"""a.py: a leaf."""\nX = 1\n',
        "offload/step/__init__.py": '"""step/: a package."""\n',
        "offload/step/run.py": '"""step/run.py: uses a."""\nfrom ..a import X\n',
    }
    files.update(extra or {})
    write(root, files)
    return root


def keys(root, **kw):
    kw.setdefault("layers", ())  # synthetic trees: the layer rule only where a test asks for it
    findings, ctx = check_arch.check(str(root), **kw)
    return [f.key for f in findings], ctx


def test_a_clean_tree_has_no_findings(tmp_path):
    found, ctx = keys(tree(tmp_path))
    assert found == []
    assert ctx["graph"]["offload.step.run"] == {"offload.a"}


def test_a_module_level_cycle_is_found(tmp_path):
    found, _ = keys(tree(tmp_path, {"offload/b.py": '"""b.py: b."""\nfrom . import c\n',
                                    "offload/c.py": '"""c.py: c."""\nfrom .b import Y\nY = 2\n'}))
    assert "cycle offload/b.py <-> offload/c.py" in found


def test_a_function_level_import_closes_a_cycle(tmp_path):
    found, ctx = keys(tree(tmp_path, {
        "offload/step/x.py": '"""step/x.py: x."""\nimport offload.step.y\n',
        "offload/step/y.py": '''\
            """step/y.py: y."""
            def late():
                from . import x
                return x
            ''',
        "offload/step/z.py": '''\
            """step/z.py: z."""
            class Z:
                def f(self):
                    import offload.step.y as y
                    return y
            ''',
    }))
    assert "cycle offload/step/x.py <-> offload/step/y.py" in found
    assert ("offload.step.x", 3, "function") in ctx["mods"]["offload.step.y"].imports
    assert ("offload.step.y", 4, "function") in ctx["mods"]["offload.step.z"].imports
    assert not any("step/z.py" in k for k in found)  # z imports y, y does not import z: no cycle


def test_importers_of_the_native_module_are_found(tmp_path):
    found, _ = keys(tree(tmp_path, {
        "offload/n1.py": '"""n1.py: n1."""\nfrom . import _C\n',
        "offload/step/n2.py": '"""step/n2.py: n2."""\nfrom .. import a, _C\n',
        "offload/step/n3.py": '"""step/n3.py: n3."""\ndef f():\n    import offload._C\n',
        "offload/step/n4.py": '"""step/n4.py: n4."""\nfrom offload._C import adam_step\n',
        "offload/step/n5.py": '"""step/n5.py: n5."""\nfrom .. import _Cx\nimport torch._C\n',
        "offload/step/n6.py": '"""step/n6.py: n6."""\nfrom ..native import _C\n',
        "offload/native/__init__.py": '"""native/: the door."""\nfrom .. import _C\n',
        "offload/native/k.py": '"""native/k.py: k."""\nfrom . import _C\nimport offload._C\n',
    }))
    assert [k for k in found if k.startswith("native")] == [
        "native offload/n1.py", "native offload/step/n2.py", "native offload/step/n3.py",
        "native offload/step/n4.py", "native offload/step/n6.py"]  # offload/native/ may: it is the door


def test_files_over_400_lines_are_found(tmp_path):
    found, _ = keys(tree(tmp_path, {
        "tests/test_big.py": "x = 1\n" * 401, "tests/test_ok.py": "x = 1\n" * 400,
        "csrc/big.h": "//\n" * 500, "csrc/notes.txt": "\n" * 900,
        "offload/step/long.py": '"""step/long.py: long."""\n' + "x = 1\n" * 400,
    }))
    assert [k for k in found if k.startswith("size")] == [
        "size csrc/big.h 500", "size offload/step/long.py 401", "size tests/test_big.py 401"]


def test_private_attributes_across_modules(tmp_path):
    found, _ = keys(tree(tmp_path, {
        "offload/step/engine.py": '''\
            """step/engine.py: owns _collect and _lock."""
            class Engine:
                def __init__(self):
                    self._lock = None
                def _collect(self):
                    return self._lock, self.other._lock
            ''',
        "offload/step/feed.py": '''\
            """step/feed.py: pokes the engine."""
            import torch
            from . import engine as E
            def run(eng, t):
                eng._collect()
                return t._version, t._base, torch._C, eng._not_defined_here, E._helper, super()._collect
            def mark(opt, eng):
                opt._marked = True  # written on another object, owned by no module
                eng._lock = None  # owned by step/engine.py
            ''',
        "offload/_kernels.py": '''"""_kernels.py: a private module."""\n''',
        "tests/test_x.py": '''\
            import torch
            import offload
            from offload.step import engine
            def test(opt, t):
                opt._lock, t._version, torch._dynamo, offload._C._probe, engine.Engine._collect
                offload._kernels.f, self._collect, opt._unknown
            ''',
    }))
    assert [k for k in found if k.startswith("private")] == [
        "private offload/step/feed.py E._helper", "private offload/step/feed.py eng._collect",
        "private offload/step/feed.py eng._lock", "private offload/step/feed.py opt._marked",
        "private tests/test_x.py engine.Engine._collect", "private tests/test_x.py offload._C._probe",
        "private tests/test_x.py opt._lock"]


def test_headers_and_cited_paths(tmp_path):
    found, _ = keys(tree(tmp_path, {
        "offload/good.py": '"""offload/good.py: full path is fine; cites docs/a.md and offload/a.py."""\n',
        "offload/ver.py": "# ver.py: a comment header, no docstring\nV = 1\n",
        "offload/step/bad.py": '"""bad.py: not its path."""\n',
        "offload/step/none.py": "X = 1\n",
        "offload/step/cites.py": '"""step/cites.py: see offload/gone.py and csrc/x.h."""\n# docs/old.md\n',
        "docs/a.md": "",
    }))
    assert [k for k in found if k.startswith(("header", "cite"))] == [
        "header offload/step/bad.py", "header offload/step/none.py",
        "cite offload/step/cites.py csrc/x.h", "cite offload/step/cites.py docs/old.md",
        "cite offload/step/cites.py offload/gone.py"]


def test_layer_rule_from_the_table(tmp_path):
    root = tree(tmp_path, {"offload/base/__init__.py": '"""base/: leaves."""\n',
                           "offload/base/u.py": '"""base/u.py: up."""\nfrom ..engine import run\n',
                           "offload/engine/__init__.py": '"""engine/: a package."""\n',
                           "offload/engine/run.py": '"""engine/run.py: uses a."""\nfrom ..a import X\n'})
    assert not [k for k in keys(root, layers=())[0] if k.startswith("layer")]  # LAYERS empty: off
    assert "layer offload/base/u.py -> offload/engine/run.py" in keys(root, layers=None)[0]  # the real table is on
    found, _ = keys(root, layers=("base", "", "engine"))
    assert found == ["layer offload/base/u.py -> offload/engine/run.py"]
    found, _ = keys(root, layers=("base", "", "engine"), only={"engine": ("base",)})
    assert "layer offload/engine/run.py -> offload/a.py" in found  # root not in engine's ONLY list


def run_main(root, capsys, *argv):
    rc = check_arch.main(list(argv), root=str(root))
    return rc, capsys.readouterr().out


def test_allowlist_only_shrinks(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(check_arch, "LAYERS", ())  # the synthetic step/ imports the root: not what this tests
    root = tree(tmp_path, {"offload/b.py": '"""b.py: b."""\nfrom . import c\n',
                           "offload/c.py": '"""c.py: c."""\nfrom . import b\n',
                           "tests/test_big.py": "x = 1\n" * 410})
    assert run_main(root, capsys)[0] == 1  # no allowlist yet: both are new
    assert run_main(root, capsys, "--write-allow")[0] == 0
    allow = (root / "tools/arch_allow.txt").read_text()
    assert "cycle offload/b.py <-> offload/c.py\nsize tests/test_big.py 410\n" in allow
    assert allow.startswith("#") and "--write-allow" in allow
    assert run_main(root, capsys) == (0, "check_arch: clean against tools/arch_allow.txt (2 allowlisted findings)\n")
    write(root, {"tests/test_big.py": "x = 1\n" * 405})  # shrank, still over: within its ceiling
    assert run_main(root, capsys)[0] == 0
    write(root, {"tests/test_big.py": "x = 1\n" * 411})  # grew past the ceiling
    rc, out = run_main(root, capsys)
    assert rc == 1 and "NEW (not in tools/arch_allow.txt): size tests/test_big.py 411" in out
    write(root, {"tests/test_big.py": "x = 1\n", "offload/c.py": '"""c.py: c."""\n'})  # both fixed
    rc, out = run_main(root, capsys)
    assert rc == 1 and "NEW" not in out
    assert "STALE" in out and "cycle offload/b.py <-> offload/c.py" in out and "size tests/test_big.py 410" in out


def test_allowlist_comments_and_stale_entries():
    findings = [check_arch.Finding("native", "offload/x.py"), check_arch.Finding("size", "tests/t.py", 420)]
    allow = ["native offload/x.py", "size tests/t.py 430", "cycle offload/p.py <-> offload/q.py"]
    new, stale = check_arch.compare(findings, allow)
    assert new == [] and stale == ["cycle offload/p.py <-> offload/q.py"]
    new, stale = check_arch.compare(findings, ["size tests/t.py 419"])
    assert [f.key for f in new] == ["native offload/x.py", "size tests/t.py 420"] and stale == []


def test_read_allow_drops_comments(tmp_path):
    p = tmp_path / "allow.txt"
    p.write_text("# header\n\nnative offload/x.py   # why\n  size  tests/t.py 430\n")
    assert check_arch.read_allow(str(p)) == ["native offload/x.py", "size tests/t.py 430"]
    assert check_arch.read_allow(str(tmp_path / "missing.txt")) == []


def test_graph_lists_every_edge(tmp_path, capsys):
    root = tree(tmp_path, {"offload/b.py": '"""b.py: b."""\ndef f():\n    from . import _C, a\n'})
    rc, out = run_main(root, capsys, "--graph")
    assert rc == 0 and out.splitlines() == [
        "offload/__init__.py:2 -> offload/a.py (module)", "offload/b.py:3 -> offload._C (function)",
        "offload/b.py:3 -> offload/a.py (function)", "offload/step/run.py:2 -> offload/a.py (module)"]
