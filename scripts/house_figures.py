#!/usr/bin/env python3
"""The house's figures, measured from the source: import circles by folder, the longest functions,
the largest files. Reads only `.rs` files that git tracks; prints, writes nothing.

    python3 scripts/house_figures.py circles [FOLDER…]   # import circles among a folder's children
    python3 scripts/house_figures.py functions [N]       # the N longest functions (default 10)
    python3 scripts/house_figures.py files [N]           # the N largest files in lines (default 10)
    python3 scripts/house_figures.py duplicates [N]      # pairs of files sharing 6-line runs (N shown)

**Duplicates.** Every tracked source file (`.rs`, `.cu`, `.cuh`, `.py`, `.sh`; not `fuzz/`) as
its significant lines — stripped, without blank lines, comments, `use`/`import` lines and lines
of punctuation alone. A run is 6 consecutive significant lines; two places share it *identically*
when the lines are equal, or *by shape* when they are equal once every name, number and string is
replaced by a placeholder (a run shared by more than 8 places is too common to count). A pair is
two files (or two places of one file) sharing at least one run; it counts once however many runs
they share, as identical if any run is, else as shape only.

**Import circles.** For every folder, its children (each `.rs` file, and each sub-folder taken
whole) are the nodes; an edge A → B means code in A names an item of B, through `crate::`,
`super::` or `self::` paths (in `use` trees or inline). A name the folder's `mod.rs` (or `lib.rs`)
re-exports counts as its defining child's; an item `mod.rs` defines itself makes `mod.rs` a node.
Test modules (`#[cfg(test)] mod tests { … }` blocks and files), comments and doc links are left
out: a test module may use anything. A circle is a strongly connected set of two or more nodes.
"""
import collections
import re
import subprocess
import sys

CRATES = {"src": "odc", "actors/src": "odc-actors", "policy/src": "odc-policy", "model/src": "odc-model",
          "text/src": "odc-text", "kernels/src": "odc-kernels", "checkpoint/src": "odc-checkpoint",
          "transport/src": "odc-transport", "benches/src": "odc-bench"}


def tracked_rs():
    out = subprocess.run(["git", "ls-files", "*.rs"], capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if not f.startswith("fuzz/")]


