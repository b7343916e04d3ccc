"""doc_blocks.py: the code blocks of README.md and docs/*.md, their doc-test marks, and the runner that
tests/test_docs_examples.py uses to execute them.

A block is a fenced ```python, ```bash or ```console block. Marks are HTML comments (invisible on
GitHub) on the lines directly above the fence, one per line:

    <!-- doc-test: skip (reason) -->            not run; the reason is required and shown in the test report
    <!-- doc-test: skip-lines TEXT (reason) --> bash: lines containing TEXT are not run (e.g. pip install)
    <!-- doc-test: output -->                   this block is what the previous block prints (compared)
    <!-- doc-test: prelude NAME -->             python: run PRELUDES[NAME] first (names the page leaves
                                                to the reader: a model, a process group)
    <!-- doc-test: setup -->                    python: later python blocks of the page run after this one
    <!-- doc-test: tmpdir PATH -->              PATH in the block is replaced by a fresh temporary directory
    <!-- doc-test: env NAME=VALUE -->           set in the block's environment (runs in a fresh interpreter)
    <!-- doc-test: exit-status 0 1 (reason) --> the exit statuses accepted (default: 0)

A ```console block alternates `$ command` lines with the output each command prints; both are checked.

Running: importing torch and offload takes about 4 s, so a server process imports them once and forks
a fresh child per python block and per plain `python -m MODULE ...` / `python -c CODE` command line
(the child runs in its own temporary directory with stdout and stderr captured, as a new interpreter
would). Blocks with an `env` mark, and bash lines using shell syntax (pipes, ||, redirections), run in
a real new interpreter / bash.
"""
import dataclasses
import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
LANGS = ("python", "bash", "console")
MARK = re.compile(r"^<!--\s*doc-test:\s*(\S+)\s*(.*?)\s*-->\s*$")
KINDS = {"skip", "skip-lines", "output", "prelude", "setup", "tmpdir", "env", "exit-status"}

# Names a page leaves to the reader ("your model"), defined small: every prelude runs in well under a second.
PRELUDES = {
    # a tiny model whose gradients are set, as after a backward
    "model": """
import torch, offload
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
model(torch.randn(4, 32)).pow(2).mean().backward()
""",
    # one-rank gloo process group (a file rendezvous in the block's directory: no port), a tiny model of
    # two blocks returning its loss, a batch
    "one-rank": """
import os, torch, offload, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + os.path.abspath("rendezvous"), rank=0, world_size=1)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(2))
    def forward(self, x):
        for block in self.blocks:
            x = torch.relu(block(x))
        return x.pow(2).mean()
torch.manual_seed(0)
model, batch = Model(), torch.randn(4, 32)
""",
    # GPU offload on the fake device (CPU tensors driven as if on a GPU: offload.AdamW defaults to it here),
    # a model returning its loss, an optimizer, micro-batches to accumulate
    "fake-gpu": """
import contextlib, functools, torch, offload
offload.AdamW = functools.partial(offload.AdamW, offload_device="fake")
torch.manual_seed(0)
class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    def forward(self, x):
        return self.net(x).pow(2).mean()
model = Model()
opt = offload.AdamW(model.parameters(), lr=1e-3)
micro_batches = [(torch.randn(4, 32),) for _ in range(3)]
""",
    # a model, its optimizer after one step, the model's weights and a checkpoint of the optimizer
    "checkpointed": """
import torch, offload
torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
opt = offload.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 32)).pow(2).mean().backward()
opt.step()
model_ckpt = {k: v.clone() for k, v in model.state_dict().items()}
offload.save(opt, "ckpt/optim")
""",
}


@dataclasses.dataclass
class Block:
    page: str            # path relative to the repository
    line: int            # line of the opening fence
    lang: str
    text: str
    marks: list          # (kind, argument) in page order

    @property
    def id(self):
        return f"{self.page}:{self.line}"

    def args(self, kind):
        return [a for k, a in self.marks if k == kind]

    def skip_reason(self):
        return next((reason_of(a) for a in self.args("skip")), None)


def reason_of(arg):
    m = re.search(r"\((.+)\)\s*$", arg)
    return m.group(1).strip() if m else None


