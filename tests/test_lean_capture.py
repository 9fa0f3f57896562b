"""Capture details that cost a region its graph: containers across region boundaries, var-positional
forwards under torch.export.

- A converted module returns the containers its forward returned (an ``OrderedDict`` of feature
  maps, a namedtuple, an HF ``ModelOutput``-like dataclass, a ``dict`` or ``list`` subclass), so the
  next converted region, whose guard was built for the model's own value, takes it.
- A guard takes a ``dict`` where it was converted for an ``OrderedDict`` with the same keys in the
  same order (the graph reads it by key), and nothing else.
- ``forward(self, *xs)`` exports with dynamic sizes: ``dynamic_shapes`` follows the inputs bound to
  ``forward``'s signature (a tuple for ``*xs``, a dict for ``**kwargs``).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import io
from typing import Optional

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import ampfx
from ampfx.errors import GuardError
from tests.support.lean import against_autocast


# ---------------------------------------------------------------------------------------------------------------
# Cause: an OrderedDict of feature maps across a region boundary


class Backbone(nn.Module):
    """Feature maps at two strides, as torchvision's ``IntermediateLayerGetter`` returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> collections.OrderedDict:  # string annotations (this file's __future__)
        a = torch.relu(self.c1(x))
        return collections.OrderedDict([("0", a), ("1", torch.relu(self.c2(a)))])


class Head(nn.Module):
    """A head over every feature map, with a tensor its first forward makes and keeps (as an anchor
    generator caches its anchors): a forward before ``convert`` fills it."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Conv2d(8, 4, 1)
        self._scale: torch.Tensor | None = None

    def forward(self, feats: collections.OrderedDict) -> list[torch.Tensor]:
        if self._scale is None:
            self._scale = torch.full((4, 1, 1), 0.5)
        return [self.p(f) * self._scale for f in feats.values()]


class Detector(nn.Module):
    """Backbone then head, with data-dependent Python between them (a score threshold): neither
    torch.fx nor torch.export captures the root, so the two are converted as regions of their own."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone, self.head = Backbone(), Head()

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        feats = self.backbone(x)
        if feats["1"].amax().item() < -1e9:
            return []
        return self.head(feats)


def _detector() -> tuple[Detector, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Detector(), torch.randn(2, 3, 16, 16)
    model(x)  # normal use: a forward before convert fills the head's cache
    return model, x


@pytest.mark.parametrize("mode", ["train", "inference"])
def test_ordered_dict_of_feature_maps_crosses_region_boundary(mode: str) -> None:
    """A backbone region returning an OrderedDict feeds a head region converted for one, in both
    modes, after a forward before convert; the backbone's converted output is an OrderedDict."""
    model, x = _detector()
    amp = ampfx.convert(model, torch.bfloat16, (x,), mode=mode)
    assert type(amp.backbone(x)) is collections.OrderedDict
    if mode == "inference":
        with torch.no_grad():
            out = amp.eval()(x)
        ref = model.eval()(x)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        before = model.head.p.weight.detach().clone()
        out = amp(x)
        sum(o.float().square().mean() for o in out).backward()
        opt.step()
        assert not torch.equal(before, model.head.p.weight)
        out = amp(x)
        ref = model(x)
    assert type(out) is type(ref) and len(out) == len(ref)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.float(), r, atol=0.1, rtol=0.05)


def test_ordered_dict_detector_reports_every_gemm() -> None:
    """The OrderedDict backbone / head detector converts as regions and trains a step: every GEMM it
    runs is reported and runs low."""
    model, x = _detector()
    cost = against_autocast(model, (x,))
    assert cost.gemms_reported == cost.gemms_run == cost.gemms_low, cost


def test_ordered_dict_detector_no_worse_than_autocast(monkeypatch) -> None:
    """The OrderedDict backbone / head detector, converted as regions with hand_low (off by default:
    AMPFX_HAND_LOW=1): casts and bytes saved for backward no more than torch.autocast's. Pattern: the root's
    Python hands the backbone's feature maps to the head as they are and reads one's maximum (a selection,
    exact in bfloat16), so the backbone hands them on in bfloat16 and the head takes them so (before: 23 casts
    vs 15, 39556 vs 25218 saved bytes)."""
    monkeypatch.setenv("AMPFX_HAND_LOW", "1")
    model, x = _detector()
    cost = against_autocast(model, (x,))
    assert cost.casts <= cost.casts_autocast, cost
    assert cost.saved <= cost.saved_autocast, cost


