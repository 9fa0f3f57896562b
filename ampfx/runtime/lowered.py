"""A converted graph's torch ops called through their C++ handles.

``torch.fx`` writes a captured graph's op as ``torch.ops.aten.mm.default(x, y)``: four attribute reads and
``OpOverload.__call__``, a Python frame, before the op's C++ handle (``OpOverload._op``) runs. That is
``OpOverload.__call__``'s whole work for an op without a Python dispatcher, and it costs about 0.5 us of the
2 us such a call takes on a small tensor (torch 2.14, one CPU thread); an exported graph calls every op so, and a
converted BERT's forward runs hundreds of them a step.

:func:`forward` writes the graph's code again with each such op bound to its handle, and
:func:`either` runs that code except under ``torch.compile``, which traces the code fx wrote (dynamo knows
``torch.ops`` calls, not the handles). The graph itself is not changed: its nodes, the decision log, pickles
and ``gm.code`` keep naming the ops. Calls through the handle go through torch's dispatcher as before
(``__torch_function__`` and dispatch modes see the same ``OpOverload``).

>>> import torch, torch.fx as fx
>>> g = fx.Graph(); x = g.placeholder("x")
>>> _ = g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
>>> gm = fx.GraphModule(torch.nn.Module(), g)
>>> fast = forward(gm.code, type(gm).forward.__globals__)
>>> fast(gm, torch.tensor([-1.0, 2.0]))
tensor([0., 2.])
>>> "_ampfx_op0_relu_default(" in fast.__ampfx_source__
True
"""
from __future__ import annotations

import functools
import inspect
import io
import re
import tokenize
from typing import Any, Callable

import torch
from torch.fx.graph_module import _forward_from_src

from . import is_compiling

__all__ = ["either", "forward"]

_CALL = re.compile(r"(?<![\w.])torch\.ops\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\.([A-Za-z_]\w*)\(")
"""A call of an op overload as fx writes it: ``torch.ops.<namespace>.<op>.<overload>(``."""


def _handle(namespace: str, name: str, overload: str) -> Callable | None:
    """The C++ handle ``OpOverload.__call__`` would call for ``torch.ops.namespace.name.overload``, or ``None``
    where that call does more (an op with a Python dispatcher object) or the name is no overload."""
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    if type(op) is not torch._ops.OpOverload or getattr(op, "_pyobj_dispatcher", None) is not None:
        return None  # (a TorchBind op's call, or one with a Python dispatcher object, does more than its handle)
    return getattr(op, "_op", None)


def forward(src: str, globals_: dict[str, Any], co_fields: dict[str, Any] | None = None) -> Callable | None:
    """The function fx's ``src`` (a graph module's ``code``, its globals ``globals_``) defines, with each op
    overload bound to its C++ handle; ``None`` when it calls none."""
    names: dict[str, Callable] = {}
    aliases: dict[tuple[str, ...], str] = {}
    quoted: list[tuple[int, int]] = []

    def in_text(at: int) -> bool:
        """Is offset ``at`` inside a string or a comment? fx writes neither across lines, so only a line with a
        quote or ``#`` before ``at`` is tokenized (once; about 20 ms for a graph of 500 lines)."""
        if not any(c in src[src.rfind("\n", 0, at) + 1:at] for c in "'\"#"):
            return False
        if not quoted:
            quoted.extend(_strings_and_comments(src) or [(-1, -1)])
        return any(start <= at < end for start, end in quoted)

    def bind(match: re.Match) -> str:
        if in_text(match.start()):
            return match.group(0)
        handle = _handle(*match.groups())
        if handle is None:
            return match.group(0)
        if match.groups() not in aliases:  # one name per op, numbered: names joined by "_" could collide
            aliases[match.groups()] = f"_ampfx_op{len(aliases)}_{match.group(2)}_{match.group(3)}"
            names[aliases[match.groups()]] = handle
        return aliases[match.groups()] + "("

    lowered = _CALL.sub(bind, src)
    if not names:
        return None
    fn = _forward_from_src(lowered, {**globals_, **names}, co_fields)
    fn.__ampfx_source__ = lowered
    return fn


def _strings_and_comments(src: str) -> list[tuple[int, int]]:
    """The spans (offsets into ``src``) of its string literals and comments, which name no call."""
    starts = [0]
    for line in src.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                spans.append((starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return [(0, len(src))]  # not read: nothing bound
    return spans


def either(plain: Callable, fast: Callable) -> Callable:
    """A graph module's ``forward``: ``fast`` (:func:`forward`'s), or ``plain`` (fx's) under ``torch.compile``."""

    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return plain(self, *args, **kwargs)
        return fast(self, *args, **kwargs)

    functools.update_wrapper(forward, plain)
    forward.__signature__ = inspect.signature(plain)
    forward._ampfx_plain = plain
    return forward
