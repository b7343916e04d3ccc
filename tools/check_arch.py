"""tools/check_arch.py: the architecture guard of offload (stdlib only; never imports offload).

Parses every module under offload/ (bench/ included) with ``ast``. Kinds of finding:
  cycle    strongly connected components of the import graph of offload modules: relative and absolute
           imports, at module level (in if/try/class bodies too) AND function level. ``from .p import n``
           is an edge to module ``p.n`` if that exists, else to ``p``; parent packages are not implied.
  native   modules outside offload/native/ (the one door) importing ``offload._C`` in any spelling (``from .. import
           _C``, ``import offload._C``, ``from offload.native import _C``).
  size     files over MAX_LINES lines in offload/, csrc/, tests/.
  private  private attributes reached across modules, approximated without type inference: ``_x`` (no
           dunder) is owned by the modules defining it (``self._x =``, ``cls._x =``, ``def _x`` or
           ``_x =`` in a class body, ``"_x"`` in ``__slots__``). ``base._x`` with base not self/cls/super()
           is reported in offload/ when ``_x`` is owned by other offload modules, not this one
           (``eng._collect`` in schedule/feedstep.py, owned by engine/engine.py), or base is another offload
           module, or ``base._x = ...`` is written by a module that does not own ``_x`` (even if none
           does); in tests/, when any offload module owns ``_x``, or base is an offload module or _C.
           Never: names no offload module owns (torch's), NOT_OURS, other libraries' modules' attributes,
           private submodules (``offload._version``), ``_C._x`` in offload/.
  header   offload modules whose opening docstring does not start with their own path and ":"
           (``schedule/uploads.py: ...`` or ``offload/schedule/uploads.py: ...``; a package ``__init__`` may
           say ``engine/`` or ``offload.engine``, the root one ``offload``). Without a docstring, the first
           comment line may carry the header.
  cite     paths cited anywhere in an offload module (offload/, csrc/, docs/, tests/, examples/,
           tools/) that do not exist.
  layer    imports against the layer order and the narrower rules (LAYERS and ONLY, below); ``parse``: a
           file that does not parse (never allowlisted).

Usage (paths relative to the repository root): ``python tools/check_arch.py`` exits 1, printing both
lists, if a finding is not in tools/arch_allow.txt or an allowlisted one no longer occurs (the list
may only shrink), else 0 (tests/test_architecture.py runs it in CI). ``--report``: every finding by
kind, line totals per package. ``--graph``: the import graph, an edge a line. ``--write-allow``: rewrite
tools/arch_allow.txt from the tree as it is (sorted, atomic): after removing violations, or for a baseline.
Allowlist: ``kind path [detail]`` a line; ``#`` starts a comment. A size entry is a ceiling (``size
tests/test_big.py 456``: may shrink, not grow; stale once at most MAX_LINES). Others match exactly.
"""
import argparse
import ast
import gc
import os
import re
import sys
from collections import defaultdict

# ---- tables: layer order, lowest first; a package is the first folder under offload/, "" the root files. Empty:
# rule off. When set, a module of package P may import only P or packages listed before P (packages
# not listed are not checked).
LAYERS: tuple = ("base", "native", "device", "moments", "state", "params", "engine", "schedule", "checkpoint", "optim",
                 "", "bench")
# Narrower: importer (package or module path) -> the only other packages it may import (base/: leaves).
ONLY: dict = {"base": (), "native": ("base",), "device": ("base",), "moments": ("base", "native"),
              "checkpoint": ("base", "moments"),
              "offload/planner.py": ("base", "moments", "state"),
              "offload/plan_args.py": ("base", "moments", "state")}