def test_guard_takes_dict_for_ordered_dict_with_same_keys_in_order() -> None:
    """The head's guard (converted for an OrderedDict) takes a dict with the same keys in the same order; other
    keys or another order are outside what it was converted for (a forward iterating ``.values()`` would pair them
    otherwise): the head, a module the model's Python calls, is converted again for them, never run as it is."""
    model, x = _detector()
    amp = ampfx.convert(model, torch.bfloat16, (x,))
    feats = model.backbone(x)
    want = amp.head(feats)
    got = amp.head(dict(feats))
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b)
    assert amp.head.variants() == []
    for other in ({"1": feats["1"], "0": feats["0"]}, {"0": feats["0"], "2": feats["1"]}):
        out, ref = amp.head(other), model.head(other)
        assert [o.shape for o in out] == [r.shape for r in ref]
        for o, r in zip(out, ref):
            torch.testing.assert_close(o.float(), r, atol=0.05, rtol=0.05)
    assert len(amp.head.variants()) == 2


# ---------------------------------------------------------------------------------------------------------------
# Cause: every container kind keeps its type


Pair = collections.namedtuple("Pair", "a b")


class TagDict(dict):
    """A dict subclass torch.utils._pytree does not know."""


class TagList(list):
    """A list subclass torch.utils._pytree does not know."""


class Features(collections.OrderedDict):
    """A dict subclass registered with torch.utils._pytree."""


pytree.register_pytree_node(Features, lambda d: (list(d.values()), list(d.keys())),
                            lambda values, keys: Features(zip(keys, values)))


@dataclasses.dataclass
class ModelOutputLike(collections.OrderedDict):
    """An HF ``ModelOutput``-like output: a dataclass that is an OrderedDict of its set fields."""

    logits: Optional[torch.Tensor] = None
    hidden: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not None:
                self[f.name] = getattr(self, f.name)


pytree.register_pytree_node(ModelOutputLike, lambda d: (list(d.values()), list(d.keys())),
                            lambda values, keys: ModelOutputLike(**dict(zip(keys, values))))

CONTAINERS = {
    "OrderedDict": lambda a, b: collections.OrderedDict(a=a, b=b),
    "namedtuple": lambda a, b: Pair(a, b),
    "tuple": lambda a, b: (a, b),
    "list": lambda a, b: [a, b],
    "dict": lambda a, b: {"a": a, "b": b},
    "nested": lambda a, b: {"x": collections.OrderedDict(a=a), "y": [Pair(a, b)], "z": (b,)},
    "registered dict subclass": lambda a, b: Features(a=a, b=b),
    "ModelOutput-like": lambda a, b: ModelOutputLike(logits=a, hidden=b),
    "unregistered dict subclass": lambda a, b: TagDict(a=a, b=b),
    "unregistered list subclass": lambda a, b: TagList([a, b]),
}


class Returns(nn.Module):
    def __init__(self, make) -> None:  # noqa: ANN001
        super().__init__()
        self.lin, self.make = nn.Linear(4, 4), make

    def forward(self, x: torch.Tensor):  # noqa: ANN201
        h = self.lin(x)
        return self.make(h.relu(), h.sigmoid())