def parse(page):
    """The python/bash/console blocks of a page, and any block marked `output`, with their marks.
    A malformed mark (unknown kind, skip without a reason) raises ValueError."""
    lines = page.read_text().splitlines()
    rel = str(page.relative_to(ROOT))
    blocks, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        lang, start = lines[i][3:].strip(), i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        marks, k = [], start - 1
        while k >= 0 and MARK.match(lines[k]):
            kind, arg = MARK.match(lines[k]).groups()
            if kind not in KINDS:
                raise ValueError(f"{rel}:{k + 1}: unknown doc-test mark {kind!r}")
            if kind in ("skip", "skip-lines", "exit-status") and not reason_of(arg):
                raise ValueError(f"{rel}:{k + 1}: a {kind} mark needs a reason in parentheses")
            marks.insert(0, (kind, arg))
            k -= 1
        if lang in LANGS or any(kind == "output" for kind, _ in marks):
            blocks.append(Block(rel, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", marks))
        i = end + 1
    return blocks


def all_blocks():
    return [b for page in PAGES for b in parse(page)]


# ---- comparing shown output with printed output -------------------------------------------------
# Numbers and free space differ between machines, so the comparison is of the structure: every number
# becomes N and runs of blanks one space; what follows "available:" (fits / DOES NOT FIT / unknown
# capacity: this machine's free memory and disk) is dropped, and so are the notes saying a place does not
# fit and the planner's suggestion (which setup fits depends on the same). The remaining lines must be
# equal, line for line.
VARYING = [re.compile(r"^note: \w+ needs .* but has .* available$"), re.compile(r"^suggestion: ")]


def normalize(text):
    out = []
    for line in text.splitlines():
        line = re.sub(r"\s+", " ", re.sub(r"\d[\d,.]*", "N", line)).strip()
        line = re.sub(r"available: .*$", "available:", line)
        if line and not any(v.match(line) for v in VARYING):
            out.append(line)
    return out


def console_pairs(text):
    """[(command, shown output)] of a console block."""
    pairs = []
    for line in text.splitlines():
        if line.startswith("$ "):
            pairs.append([line[2:], ""])
        elif pairs:
            pairs[-1][1] += line + "\n"
        else:
            raise ValueError(f"console block output before any `$ ` command: {line!r}")
    return [tuple(p) for p in pairs]


# ---- running -----------------------------------------------------------------------------------------
SHELL = {"|", "||", "&&", ";", "&", ">", ">>", "<", "(", ")"}


def simple_python(line):
    """('module', name, argv) or ('code', source, argv) for a plain `python -m`/`python -c` line, else None
    (the line needs a shell)."""
    if "$" in line or "`" in line:
        return None
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    try:
        words = list(lex)
    except ValueError:
        return None
    if not words or words[0] != "python" or any(w in SHELL or w[:1] in "<>" for w in words) or len(words) < 3:
        return None
    if words[1] == "-m":
        return ("module", words[2], words[2:])
    if words[1] == "-c":
        return ("code", words[2], ["-c"] + words[3:])
    return None


def _child(req):
    """In the forked child: run the request with fds 1 and 2 on the output file, then _exit."""
    import runpy
    import traceback
    fd = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = sys.stdout
    os.chdir(req["cwd"])
    sys.path[0] = "" if req["kind"] == "code" else req["cwd"]   # as `python -c` / `python -m` set it
    rc = 0
    try:
        sys.argv = req["argv"]
        if req["kind"] == "module":
            runpy.run_module(req["what"], run_name="__main__", alter_sys=True)
        else:
            exec(compile(req["what"], req.get("name", "<doc>"), "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    os._exit(rc)


def serve():
    """The server: import torch and offload once, then fork one child per request read from stdin."""
    import signal
    import time
    import torch  # noqa: F401
    import offload  # noqa: F401
    print("ready", flush=True)
    for raw in sys.stdin:
        req = json.loads(raw)
        pid = os.fork()
        if pid == 0:
            _child(req)
        deadline, status = time.monotonic() + req["timeout"], None
        while status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = os.waitstatus_to_exitcode(st)
            elif time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                status = "timeout"
            else:
                time.sleep(0.01)
        print(json.dumps({"rc": status}), flush=True)


class Runner:
    """Runs python code and command lines for the test; one forking server for the whole module."""

    def __init__(self, timeout=60):
        self.timeout = timeout
        self.env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + self.env.get("PATH", "")
        self.server = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=self.env, cwd=str(ROOT))
        assert self.server.stdout.readline().strip() == "ready"

    def close(self):
        self.server.stdin.close()
        self.server.wait(timeout=30)

    def forked(self, kind, what, argv, cwd, name="<doc>"):
        out = os.path.join(cwd, ".doc-test-output")
        req = dict(kind=kind, what=what, argv=argv, cwd=cwd, out=out, timeout=self.timeout, name=name)
        self.server.stdin.write(json.dumps(req) + "\n")
        self.server.stdin.flush()
        rc = json.loads(self.server.stdout.readline())["rc"]
        with open(out) as f:
            text = f.read()
        os.unlink(out)
        return rc, text

    def fresh(self, argv, cwd, env=None, shell=False):
        try:
            p = subprocess.run(argv, cwd=cwd, env=dict(self.env, **(env or {})), shell=shell, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=self.timeout,
                               executable="/bin/bash" if shell else None)
        except subprocess.TimeoutExpired as e:
            return "timeout", e.stdout or ""
        return p.returncode, p.stdout

    def python(self, source, cwd, env=None, name="<doc>"):
        if env:
            path = os.path.join(cwd, ".doc-test-block.py")
            with open(path, "w") as f:
                f.write(source)
            return self.fresh([sys.executable, path], cwd, env)
        return self.forked("code", source, ["-c"], cwd, name)

    def command(self, line, cwd, env=None):
        simple = None if env else simple_python(line)
        if simple:
            return self.forked(*simple, cwd)
        return self.fresh(line, cwd, env, shell=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
