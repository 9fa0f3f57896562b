"""What the passes share: :class:`PassContext`, built once per graph and never changed."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..policy import Policy, Resolved


@dataclass(frozen=True)
class Ends:
    """What a kept module's own graph does at its boundary when handed float32 (its passes up to painting,
    run on a copy: :func:`ampfx.passes.boundary.ends`): ``reads``, the dtype it reads each float input in
    (``None``: in both, or as it is without computing); ``returns``, the dtype it computes each float
    output in. A caller paints its call from them (:func:`ampfx.passes.classify.classify`).

    >>> Ends(reads=(torch.bfloat16,), returns=(torch.bfloat16,)).only(torch.bfloat16)
    True
    >>> Ends(reads=(None,), returns=(torch.float32,)).only(torch.float32)
    False
    """

    reads: tuple[Any, ...] = ()
    returns: tuple[Any, ...] = ()
    autocast: tuple[tuple[torch.dtype, Any], ...] = ()
    """For reporting: the dtype ``torch.autocast`` gives its float outputs (one dtype, or ``"unknown"``) when
    it is handed its float inputs all in the first dtype (float32, the low dtype)."""

    def only(self, dtype: torch.dtype) -> bool:
        """Does the module read every float input and compute every float output in ``dtype``?"""
        ends = (*self.reads, *self.returns)
        return bool(ends) and all(d == dtype for d in ends)


@dataclass(frozen=True)
class Place:
    """Where a captured graph sits in the model, passed whole from the module tree to the passes.

    ``prefix`` is the module path of the converted part inside the user's model (``"encoder."``; ``""`` for the
    root). ``eager_leaves`` are its leaves that run their own Python with their children converted separately;
    ``leaf_facts`` maps the path of each other library's leaf module to what
    :func:`ampfx.libraries.leaf_facts` made of it on the example inputs (DGL's overflow guard reads its in-degree
    and feature sizes). ``arrive``: a kept module converted on its own, the dtype its float inputs arrive in and its
    outputs leave in; ``autocast_arrive``: the dtype ``torch.autocast`` would hand it its float inputs in
    (reporting); ``kept_ends``: what the graphs of the kept modules it calls do at their boundaries
    (:class:`Ends`). A child of a module that keeps its Python: its float inputs arrive in ``enter`` (other
    converted children hand them, only moved between), and with ``hands_on`` its float outputs leave in the dtype
    they are computed in.

    >>> Place("enc.").prefix, Place().arrive
    ('enc.', None)
    """

    prefix: str = ""
    eager_leaves: frozenset[str] = frozenset()
    leaf_facts: Mapping[str, Any] = field(default_factory=dict)
    arrive: Any = None
    autocast_arrive: Any = None
    kept_ends: Mapping[str, Ends] = field(default_factory=dict)
    enter: Any = None
    hands_on: bool = False


@dataclass(frozen=True)
class PassContext:
    """The policy, what it resolved to in the model, where the graph sits (:class:`Place`, whose fields read as
    the context's own: ``ctx.prefix``), and the facts about one conversion that no single node carries.

    ``leaves`` maps the path of each module traced as a leaf to why; ``kept`` maps each leaf ``keep_modules``
    keeps as a module boundary to why. ``symbols`` (a :class:`~ampfx.passes.shapes.Symbols`) is set when shapes
    were propagated from example inputs.

    >>> from ampfx import Policy
    >>> ctx = PassContext(Policy(), place=Place("enc."))
    >>> ctx.has_shapes, ctx.device, ctx.prefix
    (False, 'cpu', 'enc.')
    """

    policy: Policy
    resolved: Resolved = Resolved()
    device: str = "cpu"
    leaves: Mapping[str, str] = field(default_factory=dict)
    kept: Mapping[str, str] = field(default_factory=dict)
    symbols: Any = None
    place: Place = Place()

    prefix = property(lambda self: self.place.prefix)
    eager_leaves = property(lambda self: self.place.eager_leaves)
    leaf_facts = property(lambda self: self.place.leaf_facts)
    arrive = property(lambda self: self.place.arrive)
    autocast_arrive = property(lambda self: self.place.autocast_arrive)
    kept_ends = property(lambda self: self.place.kept_ends)
    enter = property(lambda self: self.place.enter)
    hands_on = property(lambda self: self.place.hands_on)

    def at(self, **where: Any) -> "PassContext":
        """This context with its place's fields ``where`` changed (``ctx.at(prefix="enc.")``)."""
        return dataclasses.replace(self, place=dataclasses.replace(self.place, **where))

    @property
    def keeps_output_dtype(self) -> bool:
        """Do this graph's outputs return in their original dtype (``Policy.keep_output_dtype``)? A kept
        module whose caller hands it low values (``arrive``) returns them low: its outputs' dtype is the
        boundary's; a child whose outputs other children take as they come (``hands_on``) returns them as
        computed."""
        low_boundary = self.arrive is not None and self.arrive != torch.float32
        return self.policy.keep_output_dtype and not low_boundary and not self.hands_on

    @property
    def has_shapes(self) -> bool:
        """Were shapes propagated from example inputs (``node.meta`` holds ``TENSOR_META``)?"""
        return self.symbols is not None