def _structure(value):  # noqa: ANN001, ANN202
    """Every container's type, all the way down (a pytree spec stops at types it does not know)."""
    if isinstance(value, dict):
        return type(value), [(k, _structure(v)) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return type(value), [_structure(v) for v in value]
    return type(value)


def _tensors(value):  # noqa: ANN001, ANN202
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return [value]


@pytest.mark.parametrize("tracer", ["fx", "export", "auto"])
@pytest.mark.parametrize("kind", list(CONTAINERS))
def test_converted_output_keeps_container_types(kind: str, tracer: str) -> None:
    """``type(out)`` (and every container inside) is the original's, whichever front-end captured it."""
    torch.manual_seed(0)
    model, x = Returns(CONTAINERS[kind]), torch.randn(2, 4)
    amp = ampfx.convert(model, torch.bfloat16, (x,), tracer=tracer)
    out, ref = amp(x), model(x)
    assert type(out) is type(ref)
    assert _structure(out) == _structure(ref)
    for a, b in zip(_tensors(out), _tensors(ref)):
        torch.testing.assert_close(a.float(), b, atol=0.05, rtol=0.05)


def test_ordered_dict_output_survives_copy_and_pickle() -> None:
    """A copy and a pickled and loaded converted module still return the OrderedDict; the forward's string
    annotations (``from __future__ import annotations``) do not stop the pickle (torch.fx's own graph
    module of it does not pickle: its code names them as globals)."""
    torch.manual_seed(0)
    model, x = Backbone(), torch.randn(1, 3, 8, 8)
    amp = ampfx.convert(model, torch.bfloat16, (x,), tracer="fx")
    assert type(amp(x)) is collections.OrderedDict
    assert type(copy.deepcopy(amp)(x)) is collections.OrderedDict
    buf = io.BytesIO()
    torch.save(amp, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    out = loaded(x)
    assert type(out) is collections.OrderedDict and list(out) == ["0", "1"]
    torch.testing.assert_close(out["1"], amp(x)["1"])


# ---------------------------------------------------------------------------------------------------------------
# Cause: torch.export of a var-positional forward


class Concat(nn.Module):
    """``forward(self, *xs)``, with Python on ``len(xs)`` that torch.fx cannot trace: torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        h = torch.cat(xs, -1) if len(xs) > 1 else xs[0]
        return self.lin(h).relu()


def _export_step(amp: nn.Module) -> str:
    return next(s for s in amp.ampfx_report.parts[0].steps if s.startswith("exported"))


def test_var_positional_forward_exports_with_dynamic_sizes() -> None:
    """The export's ``dynamic_shapes`` gives ``*xs`` one tuple entry: dynamic sizes, and another batch
    size runs with no conversion made again and no GuardError."""
    torch.manual_seed(0)
    model = Concat()
    amp = ampfx.convert(model, torch.bfloat16, (torch.randn(4, 4), torch.randn(4, 4)))
    region = amp.ampfx_report.parts[0]
    assert region.method == "export"
    assert "dynamic sizes" in _export_step(amp), region.steps
    assert not any("static" in s or "dynamic_shapes" in s for s in region.steps), region.steps
    a, b = torch.randn(6, 4), torch.randn(6, 4)
    torch.testing.assert_close(amp(a, b).float(), model(a, b), atol=0.05, rtol=0.05)
    assert amp.variants() == []


class Signature(nn.Module):
    """Positional, var-positional, keyword-only with defaults, and var-keyword parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, *xs, scale=2.0, mask=None, **extra):  # noqa: ANN001, ANN003, ANN201
        y = self.lin(x) * scale
        for t in xs:
            y = y + t
        if mask is not None:
            y = y * mask
        for v in extra.values():
            y = y + v
        return y


@pytest.mark.parametrize("args, kwargs", [
    ((4, 4, 4), {"mask": 4, "bias": 4}),
    ((4,), {"scale": 3.0, "bias": 4}),
    ((), {"x": 4, "mask": 4}),
    ((4, 4), {}),
], ids=["var-positional and var-keyword", "keyword-only and var-keyword", "keywords only", "var-positional"])
def test_export_dynamic_shapes_follow_the_signature(args: tuple, kwargs: dict) -> None:
    """``*args``, ``**kwargs``, keyword-only arguments and defaults: the export is dynamic, and a call at
    another batch size runs without GuardError."""
    torch.manual_seed(0)

    def make(n: int, spec: tuple, named: dict) -> tuple[tuple, dict]:
        return (tuple(torch.randn(n, 3) for _ in spec),
                {k: (torch.randn(n, 3) if isinstance(v, int) else v) for k, v in named.items()})

    model = Signature()
    ex_args, ex_kwargs = make(4, args, kwargs)
    amp = ampfx.convert(model, torch.bfloat16, ampfx.inputs.ExampleInputs(ex_args, ex_kwargs), tracer="export")
    assert "dynamic sizes" in _export_step(amp), amp.ampfx_report.parts[0].steps
    call_args, call_kwargs = make(7, args, kwargs)
    torch.testing.assert_close(amp(*call_args, **call_kwargs).float(), model(*call_args, **call_kwargs),
                               atol=0.05, rtol=0.05)
