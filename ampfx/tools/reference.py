"""The op-table reference page, generated from :mod:`ampfx.ops` (never hand-copied).

``python -m ampfx.tools.reference > docs/op-tables.md`` rewrites it; a test fails when the
committed page differs from what the tables generate.
"""
from __future__ import annotations

import torch

from .. import ops
from ..ops import Category


def _key_text(key: object) -> str:
    if isinstance(key, str):
        if key.startswith("lib::"):
            return key[5:]
        return f"aten.{key[6:]}" if key.startswith("aten::") else f"Tensor.{key}"
    if isinstance(key, type):
        return f"{key.__module__.replace('torch.nn.modules.', 'nn.').split('.')[0]}.{key.__name__}" \
            if key.__module__.startswith("torch.nn") else ops.qualified_name(key)
    return ops.qualified_name(key)


def markdown() -> str:
    """The whole reference page as Markdown."""
    lines = [
        "# Op tables",
        "",
        "Generated from `ampfx/ops.py` by `python -m ampfx.tools.reference > docs/op-tables.md`; do not edit by hand",
        "(a test fails when this page is stale). Each op has one canonical name, used in `AMPFX_*` variables,",
        "`Policy` list arguments and the report; the forms column lists every function, `Tensor` method,",
        "module type and ATen op that maps to it. `fp16` / `bf16` columns differ where range matters.",
        "",
    ]
    order = [Category.ALLOW, Category.INFER, Category.CLEAR, Category.DENY, Category.PASS]
    titles = {Category.ALLOW: "Allow list", Category.INFER: "Infer list", Category.CLEAR: "Clear list",
              Category.DENY: "Deny list", Category.PASS: "Left as written (pass)"}
    for cat in order:
        rows = [r for r in ops.ENTRIES.values() if r.category is cat]
        lines += [f"## {titles[cat]}", "", "| op | fp16 | bf16 | reason | forms |", "|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: r.name):
            fp16, why16 = r.for_dtype(torch.float16)
            bf16, why16b = r.for_dtype(torch.bfloat16)
            reason = r.reason if why16 == r.reason else f"{r.reason} — fp16: {why16}"
            forms = sorted({_key_text(k) for k in ops.aliases_of(r.name)})
            extra = []
            if r.fp32_args:
                extra.append(f"float32 slots: {', '.join(map(str, r.fp32_args))}")
            if r.accum_dtype:
                extra.append(f"accumulates via `{r.accum_dtype}=`")
            if r.probe:
                extra.append(f"probed on the device ({r.probe})")
            if r.gemm:
                extra.append(f"padded as `{r.gemm}`")
            text = reason + (f" ({'; '.join(extra)})" if extra else "")
            lines.append(f"| `{r.name}` | {fp16.value} | {bf16.value} | {text.replace('|', '/')} | "
                         f"{', '.join(f'`{f}`' for f in forms)} |")
        lines.append("")
    lines += ["Ops in no table stay float32 and are counted as \"not in any list\" in the report.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
