# Used by tests/test_docs.py; `python tests/support/doccheck.py --fill docs/X.md` refreshes the output blocks after a change.
"""Run the ```python blocks of a Markdown file in order (one namespace, cwd = a temp dir)
and compare each block's stdout with the ```text block right after it (if any): the same text, decimal figures
within 10% (:func:`same`: another CPU's low-precision kernels round their own way).

A block that needs a library the core install lacks says so in its info string, after the language:
```` ```python needs=lightning,accelerate ```` (Markdown renders it as Python). Where one of those is not
installed the block is skipped with a line ``--- SKIPPED block N: needs X (not installed)``, and so is its output
check; with ``--strict`` (the lane that installs them) a missing one fails the page instead."""
import contextlib, importlib.util, io, os, re, sys, tempfile, textwrap, traceback

PAT = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```[ \t]*$", re.M | re.S)

def blocks(text):
    out = []
    for m in PAT.finditer(text):
        indent = m.group(1)
        body = textwrap.dedent(m.group(3)) if indent else m.group(3)
        out.append((m.group(2).strip(), body, m.start(), m.end(), indent))
    return out

def needs(info):
    """The libraries a block's info string names (``python needs=a,b`` -> ``["a", "b"]``)."""
    return [lib for word in info.split()[1:] if word.startswith("needs=") for lib in word[6:].split(",") if lib]

def missing(info):
    return [lib for lib in needs(info) if importlib.util.find_spec(lib) is None]

def norm(s):
    return "\n".join(l.rstrip() for l in s.strip("\n").splitlines())

NUMBER = re.compile(r"(?<![\w.])-?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])")
DECIMAL_TOLERANCE = 0.1
"""Decimal figures (a loss, an error: ``0.113``) may differ by this much, relatively, from the page's: another CPU's
bfloat16 and float16 kernels round their own way. Whole numbers (counts, sizes) and all other text must match."""

def same(got, want):
    """``got`` reads as ``want``: the same text, decimal figures within :data:`DECIMAL_TOLERANCE`."""
    if got == want:
        return True
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    for a, b in zip(NUMBER.findall(got), NUMBER.findall(want)):
        x, y = float(a), float(b)
        if abs(x - y) > DECIMAL_TOLERANCE * max(abs(x), abs(y)):
            return False
    return True

def run(path, fill=False, show=False, strict=False):
    text = open(path).read()
    bs = blocks(text)
    ns = {"__name__": "__main__"}
    tmp = tempfile.mkdtemp(); os.chdir(tmp); sys.path.insert(0, tmp)
    ok, repl = True, []
    for i, (info, code, s, e, indent) in enumerate(bs):
        if info.split()[:1] != ["python"]:
            continue
        absent = missing(info)
        if absent:
            said = f"block {i}: needs {', '.join(absent)} (not installed)"
            print(f"--- FAILED {said}: --strict runs every block" if strict else f"--- SKIPPED {said}")
            ok = ok and not strict
            continue
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                exec(compile(code, f"{path}:block{i}", "exec"), ns)
        except Exception:
            print(f"--- block {i} RAISED:\n{code}\n{traceback.format_exc()}")
            ok = False
            continue
        got = buf.getvalue()
        nxt = bs[i + 1] if i + 1 < len(bs) else None
        if nxt and nxt[0] == "text" and text[e:nxt[2]].strip() == "":
            if not same(norm(got), norm(nxt[1])):
                if fill:
                    ind = nxt[4]
                    body = "\n".join((ind + l) if l else l for l in norm(got).splitlines())
                    repl.append((nxt[2], nxt[3], f"{ind}```text\n{body}\n{ind}```"))
                else:
                    ok = False
                    print(f"--- block {i} OUTPUT MISMATCH\n>>> expected:\n{nxt[1]}\n>>> got:\n{got}")
        elif got.strip() and show:
            print(f"--- block {i} (no output block) printed:\n{got}")
    if fill:
        for s, e, new in reversed(repl):
            text = text[:s] + new + text[e:]
        open(path, "w").write(text)
        print(path, "filled", len(repl))
    print(path, "OK" if ok else "FAILED")
    return ok

if __name__ == "__main__":
    fill, show, strict = "--fill" in sys.argv, "--show" in sys.argv, "--strict" in sys.argv
    paths = [os.path.abspath(a) for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(0 if all(run(p, fill, show, strict) for p in paths) else 1)
