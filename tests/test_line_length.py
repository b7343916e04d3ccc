# test_line_length.py: the lines of offload/ stay under 100 characters. A longer line is allowed
# only where it holds a URL (nothing to break), and in the files of CEILINGS, each at most its count
# there: a ceiling that may only go down (those files are at the 400-line module limit, so wrapping
# their last long lines needs a split).
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIMIT = 99
URL = re.compile(r"https?://\S+")
CEILINGS = {
    "offload/optim/adam.py": 58,
    "offload/schedule/device_step.py": 29,
    "offload/engine/torchstate.py": 25,
    "offload/engine/engine.py": 23,
    "offload/bench/gpucheck_common.py": 6,
}


def long_lines(path: pathlib.Path) -> list:
    """(line number, line) of every line of ``path`` over LIMIT characters without a URL."""
    return [(n, line) for n, line in enumerate(path.read_text().splitlines(), 1)
            if len(line) > LIMIT and not URL.search(line)]


def over_limit(root: pathlib.Path, ceilings: dict) -> dict:
    """{path: its long lines} for the files of root/offload with more long lines than allowed."""
    out = {}
    for p in sorted((root / "offload").rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        found = long_lines(p)
        if len(found) > ceilings.get(rel, 0):
            out[rel] = found
    return out


def test_lines_of_offload_are_under_100_characters():
    over = over_limit(ROOT, CEILINGS)
    assert not over, "lines over 99 characters (move a long inline comment above its line, wrap, " \
        "or break inside brackets): " + "; ".join(
            f"{rel}: {len(found)} (allowed {CEILINGS.get(rel, 0)}), first at line {found[0][0]}"
            for rel, found in over.items())


def test_the_check_finds_long_lines_and_allows_urls(tmp_path):
    pkg = tmp_path / "offload"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\ny = '" + "a" * 100 + "'\n# see https://example.com/"
                              + "b" * 100 + "\n")
    (pkg / "b.py").write_text("z = 2  # " + "c" * 91 + "\n")   # 100 characters
    (pkg / "c.py").write_text("w = 3  # " + "d" * 90 + "\n")   # 99 characters
    assert [n for n, _ in long_lines(pkg / "a.py")] == [2]
    assert sorted(over_limit(tmp_path, {})) == ["offload/a.py", "offload/b.py"]
    assert sorted(over_limit(tmp_path, {"offload/a.py": 1})) == ["offload/b.py"]
