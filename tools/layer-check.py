#!/usr/bin/env python3
"""layer-check: the dependency rules of docs/architecture.md, checked.

  tools/layer-check.py [--build build]

1. Arrows between folders only point down the stack: every `#include
   "folder/..."` in a folder's sources, and every symbol an object of a
   folder's library uses from another library (nm), must name a folder that
   folder may depend on (ALLOWED below, the table of docs/architecture.md).
2. No circle between the files of one folder: within each static library, an
   object that uses a symbol another object defines depends on it; the
   strongly connected components of that graph must all be single files.

Prints each violation and exits 1 when there is any; Python standard library
and binutils' nm only.
"""
import argparse
import os
import re
import subprocess
import sys

# folder -> the folders it may use (besides itself); from docs/architecture.md.
ALLOWED = {
    "util": set(),
    "kernels": {"util"},
    "config": {"util"},
    "grammar": {"util"},
    "engine": {"kernels", "util"},
    "policies": {"engine", "kernels", "util"},
    "cache": {"engine", "kernels", "util"},
    "cluster": {"cache", "engine", "kernels", "util"},
    "daemon": {"cluster", "policies", "cache", "engine", "grammar", "kernels", "util"},
    "api": {"daemon", "cluster", "policies", "cache", "engine", "grammar", "kernels", "util"},
    "cmd": {"api", "daemon", "config", "cluster", "policies", "cache", "engine", "grammar", "kernels", "util"},
}
LIBS = {"util": ["util/libpd_util.a"], "kernels": ["kernels/libpd_kernels.a", "kernels/libpd_kernels_cuda.a",
                                                        "kernels/libpd_kernels_cudaemu.a"],
        "config": ["config/libpd_config.a"], "grammar": ["grammar/libpd_grammar.a"], "engine": ["engine/libpd_engine.a"],
        "policies": ["policies/libpd_policies.a"], "cache": ["cache/libpd_cache.a"],
        "cluster": ["cluster/libpd_cluster.a"],
        "daemon": ["daemon/libpd_daemon.a"], "api": ["api/libpd_api.a"]}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def check_includes(root):
    bad = []
    for folder, ok in ALLOWED.items():
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for f in files:
                if not f.endswith((".c", ".h", ".cu", ".cuh")):
                    continue
                path = os.path.join(dirpath, f)
                with open(path, encoding="utf-8", errors="replace") as fh:
                    for inc in INCLUDE.findall(fh.read()):
                        top = inc.split("/")[0]
                        if "/" in inc and top in ALLOWED and top != folder and top not in ok:
                            bad.append(f"{os.path.relpath(path, root)} includes {inc}: {folder}/ may not use {top}/")
    return bad


def nm_objects(archive):
    """{object: (defined symbols, undefined symbols)} of a static library."""
    out = subprocess.run(["nm", "-A", "--extern-only", archive], capture_output=True, text=True, check=True).stdout
    objs = {}
    for line in out.splitlines():
        # archive.a:object.o: [address] TYPE symbol
        m = re.match(r"^[^:]+:([^:]+):\s*(?:[0-9a-fA-F]+)?\s+([A-Za-z])\s+(\S+)$", line)
        if not m:
            continue
        obj, kind, sym = m.groups()
        d, u = objs.setdefault(obj, (set(), set()))
        (u if kind == "U" else d).add(sym)
    return objs


def short(obj):
    """cpu_matmul.c.o -> cpu/matmul.c (meson names objects after their path)."""
    return obj.rsplit("/", 1)[-1].removesuffix(".o")


def sccs(nodes, edges):
    """Tarjan's strongly connected components."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(comp)

    for v in nodes:
        if v not in index:
            visit(v)
    return out


def check_objects(build):
    bad = []
    defined_in = {}  # symbol -> folder
    per_folder = {}
    for folder, archives in LIBS.items():
        objs = {}
        for a in archives:
            p = os.path.join(build, a)
            if os.path.exists(p):
                objs.update(nm_objects(p))
        per_folder[folder] = objs
        for d, _ in objs.values():
            for sym in d:
                defined_in.setdefault(sym, folder)
    for folder, objs in per_folder.items():
        owner = {}
        for obj, (d, _) in objs.items():
            for sym in d:
                owner.setdefault(sym, obj)
        edges, why = {}, {}
        for obj, (_, u) in objs.items():
            for sym in sorted(u):
                if sym in owner and owner[sym] != obj:
                    edges.setdefault(obj, set()).add(owner[sym])
                    why.setdefault((obj, owner[sym]), sym)
                other = defined_in.get(sym)
                if other and other != folder and other not in ALLOWED[folder]:
                    bad.append(f"{folder}/{obj} uses {sym} from {other}/: an arrow up the stack")
        for comp in sccs(list(objs), edges):
            if len(comp) > 1:
                inside = set(comp)
                uses = [f"{short(a)} uses {why[(a, b)]} of {short(b)}" for a in sorted(comp)
                        for b in sorted(edges.get(a, ())) if b in inside]
                bad.append(f"{folder}/: a circle between {', '.join(sorted(map(short, comp)))} ({'; '.join(uses)})")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = check_includes(root) + check_objects(os.path.join(root, a.build) if not os.path.isabs(a.build) else a.build)
    for b in bad:
        print(b)
    print(f"layer-check: {len(bad)} violation(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
