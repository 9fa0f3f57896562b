# Used by tests/test_docs.py; `python tests/support/doccheck.py --fill docs/X.md` refreshes the output blocks after a change.
"""Run the ```python blocks of a Markdown file in order (one namespace, cwd = a temp dir)
and compare each block's stdout with the ```text block right after it (if any)."""
import contextlib, io, os, re, sys, tempfile, textwrap, traceback

PAT = re.compile(r"^( *)```([^\n]*)\n(.*?)^\1```[ \t]*$", re.M | re.S)

def blocks(text):
    out = []
    for m in PAT.finditer(text):
        indent = m.group(1)
        body = textwrap.dedent(m.group(3)) if indent else m.group(3)
        out.append((m.group(2).strip(), body, m.start(), m.end(), indent))
    return out

def norm(s):
    return "\n".join(l.rstrip() for l in s.strip("\n").splitlines())

def run(path, fill=False, show=False):
    text = open(path).read()
    bs = blocks(text)
    ns = {"__name__": "__main__"}
    tmp = tempfile.mkdtemp(); os.chdir(tmp); sys.path.insert(0, tmp)
    ok, repl = True, []
    for i, (lang, code, s, e, indent) in enumerate(bs):
        if lang != "python":
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
            if norm(got) != norm(nxt[1]):
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
    fill, show = "--fill" in sys.argv, "--show" in sys.argv
    paths = [os.path.abspath(a) for a in sys.argv[1:] if not a.startswith("--")]
    sys.exit(0 if all(run(p, fill, show) for p in paths) else 1)