def strip(text):
    """Drops comments, string literals and `#[cfg(test)] mod … { … }` blocks."""
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', '""', text)
    out, i = [], 0
    pat = re.compile(r"#\[cfg\((all\()?test[^\]]*\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{")
    while True:
        m = pat.search(text, i)
        if not m:
            out.append(text[i:])
            break
        out.append(text[i:m.start()])
        depth, j = 1, m.end()
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        i = j
    return "".join(out)


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> ['a::b', 'a::c::d', 'a::c::e']."""
    tree = re.sub(r"\s+", "", tree)
    if "{" not in tree:
        return [re.sub(r"\bas\w+$", "", tree)] if tree else []
    k = tree.index("{")
    prefix, body = tree[:k], tree[k + 1:tree.rindex("}")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        cur += ch
    parts.append(cur)
    return [prefix + q for p in parts if p for q in expand_use(p)]


def module_of(path):
    """(crate root folder, module segments) of a source file."""
    for root in sorted(CRATES, key=len, reverse=True):
        if path.startswith(root + "/"):
            rel = path[len(root) + 1:-3].split("/")
            if rel[-1] in ("mod", "lib", "main"):
                rel = rel[:-1]
            return root, rel
    return None, None


def references(path, text):
    """Absolute module paths (segment lists, from the crate root) that a file names."""
    root, mod = module_of(path)
    is_facade = path.endswith(("/mod.rs", "/lib.rs", "/main.rs"))
    here = mod if is_facade else mod[:-1]   # the module `super::` of a child resolves against
    paths = []
    for m in re.finditer(r"\buse\s+([^;]+);", text):
        paths += expand_use(m.group(1))
    paths += [m.group(0) for m in re.finditer(r"\b(crate|super|self)(::\w+)+", text)]
    out = []
    for p in paths:
        segs = [s for s in p.split("::") if s]
        if not segs:
            continue
        if segs[0] == "crate":
            base, segs = [], segs[1:]
        elif segs[0] == "self":
            base, segs = list(mod), segs[1:]
        elif segs[0] == "super":
            base = list(mod)
            while segs and segs[0] == "super":
                base = base[:-1] if base else base
                segs = segs[1:]
            if not is_facade and base == mod[:-1]:
                pass
        else:
            continue
        out.append(base + segs)
    return root, out


def reexports(text):
    """Names a facade re-exports: name -> child module."""
    names = {}
    for m in re.finditer(r"\bpub(\([^)]*\))?\s+use\s+([^;]+);", text):
        for p in expand_use(m.group(2)):
            segs = [s for s in p.split("::") if s and s != "self"]
            if len(segs) >= 2:
                names[segs[-1]] = segs[0]
    return names


def test_only(files):
    """Files declared by `#[cfg(test)] mod name;`: a test module may use anything."""
    out = set()
    for f in files:
        text = open(f, encoding="utf-8").read()
        here = f[:-3] if not f.endswith(("/mod.rs", "/lib.rs", "/main.rs")) else f.rsplit("/", 1)[0]
        for m in re.finditer(r"#\[cfg\((all\()?test[^\]]*\]\s*(pub(\([^)]*\))?\s+)?mod\s+(\w+)\s*;", text):
            out |= {f"{here}/{m.group(4)}.rs", f"{here}/{m.group(4)}/mod.rs"}
            out |= {g for g in files if g.startswith(f"{here}/{m.group(4)}/")}
    return out


def circles(folders):
    files = tracked_rs()
    tests = test_only(files)
    files = [f for f in files if f not in tests]
    texts = {f: strip(open(f, encoding="utf-8").read()) for f in files}
    facades = {}
    for f in files:
        root, mod = module_of(f)
        if root is not None and f.endswith(("/mod.rs", "/lib.rs", "/main.rs")):
            facades[(root, tuple(mod))] = reexports(texts[f])
    dirs = collections.defaultdict(set)
    for f in files:
        root, mod = module_of(f)
        if root is None:
            continue
        parts = f.split("/")
        for k in range(len(root.split("/")), len(parts)):
            dirs["/".join(parts[:k])].add(parts[k])
    result = []
    for d in sorted(dirs):
        if folders and not any(d == x.rstrip("/") for x in folders):
            continue
        root = next((r for r in sorted(CRATES, key=len, reverse=True)
                     if d == r or d.startswith(r + "/")), None)
        if root is None:
            continue
        dmod = d[len(root) + 1:].split("/") if d != root else []
        children = {c[:-3] if c.endswith(".rs") else c: c for c in dirs[d]}
        facade_name = next((c for c in ("mod", "lib", "main") if c in children), None)
        names = facades.get((root, tuple(dmod)), {})
        edges = collections.defaultdict(set)
        for f in files:
            if not f.startswith(d + "/"):
                continue
            child = f[len(d) + 1:].split("/")[0]
            node = child[:-3] if child.endswith(".rs") else child
            froot, refs = references(f, texts[f])
            if froot != root:
                continue
            for r in refs:
                if r[:len(dmod)] != dmod or len(r) <= len(dmod):
                    continue
                seg = r[len(dmod)]
                if seg in children and seg != facade_name:
                    target = seg
                elif seg in names and names[seg] in children:
                    target = names[seg]
                elif facade_name and node != facade_name and seg[:1].isalpha():
                    target = facade_name
                else:
                    continue
                if target != node:
                    edges[node].add(target)
        if facade_name:
            # The facade's own `pub mod` / `pub use` lines are declarations, not uses.
            src = re.sub(r"\bpub(\([^)]*\))?\s+(use|mod)\s+[^;]+;", "", texts[
                next(f for f in files if f == f"{d}/{facade_name}.rs")])
            src = re.sub(r"\bmod\s+\w+\s*;", "", src)
            _, refs = references(f"{d}/{facade_name}.rs", src)
            edges[facade_name] = set()
            for r in refs:
                if r[:len(dmod)] == dmod and len(r) > len(dmod) and r[len(dmod)] in children \
                        and r[len(dmod)] != facade_name:
                    edges[facade_name].add(r[len(dmod)])
            for name in re.findall(r"\b([A-Za-z_]\w*)\s*\(", src):
                if name in names and names[name] in children:
                    edges[facade_name].add(names[name])
        for scc in tarjan(set(children), edges):
            if len(scc) > 1:
                result.append((d, sorted(scc), len(children)))
    return result


def tarjan(nodes, edges):
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            out.append(scc)

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def functions(n):
    rows = []
    for f in tracked_rs():
        lines = open(f, encoding="utf-8").read().split("\n")
        for i, line in enumerate(lines):
            m = re.match(r"^\s*(pub(\([a-z]+\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?fn\s+(\w+)", line)
            if not m:
                continue
            depth, started, j = 0, False, i
            for j in range(i, len(lines)):
                depth += lines[j].count("{") - lines[j].count("}")
                started = started or "{" in lines[j]
                if (started and depth <= 0) or (not started and lines[j].rstrip().endswith(";")):
                    break
            rows.append((j - i + 1, f"{f}:{i + 1}", m.group(6)))
    rows.sort(reverse=True)
    return rows[:n]


def largest(n):
    rows = [(sum(1 for _ in open(f, encoding="utf-8")), f) for f in tracked_rs()]
    rows.sort(reverse=True)
    return rows[:n]


SOURCE_ENDINGS = (".rs", ".cu", ".cuh", ".py", ".sh")
RUN = 6
TOO_COMMON = 8


def tracked_sources():
    out = subprocess.run(["git", "ls-files"], capture_output=True, text=True, check=True)
    return [f for f in out.stdout.split() if f.endswith(SOURCE_ENDINGS) and not f.startswith("fuzz/")]


def significant(path):
    """(line number, identical form, shape form) of each significant line of `path`."""
    rows = []
    hash_comments = path.endswith((".py", ".sh"))
    for no, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
        text = line.strip()
        if not text or text.startswith("//") or (hash_comments and text.startswith("#")):
            continue
        if re.match(r"^(pub(\([^)]*\))?\s+)?use\s|^import\s|^from\s+\S+\s+import\s", text):
            continue
        if not re.search(r"[A-Za-z0-9]", text):
            continue
        shape = re.sub(r'"(\\.|[^"\\])*"', '"s"', text)
        shape = re.sub(r"\b[A-Za-z_]\w*\b", "x", shape)
        shape = re.sub(r"\b\d[\w.]*\b", "0", shape)
        rows.append((no, text, shape))
    return rows


def duplicates():
    """Pairs of places sharing a run: {(a, b): identical?}."""
    runs = {0: collections.defaultdict(list), 1: collections.defaultdict(list)}
    for f in tracked_sources():
        rows = significant(f)
        for i in range(len(rows) - RUN + 1):
            window = rows[i:i + RUN]
            for kind in (0, 1):
                key = tuple(r[1 + kind] for r in window)
                runs[kind][key].append((f, window[0][0], window[-1][0]))
    pairs = {}
    for kind in (0, 1):
        for places in runs[kind].values():
            if len(places) < 2 or len(places) > TOO_COMMON:
                continue
            for i, (fa, sa, ea) in enumerate(places):
                for fb, sb, eb in places[i + 1:]:
                    if fa == fb and sb <= ea:
                        continue  # one place overlapping itself
                    key = tuple(sorted((fa, fb)))
                    pairs[key] = pairs.get(key, False) or kind == 0
    return pairs


def main(argv):
    what = argv[1] if len(argv) > 1 else "circles"
    if what == "circles":
        found = circles(argv[2:])
        for d, scc, total in found:
            print(f"{d}: {len(scc)} of {total} in a circle: {', '.join(scc)}")
        print(f"{len(found)} circles in {len({d for d, _, _ in found})} folders")
    elif what == "functions":
        for lines, at, name in functions(int(argv[2]) if len(argv) > 2 else 10):
            print(f"{lines:5} {name}  {at}")
    elif what == "duplicates":
        pairs = duplicates()
        identical = sum(1 for v in pairs.values() if v)
        print(f"{len(pairs)} pairs of places sharing {RUN}-line runs: {identical} identical, "
              f"{len(pairs) - identical} by shape only")
        shown = int(argv[2]) if len(argv) > 2 else 0
        for (a, b), same in sorted(pairs.items(), key=lambda kv: (not kv[1], kv[0]))[:shown]:
            print(f"  {'identical' if same else 'shape    '} {a} ~ {b}")
    elif what == "files":
        for lines, f in largest(int(argv[2]) if len(argv) > 2 else 10):
            print(f"{lines:5} {f}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
