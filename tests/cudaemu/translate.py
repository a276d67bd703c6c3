#!/usr/bin/env python3
"""cudaemu: turn a .cu file into C++ the host compiler takes.

Rewrites kernel launches `k<<<grid, block[, smem[, stream]]>>>(args)` into
`cudaemu::launch_named(cudaemu::cfg(grid, block, ...), "k", k, args)` and
`extern __shared__ T name[];` into a pointer to the launch's dynamic shared
memory. Everything else is left to include/cudaemu_device.h.

usage: translate.py IN.cu OUT.cpp
"""
import re
import sys


def find_matching(text, start, open_tok, close_tok):
    """Index just past the close_tok matching the open_tok at `start`."""
    depth = 0
    i = start
    while i < len(text):
        if text.startswith(open_tok, i):
            depth += 1
            i += len(open_tok)
            continue
        if text.startswith(close_tok, i):
            depth -= 1
            i += len(close_tok)
            if depth == 0:
                return i
            continue
        i += 1
    raise SystemExit("translate.py: unbalanced %s at offset %d" % (open_tok, start))


LAUNCH = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\s*<[^<>;()]*>)?)\s*<<<")
SMEM = re.compile(r"extern\s+__shared__\s+([A-Za-z_][A-Za-z0-9_ ]*?)\s+([A-Za-z_][A-Za-z0-9_]*)\s*\[\s*\]\s*;")


def translate(text):
    out = []
    pos = 0
    while True:
        m = LAUNCH.search(text, pos)
        if not m:
            out.append(text[pos:])
            break
        kernel = m.group(1)
        cfg_start = m.end()
        cfg_end = text.find(">>>", cfg_start)
        if cfg_end < 0:
            raise SystemExit("translate.py: <<< without >>> after %s" % kernel)
        cfg = text[cfg_start:cfg_end]
        paren = cfg_end + 3
        while text[paren].isspace():
            paren += 1
        if text[paren] != "(":
            raise SystemExit("translate.py: launch of %s without an argument list" % kernel)
        close = find_matching(text, paren, "(", ")")
        args = text[paren + 1:close - 1]
        name = re.sub(r"\s+", "", kernel)
        call = 'cudaemu::launch_named(cudaemu::cfg(%s), "%s", %s' % (cfg, name, kernel)
        if args.strip():
            call += ", " + args
        call += ")"
        out.append(text[pos:m.start()])
        out.append(call)
        pos = close
    text = "".join(out)
    text = SMEM.sub(lambda m: "%s *%s = (%s *)cudaemu::dynamic_smem();" % (m.group(1), m.group(2), m.group(1)), text)
    if "<<<" in text or ">>>" in text:
        raise SystemExit("translate.py: a launch was left untranslated")
    return text


def main():
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        text = f.read()
    with open(sys.argv[2], "w") as f:
        f.write('#line 1 "%s"\n' % sys.argv[1])
        f.write(translate(text))


if __name__ == "__main__":
    main()
