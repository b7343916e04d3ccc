"""test_docs_examples.py: every ```python, ```bash and ```console block of README.md and docs/*.md is
executed (on CPU, at the sizes the page shows or through a tiny prelude), unless a doc-test mark skips
it with a reason; output a page shows is compared with what the code prints now. The marks, the
preludes, the forking runner and how output is compared: tests/doc_blocks.py; the convention for
authors: docs/architecture.md ("Docs are tested"). Skipped blocks are listed with their reasons at the
end of the pytest run.
"""
import collections
import os

import pytest

from doc_blocks import PRELUDES, Runner, all_blocks, console_pairs, normalize, reason_of

BLOCKS = all_blocks()
RUN = [b for b in BLOCKS if not b.args("output")]
SKIPPED = collections.defaultdict(list)  # reason -> [block id (or id + lines)]


class _Report:
    """Registered as a pytest plugin by the module fixture: prints the skipped blocks by reason."""

    def pytest_terminal_summary(self, terminalreporter):
        if not SKIPPED:
            return
        terminalreporter.write_sep("-", "doc blocks not run (tests/test_docs_examples.py)")
        for reason, where in sorted(SKIPPED.items()):
            terminalreporter.write_line(f"{reason}: {', '.join(where)}")


@pytest.fixture(scope="module")
def runner(request):
    request.config.pluginmanager.register(_Report(), "doc-blocks-report")
    r = Runner(timeout=60)
    yield r
    r.close()


def _expected_output(block):
    """The block marked `output` right after this one on the same page, if any."""
    i = BLOCKS.index(block)
    nxt = BLOCKS[i + 1] if i + 1 < len(BLOCKS) else None
    return nxt.text if nxt is not None and nxt.page == block.page and nxt.args("output") else None


def _env(block):
    return dict(a.split("=", 1) for a in block.args("env"))


def _with_tmpdirs(block, text, tmp_path):
    for n, path in enumerate(block.args("tmpdir")):
        real = tmp_path / f"dir{n}"
        real.mkdir()
        text = text.replace(path, str(real))
    return text


def _python_source(block):
    setups = [b.text for b in BLOCKS if b.page == block.page and b.line < block.line and b.lang == "python"
              and b.args("setup")]
    unknown = [p for p in block.args("prelude") if p not in PRELUDES]
    assert not unknown, f"{block.id}: no prelude named {unknown} in tests/doc_blocks.py"
    return "\n".join([PRELUDES[p] for p in block.args("prelude")] + setups + [block.text])


def _bash_lines(block, text):
    """The command lines of a bash block that run; lines a skip-lines mark names are recorded."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    for arg in block.args("skip-lines"):
        text = arg[:arg.rindex("(")].strip().strip('"')
        dropped = [ln for ln in lines if text in ln]
        assert dropped, f"{block.id}: skip-lines {text!r} matches no line"
        SKIPPED[reason_of(arg)].append(f"{block.id} ({len(dropped)} line{'s' * (len(dropped) > 1)})")
        lines = [ln for ln in lines if text not in ln]
    return lines


def _check(block, rc, out, what):
    ok = [int(s) for a in block.args("exit-status") for s in a[:a.index("(")].split()] or [0]
    assert rc in ok, f"{block.id}: {what} exited with {rc}:\n{out[-4000:]}"


def _compare(block, shown, printed, what):
    want, got = normalize(shown), normalize(printed)
    assert want == got, (f"{block.id}: the output the page shows for {what} differs from what it prints "
                         f"now (numbers masked)\n--- page\n" + "\n".join(want) + "\n--- now\n" + "\n".join(got))


@pytest.mark.parametrize("block", RUN, ids=[b.id for b in RUN])
def test_doc_block(block, runner, tmp_path):
    reason = block.skip_reason()
    if reason:
        SKIPPED[reason].append(block.id)
        pytest.skip(f"{block.id}: {reason}")
    cwd, env = str(tmp_path), _env(block)
    text = _with_tmpdirs(block, block.text, tmp_path)
    if block.lang == "python":
        source = _python_source(block).replace(block.text, text)
        rc, out = runner.python(source, cwd, env, name=block.id)
        _check(block, rc, out, "the block")
    elif block.lang == "bash":
        lines = _bash_lines(block, text)
        if not lines:
            pytest.skip(f"{block.id}: every line is skipped")
        out = ""
        for line in lines:
            rc, printed = runner.command(line, cwd, env)
            _check(block, rc, printed, repr(line))
            out += printed
    else:
        assert block.lang == "console", block.id
        out = ""
        for command, shown in console_pairs(text):
            rc, printed = runner.command(command, cwd, env)
            _check(block, rc, printed, repr(command))
            _compare(block, shown, printed, repr(command))
            out += printed
    expected = _expected_output(block)
    if expected is not None:
        _compare(block, expected, out, "the block above it")


def test_every_output_mark_follows_a_block():
    for b in BLOCKS:
        if b.args("output"):
            i = BLOCKS.index(b)
            assert i > 0 and BLOCKS[i - 1].page == b.page and not BLOCKS[i - 1].args("output"), b.id


def test_blocks_found():
    assert len(RUN) >= 20 and os.path.basename(BLOCKS[0].page) == "README.md"