MAX_LINES = 400
SIZE_DIRS = ("offload", "csrc", "tests")
SIZE_EXTS = (".py", ".h", ".hpp", ".c", ".cc", ".cpp", ".cu", ".cuh")
NATIVE = "offload._C"
NATIVE_SPELLINGS = {NATIVE, "offload.native._C"}  # native/__init__.py binds _C: the same module by another name
NATIVE_HOME = "offload/native/"  # the only package that may import it
NOT_OURS = {"_version", "_base"}  # torch's Tensor._version/_base (offload also has a _base of its own)
CITE_RE = re.compile(r"(?<![\w./-])((?:offload|csrc|docs|tests|examples|tools)/(?:[\w-]+(?:\.[\w-]+)*/?)*)")
KINDS = ("parse", "cycle", "layer", "native", "size", "private", "header", "cite")
ALLOW = "tools/arch_allow.txt"
ALLOW_HEAD = ("# tools/arch_allow.txt: today's violations of tools/check_arch.py; this list may only shrink.\n"
              "# Regenerate with `python tools/check_arch.py --write-allow` (sorted, one finding a line).\n"
              "# 'size' entries are ceilings: the file may shrink, not grow past the count.\n")
_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
_WANT = (ast.Import, ast.ImportFrom, ast.Attribute, ast.ClassDef)
_private = re.compile(r"_(?!_\w*__$)").match  # a private name: _x or __x, not a dunder


class Finding:
    """One violation: kind + path + detail is its allowlist key; lines and note are only shown."""
    def __init__(self, kind, path, detail="", line=None, note=""):
        self.kind, self.path, self.detail, self.note = kind, path, str(detail), note
        self.lines, self.key = [] if line is None else [line], " ".join(x for x in (kind, path, str(detail)) if x)

    def where(self):
        s = f"line {', '.join(map(str, sorted(set(self.lines))))}" if self.lines else ""
        return "; ".join(x for x in (s, self.note) if x)


