"""test_moment_formats.py: the moment formats (offload/moments/format.py) match the kernels.

Each format declares its tensors (sections) and the columns of its kernel's task table: both are
checked here against the native layer itself (``moment_state``, ``adam_table`` / ``moment_table``),
so a change of the kernel's format or row struct fails here by name. And outside the factory
module no code compares a moment format's name: it asks the format object (the last test).
"""
import ast
import copy
import pathlib
import pickle

import pytest
import torch

from offload.moments.format import FORMATS, FP32, MomentFormat, check_moments, moment_format
from offload.native import adam as native_adam
from offload.native import moments as native_moments

ROOT = pathlib.Path(__file__).resolve().parent.parent
COMPRESSED = [f for f in FORMATS if moment_format(f).compressed]


@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 3 * 256 + 1])
def test_sections_are_the_kernels_state(name, n):
    fmt = moment_format(name)
    want = native_moments.moment_state(n, name)
    got = fmt.zeros(n)
    assert list(got) == list(want) == [s.key for s in fmt.sections]
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), k
        assert not got[k].view(torch.uint8).any(), k   # the zero state: all-zero bytes
    assert fmt.spec(n) == {k: (t.dtype, t.numel()) for k, t in want.items()}


def _row(name):
    """(format, a row of its kernel's table built by the native layer's own validated builder, the
    tensors it points at by field)."""
    fmt = moment_format(name)
    n = 300
    p, g = torch.zeros(n), torch.zeros(n, dtype=torch.bfloat16)
    out = torch.zeros(n, dtype=torch.float16)
    secs = fmt.state_sections(not fmt.compressed)   # fp32: with max_exp_avg_sq
    t = {s.key: torch.zeros(fmt.entries(s.key, n), dtype=s.dtype) for s in secs}
    if fmt.compressed:
        scales = {k: [t[k]] if k in t else None for k in ("exp_avg_scale", "exp_avg_sq_scale")}
        row = native_moments.moment_table(
            [p], [g], [t["exp_avg"]], [t["exp_avg_sq"]], [7], fmt=name, outs=[out],
            m_scales=scales["exp_avg_scale"], v_scales=scales["exp_avg_sq_scale"])[0]
    else:
        row = native_adam.adam_table([p], [g], [t["exp_avg"]], [t["exp_avg_sq"]],
                                     [t["max_exp_avg_sq"]], [7], [out])[0]
    return fmt, row, dict(t, p=p, g=g, out=out, n=n)


@pytest.mark.parametrize("name", FORMATS)
def test_columns_are_the_kernels_table(name):
    fmt, row, t = _row(name)
    c = fmt.columns
    assert len(row) == c.ncols
    for field in ("p", "g", "out"):
        assert row[getattr(c, field)] == t[field].data_ptr(), field
    assert row[c.gdtype] == native_adam.DTYPE_CODES[torch.bfloat16]
    assert row[c.odtype] == native_adam.DTYPE_CODES[torch.float16]
    assert row[c.n] == t["n"] and row[c.step] == 7
    assert set(c.sections) == {s.key for s in fmt.state_sections(not fmt.compressed)}
    for key, col in c.sections.items():
        assert row[col] == t[key].data_ptr(), key
    for col, value in c.fixed:
        assert row[col] == value
    assert c.dynamic == [c.g, c.gdtype, c.out, c.odtype]
    named = [c.p, c.g, c.gdtype, c.out, c.odtype, c.n, c.step, *c.sections.values(),
             *(col for col, _ in c.fixed)]
    assert len(set(named)) == len(named)
    assert all(row[i] == 0 for i in set(range(c.ncols)) - set(named))   # bf16: the scale columns


def test_one_object_per_format():
    for name in FORMATS:
        fmt = moment_format(name)
        assert isinstance(fmt, MomentFormat) and fmt.name == name and moment_format(fmt) is fmt
        assert pickle.loads(pickle.dumps(fmt)) is fmt and copy.deepcopy(fmt) is fmt
    assert FP32 is moment_format("fp32") and not FP32.compressed
    assert [moment_format(f).bytes_per_element for f in FORMATS] == [8, 4, 2]
    for bad in ("FP32", "int8", None, FP32):
        with pytest.raises(ValueError, match="moments must be one of 'fp32', 'bf16', '8bit'"):
            check_moments(bad)


def test_for_size_and_sections():
    q8 = moment_format("8bit")
    assert q8.for_size(4096, 4096) is q8 and q8.for_size(4095, 4096) is FP32
    assert q8.for_size(0, 0) is FP32 and FP32.for_size(10 ** 6, 0) is FP32
    keys = [s.key for s in FP32.state_sections(True)]
    assert keys == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
    assert q8.state_sections(True) == q8.state_sections(False) == q8.sections   # no max_exp_avg_sq


# ---- no moment format chosen by its name outside the factory
FACTORY = "offload/moments/format.py"
# (path, comparison) -> why it is not a moment format's name; this list may only shrink
NOT_MOMENT_FORMATS = {
    ("offload/bench/kernel.py", "case.key not in ('flat', 'multi', 'bf16')"):
        "bench case keys: 'bf16' is the case of bf16 parameters, a parameter dtype",
}
_OPS = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _names(node) -> set:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(*map(_names, node.elts))
    return set()


def moment_name_comparisons(root: pathlib.Path) -> list:
    """[(path, line, comparison)] of the comparisons with a moment format's name (a string
    constant, or a literal collection holding one) in offload/, outside the factory module."""
    out = []
    for path in sorted((root / "offload").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == FACTORY:
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Compare) or not any(isinstance(o, _OPS) for o in node.ops):
                continue
            if set(FORMATS) & set().union(*map(_names, [node.left, *node.comparators])):
                out.append((rel, node.lineno, ast.unparse(node)))
    return out


def test_no_moment_format_is_compared_by_name():
    """Code asks the format object (``fmt.compressed``, ``fmt.kernel``, ``fmt.columns``, ...),
    never ``moments == "fp32"``. A parameter dtype's name that reads like a format ("bf16") goes in
    NOT_MOMENT_FORMATS with the reason; dtype names are looked up in tables, not compared."""
    found = moment_name_comparisons(ROOT)
    new = [f"{p}:{ln}: {expr}" for p, ln, expr in found if (p, expr) not in NOT_MOMENT_FORMATS]
    stale = set(NOT_MOMENT_FORMATS) - {(p, expr) for p, _, expr in found}
    assert not new, ("moment formats compared by name (ask the MomentFormat of "
                     "offload/moments/format.py instead):\n  " + "\n  ".join(new))
    assert not stale, f"NOT_MOMENT_FORMATS entries no longer found (delete them): {sorted(stale)}"
