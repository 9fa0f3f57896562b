"""What a capture produced and why it was accepted, and how capture errors are written in the report."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx


def copied_graph(graph: fx.Graph) -> fx.Graph:
    """A new graph with ``graph``'s nodes (their ``meta`` shallow-copied) and plain code generation."""
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def short(e: BaseException) -> str:
    """An error as one line for the report: its type and the first line of its text."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}"


@dataclass(frozen=True)
class Capture:
    """One graph for a module, how it was made, and why it was accepted.

    ``method`` is the rung that produced it (``"fx"``, ``"fx, optional arguments
    fixed"``, ``"export"``, ...); ``steps`` every rung tried on the way, with its
    error; ``why`` the check that accepted it. ``leaves`` maps the path of each
    module kept opaque to the trace error that made it a leaf; ``kept`` the
    leaves ``keep_modules`` asked for (module boundaries, each converted on its own). ``dropped`` says
    what the forward does that the graph does not repeat (a ``no_grad`` region, a
    buffer update: :mod:`ampfx.capture.semantics`); a capture with any is not used.
    ``python_state``: a forward (of the module or of a leaf) sets Python attributes,
    which torch.export does not repeat either (it puts them back after tracing).
    ``functions`` maps the qualified name of each function ``torch.fx.wrap`` kept whole in the graph
    (one opaque node, float32) to why it was not traced into (:mod:`ampfx.capture.tracer`); ``traced_into``
    names those whose body the graph holds instead.
    """

    graph: fx.Graph
    method: str
    leaves: dict[str, str] = field(default_factory=dict)
    fixed_args: dict[str, Any] = field(default_factory=dict)
    steps: tuple[str, ...] = ()
    why: str = ""
    constants: dict[str, Any] = field(default_factory=dict)  # export: get_attr targets that are not the model's
    notes: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    python_state: bool = False  # a module's forward sets Python attributes: torch.export would not repeat it either
    kept: tuple[str, ...] = ()  # leaves that keep_modules keeps as boundaries (each converted on its own)
    module: fx.GraphModule | None = None  # the graph module verification ran (over the captured module), reused
    #: (module path, attribute) of float attributes the graph reads at every call (ampfx.capture.lift)
    lifted: frozenset[tuple[str, str]] = frozenset()
    #: (module path, attribute) of the plain attributes the traced code read (torch.fx: ampfx.capture.lift)
    read: frozenset[tuple[str, str]] = frozenset()
    functions: dict[str, str] = field(default_factory=dict)
    traced_into: tuple[str, ...] = ()
    #: random draws the traced Python used in a way a graph cannot keep, one line each (ampfx.capture.draws):
    #: a capture with any is not used
    free_draws: tuple[str, ...] = ()
    #: (module path, buffer name, values) of the integer buffers the graph holds as constants (ampfx.capture.fold)
    folded: tuple[tuple[str, str, Any], ...] = ()


@dataclass(frozen=True)
class Uncaptured:
    """No rung captured the module's own ``forward``: it runs eagerly and its children are converted."""

    steps: tuple[str, ...]