def _walk(root, top, exts):
    out = []
    for d, dirs, files in os.walk(os.path.join(root, top)):
        dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "build") and not x.startswith("."))
        out += [os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/") for f in files if f.endswith(exts)]
    return sorted(out)


def _read(root, rel):
    try:
        with open(os.path.join(root, rel), "rb") as f:
            return f.read()
    except OSError:  # removed by a concurrent edit
        return b""


def package(rel):  # 'offload/engine/engine.py' -> 'engine'; a root file -> ''
    return rel.split("/")[1] if rel.count("/") > 1 else ""


def _nodes(tree):
    """[(node, in_function)] of a tree's imports, attributes and classes, in one pass (ast.walk is slow)."""
    out, stack, AST, ctx = [], [(tree, False)], ast.AST, ast.expr_context
    while stack:
        node, inf = stack.pop()
        if isinstance(node, _WANT):
            out.append((node, inf))
        sub = inf or isinstance(node, _DEFS)
        for v in node.__dict__.values():  # the fields, and ints (positions)
            if type(v) is list:
                stack += [(c, sub) for c in v if isinstance(c, AST)]
            elif isinstance(v, AST) and not isinstance(v, ctx):
                stack.append((v, sub))
    return out


class Module:
    def __init__(self, rel, text, tree, name=None):
        parts = rel[:-3].split("/")
        self.name = name or ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        self.rel, self.text, self.tree, self.nodes = rel, text, tree, _nodes(tree)
        self.is_pkg = parts[-1] == "__init__"
        self.imports = []  # (target module, line, "module"|"function"), offload targets only
        self.aliases = {}  # local name -> the module it is bound to (any library)

    def resolve(self, node, known):
        """[(target, local name, module bound to it or None)] of one Import/ImportFrom."""
        if isinstance(node, ast.Import):
            return [(NATIVE if a.name in NATIVE_SPELLINGS else a.name, a.asname or a.name.split(".")[0],
                     (NATIVE if a.name in NATIVE_SPELLINGS else a.name) if a.asname else a.name.split(".")[0])
                    for a in node.names]
        base = node.module or ""
        if node.level:
            pkg = self.name.split(".")[:None if self.is_pkg else -1]
            base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
        out = []
        for a in node.names:
            full = f"{base}.{a.name}"
            full = NATIVE if full in NATIVE_SPELLINGS else full
            tgt = full if full in known or full == NATIVE else base
            out.append((tgt, a.asname or a.name, full if full == tgt else None))
        return out


def _parse(root, rel, findings, name=None):
    text = _read(root, rel).decode("utf-8", "replace")
    try:
        return Module(rel, text, ast.parse(text, rel), name)
    except SyntaxError as e:
        findings.append(Finding("parse", rel, line=e.lineno, note=e.msg))


def load_modules(root, findings):
    mods = {m.name: m for m in (_parse(root, rel, findings) for rel in _walk(root, "offload", (".py",))) if m}
    for m in mods.values():
        for node, inf in m.nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for tgt, local, bound in m.resolve(node, mods):
                    if bound is not None:
                        m.aliases[local] = bound
                    imp = (tgt, node.lineno, "function" if inf else "module")
                    if (tgt in mods or tgt == NATIVE) and tgt != m.name and imp not in m.imports:
                        m.imports.append(imp)
        m.imports.sort(key=lambda t: (t[1], t[0]))
    return mods


def _sccs(graph):
    """Strongly connected components of more than one module (mutual reachability; ~100 nodes)."""
    reach = {}
    for v in graph:
        seen, todo = set(), [v]
        while todo:
            new = graph.get(todo.pop(), set()) - seen
            seen |= new
            todo += new
        reach[v] = seen
    comps = {tuple(sorted(w for w in reach[v] if v in reach[w])) for v in graph if v in reach[v]}
    return sorted(list(c) for c in comps if len(c) > 1)


def check_imports(mods, layers=None, only=None):
    layers, only = (LAYERS if layers is None else layers), (ONLY if only is None else only)
    graph, out = {m: set() for m in mods}, []
    for m in mods.values():
        out += [Finding("native", m.rel, line=ln, note=f"{lvl} level") for t, ln, lvl in m.imports
                if t == NATIVE and not m.rel.startswith(NATIVE_HOME)]
        graph[m.name] |= {t for t, _, _ in m.imports if t != NATIVE}
    for comp in _sccs(graph):
        rels = [mods[n].rel for n in comp]
        edges = [f"{mods[a].rel}:{ln} -> {mods[t].rel} ({lvl})" for a in comp for t, ln, lvl in mods[a].imports
                 if t in comp]
        out.append(Finding("cycle", rels[0], " ".join(f"<-> {r}" for r in rels[1:]), note="; ".join(edges)))
    rank = {p: i for i, p in enumerate(layers)}
    for m in mods.values() if layers else ():
        p = package(m.rel)
        allowed = only.get(m.rel, only.get(p))
        for tgt, line, lvl in m.imports:
            q = package(mods[tgt].rel) if tgt in mods else None
            if p != q and p in rank and q in rank and (rank[q] > rank[p] or allowed is not None and q not in allowed):
                out.append(Finding("layer", m.rel, f"-> {mods[tgt].rel}", line=line, note=f"{lvl} level"))
    return out, graph


def _owned(nodes):
    """Private names a module defines on its classes and instances (see the docstring)."""
    names = set()
    for node, _ in nodes:
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for st in node.body:
                if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(st.name)
                for t in st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AnnAssign) \
                        else []:
                    names.add(getattr(t, "id", ""))
                    if getattr(t, "id", "") == "__slots__" and st.value is not None:
                        names.update(c.value for c in ast.walk(st.value) if isinstance(c, ast.Constant)
                                     and isinstance(c.value, str))
    return {n for n in names if _private(n)}


def _short(node):
    """Source of an expression, call arguments elided, at most 40 characters."""
    node = ast.parse(ast.unparse(node), mode="eval").body
    for c in ast.walk(node):
        if isinstance(c, ast.Call):
            c.args, c.keywords = [ast.Constant(...)], []
    s = ast.unparse(node)
    return s if len(s) <= 40 else s[:37] + "..."


def _privates_in(m, owners, mods, in_tests):
    out = []
    for node, _ in m.nodes:
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = root = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls") or \
                isinstance(base, ast.Call) and getattr(base.func, "id", None) == "super":
            continue
        while isinstance(root, ast.Attribute):
            root = root.value
        bound = m.aliases.get(root.id) if isinstance(root, ast.Name) else None
        if bound is not None and not bound.startswith("offload"):
            continue  # torch.x._y, np._y: other libraries' internals
        modname = bound + ast.unparse(base)[len(root.id):] if bound and isinstance(base, (ast.Name, ast.Attribute)) \
            else None
        if modname in mods or modname == NATIVE:  # an attribute of an offload module
            if f"{modname}.{node.attr}" not in (*mods, NATIVE) and \
                    (modname == NATIVE and in_tests or modname in mods and mods[modname].rel != m.rel):
                out.append(Finding("private", m.rel, f"{_short(base)}.{node.attr}", line=node.lineno))
            continue
        own = owners.get(node.attr, ())
        store = not in_tests and isinstance(node.ctx, (ast.Store, ast.Del)) and m.rel not in own  # on another object
        if not store and (not own or node.attr in NOT_OURS or (not in_tests and m.rel in own)):
            continue
        note = "" if in_tests else f"owned by {', '.join(sorted(own)) or 'no offload module'}"
        out.append(Finding("private", m.rel, f"{_short(base)}.{node.attr}", line=node.lineno, note=note))
    return out


def check_privates(root, mods, findings):
    owners = defaultdict(set)
    for m, n in ((m, n) for m in mods.values() for n in _owned(m.nodes)):
        owners[n].add(m.rel)
    out = [f for m in mods.values() for f in _privates_in(m, owners, mods, False)]
    tests = (_parse(root, rel, findings, rel[:-3].replace("/", ".")) for rel in _walk(root, "tests", (".py",)))
    for t in filter(None, tests):
        t.aliases.update((local, bound) for node, _ in t.nodes if isinstance(node, (ast.Import, ast.ImportFrom))
                         for _, local, bound in t.resolve(node, mods) if bound)
        out += _privates_in(t, owners, mods, True)
    return out


def _header_ok(rel, first):
    sub = rel[len("offload/"):]
    heads = {sub, rel}
    if sub.endswith("__init__.py"):
        d = sub[:-len("__init__.py")]
        heads |= {"offload/" + d} | ({d, "offload." + d[:-1].replace("/", ".")} if d else {"offload"})
    return any(first.startswith(h + ":") for h in heads)


def check_headers(root, mods):
    out = []
    for m in mods.values():
        doc, head = ast.get_docstring(m.tree, clean=False), m.text.lstrip().split("\n", 1)[0]
        first = doc.lstrip() if doc is not None else head.lstrip("# ") if head.startswith("#") else ""
        if not _header_ok(m.rel, first):
            out.append(Finding("header", m.rel, note=repr(first.split("\n")[0][:60]) if first else "no docstring"))
        for mt in CITE_RE.finditer(m.text):
            path = mt.group(1).rstrip(".-")
            if not os.path.exists(os.path.join(root, path)):
                out.append(Finding("cite", m.rel, path, line=m.text.count("\n", 0, mt.start()) + 1))
    return out


def check_sizes(root):
    out, totals = [], defaultdict(int)
    for top in SIZE_DIRS:
        for rel in _walk(root, top, SIZE_EXTS):
            n = len(_read(root, rel).splitlines())
            pkg = package(rel) if top == "offload" else ""
            totals[f"{top}/{pkg}/" if pkg else f"{top}/"] += n
            if n > MAX_LINES:
                out.append(Finding("size", rel, n))
    return out, dict(totals)


def check(root, layers=None, only=None):
    """(findings sorted by kind and key, context: modules, import graph, line totals) of the tree at root."""
    gc_on = gc.isenabled()
    gc.disable()  # ASTs hold no cycles, and a collection would scan the caller's heap (torch's, under pytest)
    try:
        mods = load_modules(root, out := [])
        imports, graph = check_imports(mods, layers, only)
        sizes, totals = check_sizes(root)
        seen = {}
        for f in imports + sizes + check_privates(root, mods, out) + check_headers(root, mods) + out:
            seen.setdefault(f.key, Finding(f.kind, f.path, f.detail, note=f.note)).lines += f.lines
        found = sorted(seen.values(), key=lambda f: (KINDS.index(f.kind), f.key))
        return found, {"mods": mods, "graph": graph, "totals": totals}
    finally:
        if gc_on:
            gc.enable()


def read_allow(path):
    """Allowlist keys (comments and blank lines dropped); a missing file is an empty list."""
    lines = _read(os.path.dirname(path), os.path.basename(path)).decode("utf-8").splitlines()
    return [k for k in (" ".join(ln.split("#", 1)[0].split()) for ln in lines) if k]


def compare(findings, allow):
    """(new, stale): findings the allowlist does not allow, allowlist entries that no longer occur."""
    ceil = {a.split()[1]: a for a in allow if re.fullmatch(r"size \S+ \d+", a)}
    new, used = [], set()
    for f in findings:
        a = ceil.get(f.path) if f.kind == "size" else f.key if f.key in allow else None
        used.add(a)
        if a is None or f.kind == "size" and int(f.detail) > int(a.split()[2]):  # over its ceiling: new
            new.append(f)
    return new, [a for a in allow if a not in used]


def write_allow(root, findings):
    path = os.path.join(root, ALLOW)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:  # then renamed: readers never see half a list
        f.write(ALLOW_HEAD + "".join(f"{x.key}\n" for x in findings if x.kind != "parse"))
    os.replace(path + ".tmp", path)
    return path


def report(findings, ctx, out=sys.stdout):
    mods, graph = ctx["mods"], ctx["graph"]
    fun = [f"  function-level: {m.rel}:{ln} -> {mods[t].rel}" for m in sorted(mods.values(), key=lambda m: m.rel)
           for t, ln, lvl in m.imports if t in mods and lvl == "function"]
    n = sum(t in mods for m in mods.values() for t, _, _ in m.imports)
    print(f"import graph: {len(mods)} modules, {sum(map(len, graph.values()))} edges from {n - len(fun)} module-"
          f"level + {len(fun)} function-level imports (`from x import a, b` of two modules counts 2); layer rule "
          f"{'on' if LAYERS else 'off (LAYERS is empty)'}", *fun, sep="\n", file=out)
    for kind in KINDS:
        group = [f"  {f.key}" + (f"    [{f.where()}]" if f.where() else "") for f in findings if f.kind == kind]
        print(f"\n{kind}: {len(group)}", *group, sep="\n", file=out)
    print("\nlines per package:", *(f"  {k:<22}{v:>7}" for k, v in sorted(ctx["totals"].items())), sep="\n", file=out)


def main(argv=None, root=None):
    ap = argparse.ArgumentParser(description="offload's architecture guard (see the module docstring)")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--report", action="store_true", help="print every finding by kind, and line totals")
    g.add_argument("--graph", action="store_true", help="print the internal import graph")
    g.add_argument("--write-allow", action="store_true", help=f"rewrite {ALLOW} from the current tree")
    args = ap.parse_args(argv)
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    findings, ctx = check(root)
    if args.report:
        report(findings, ctx)
    elif args.graph:
        mods = ctx["mods"]
        print(*(f"{m.rel}:{ln} -> {mods[t].rel if t in mods else t} ({lvl})" for m in sorted(
            mods.values(), key=lambda m: m.rel) for t, ln, lvl in m.imports), sep="\n")
    elif args.write_allow:
        sys.stdout.write("".join(f"warning: {f.path} does not parse ({f.where()}): its findings are not listed\n"
                                 for f in findings if f.kind == "parse"))
        print(f"wrote {write_allow(root, findings)}")
    else:
        new, stale = compare(findings, read_allow(os.path.join(root, ALLOW)))
        msg = [f"NEW (not in {ALLOW}): {f.key}" + (f"    [{f.where()}]" if f.where() else "") for f in new] + \
            [f"STALE (in {ALLOW}, no longer occurs: delete the line, or run --write-allow): {a}" for a in stale]
        print(*msg or [f"check_arch: clean against {ALLOW} ({len(findings)} allowlisted findings)"], sep="\n")
        return 1 if msg else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
