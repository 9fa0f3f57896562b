"""Seeded random graphs for fuzzing ``ampfx.convert`` (tests/test_fuzz.py, benchmarks/fuzz.py).

:func:`generate` turns a seed into a :class:`Case`: the Python source of a small
``nn.Module`` whose ``forward`` walks a random DAG of 5-30 steps over GEMMs,
convolutions, norms, reductions, softmax, elementwise ops, views, concatenation,
embedding, pooling and dropout, with random ``convert`` options (``Policy`` fields
including ``pad``, ``dynamic_dims``, the tracer, the training mode at conversion) and
a low dtype. The source is plain Python that ``torch.fx`` traces, and it is what a
failure message shows. Inputs are ``x`` (batch, seq, feature), ``img`` (batch, C, 8, 8)
and ``tok`` (batch, seq) integer tokens; every op keeps batch and seq generic, so the
same model runs at other sizes.

>>> case = generate(3)
>>> model = case.model()
>>> out = model(*case.inputs(case.batch, case.seq))
>>> case.seed, isinstance(out, (torch.Tensor, tuple))
(3, True)
>>> generate(3).source == case.source
True
"""
from __future__ import annotations

import inspect
import math
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

FEATS = (4, 6, 8, 12, 16)
"""Feature widths: multiples of 8 and not, so padding has work."""
VOCAB = 11
POSITIONS = 32
IMG_HW = 8


@dataclass(frozen=True)
class Value:
    """A tensor the forward has computed: its variable name and what it holds.

    ``kind``: ``"seq"`` (batch, len, feat), ``"img"`` (batch, feat, hw, hw), ``"vec"``
    (batch, feat) or ``"tok"`` (batch, len) integers; ``length`` names the sequence
    length of a ``seq``/``tok`` value (``"S"``, ``"2S"`` after a concatenation along it,
    ``"HW"`` for an image's pixels), so only values of one length are combined.
    """

    name: str
    kind: str
    feat: int = 0
    hw: int = 0
    length: str = "S"


@dataclass
class _Builder:
    """The source being written: ``__init__`` lines, ``forward`` lines, the values so far."""

    rng: random.Random
    init: list[str] = field(default_factory=list)
    body: list[str] = field(default_factory=list)
    values: list[Value] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    used_ops: list[str] = field(default_factory=list)
    consumed: set[str] = field(default_factory=set)

    def module(self, expr: str) -> str:
        name = f"m{len(self.modules)}"
        self.modules.append(name)
        self.init.append(f"self.{name} = {expr}")
        return f"self.{name}"

    def emit(self, expr: str, kind: str, feat: int = 0, hw: int = 0, length: str = "S") -> Value:
        self.consumed.update(re.findall(r"\b(v\d+)\b", expr))
        v = Value(f"v{len(self.values)}", kind, feat, hw, length)
        self.body.append(f"{v.name} = {expr}")
        self.values.append(v)
        return v

    def pick(self, ok: Callable[[Value], bool]) -> Value | None:
        """A value ``ok`` accepts, recent ones likelier (deep chains, with branches)."""
        cands = [v for v in self.values if ok(v)]
        if not cands:
            return None
        weights = [1.0 + 3.0 * i / len(cands) for i in range(len(cands))]
        return self.rng.choices(cands, weights)[0]

    def feat(self) -> int:
        return self.rng.choice(FEATS)


def _seq(v: Value) -> bool:
    return v.kind == "seq"


def _same_seq(a: Value) -> Callable[[Value], bool]:
    return lambda v: v.kind == "seq" and v.length == a.length


# ----------------------------------------------------------------------------- ops on sequences
def op_linear(b: _Builder, v: Value) -> Value:
    n = b.feat()
    bias = b.rng.random() < 0.8
    return b.emit(f"{b.module(f'nn.Linear({v.feat}, {n}, bias={bias})')}({v.name})", v.kind, n, length=v.length)


def op_conv1d(b: _Builder, v: Value) -> Value:
    n, k = b.feat(), b.rng.choice((1, 3))
    m = b.module(f"nn.Conv1d({v.feat}, {n}, {k}, padding={k // 2})")
    return b.emit(f"{m}({v.name}.transpose(1, 2)).transpose(1, 2)", "seq", n, length=v.length)


def op_norm(b: _Builder, v: Value) -> Value:
    choice = b.rng.choice(("layer", "rms", "normalize", "batch"))
    if choice == "layer":
        expr = f"{b.module(f'nn.LayerNorm({v.feat})')}({v.name})"
    elif choice == "rms":
        expr = f"{b.module(f'nn.RMSNorm({v.feat})')}({v.name})"
    elif choice == "normalize":
        expr = f"F.normalize({v.name}, dim=-1)"
    else:
        expr = f"{b.module(f'nn.BatchNorm1d({v.feat})')}({v.name}.transpose(1, 2)).transpose(1, 2)"
    return b.emit(expr, "seq", v.feat, length=v.length)


def op_softmax(b: _Builder, v: Value) -> Value:
    fn = b.rng.choice(("torch.softmax({}, -1)", "F.log_softmax({}, dim=-1)", "{}.softmax(dim=1)"))
    return b.emit(fn.format(v.name), v.kind, v.feat, length=v.length)


UNARY = ("F.gelu({})", "torch.relu({})", "F.silu({})", "torch.tanh({})", "torch.sigmoid({})", "torch.exp({})",
         "{}.clamp(-3.0, 3.0)", "{} * {c} + {d}", "F.dropout({}, {p}, self.training)", "torch.abs({}) + 1.0",
         "torch.sqrt(torch.abs({}) + 1e-3)", "torch.cumsum({}, 1)", "{}.pow(2)")


def op_unary(b: _Builder, v: Value) -> Value:
    fn = b.rng.choice(UNARY if v.kind == "seq" else UNARY[:-2])
    expr = fn.format(v.name, c=b.rng.choice((0.5, 2.0, 1e-2, 30.0)), d=b.rng.choice((0.0, 1.0, -0.25)),
                     p=b.rng.choice((0.1, 0.5)))
    return b.emit(expr, v.kind, v.feat, v.hw, v.length)


def op_dropout(b: _Builder, v: Value) -> Value:
    return b.emit(f"{b.module(f'nn.Dropout({b.rng.choice((0.1, 0.3))})')}({v.name})", v.kind, v.feat, v.hw,
                  v.length)


def op_reduce_keep(b: _Builder, v: Value) -> Value:
    fn = b.rng.choice(("{0} - {0}.mean(-1, keepdim=True)", "{0} / ({0}.norm(dim=-1, keepdim=True) + 1e-3)",
                       "{0} * {0}.sum(-1, keepdim=True)", "torch.logsumexp({0}, -1, keepdim=True) - {0}",
                       "{0} / ({0}.var(-1, keepdim=True) + 1e-2).sqrt()", "{0} - {0}.amax(-1, keepdim=True)",
                       "{0} * {0}.std(1, keepdim=True)"))
    return b.emit(fn.format(v.name), "seq", v.feat, length=v.length)


def op_reduce_seq(b: _Builder, v: Value) -> Value:
    fn = b.rng.choice(("{}.mean(1)", "{}.sum(1)", "{}.amax(1)", "F.adaptive_max_pool1d({}.transpose(1, 2), 1)"
                       ".squeeze(-1)", "torch.logsumexp({}, 1)"))
    return b.emit(fn.format(v.name), "vec", v.feat)


def op_attention(b: _Builder, v: Value) -> Value:
    k = b.pick(lambda u: _same_seq(v)(u) and u.feat == v.feat) or v
    val = b.pick(_same_seq(v)) or v
    choice = b.rng.random()
    if choice < 0.4:
        expr = f"F.scaled_dot_product_attention({v.name}, {k.name}, {val.name})"
    elif choice < 0.55:
        expr = f"torch.einsum('bsd,btd->bst', {v.name}, {k.name}).softmax(-1).bmm({val.name})"
    else:
        scale = 1.0 / math.sqrt(v.feat)
        expr = f"torch.softmax({v.name} @ {k.name}.transpose(1, 2) * {scale:.4f}, dim=-1) @ {val.name}"
    return b.emit(expr, "seq", val.feat, length=v.length)


def op_heads(b: _Builder, v: Value) -> Value:
    """Two-head attention with reshapes: view -> transpose -> matmul -> softmax -> matmul -> back."""
    if v.feat % 2:
        return op_linear(b, v)
    h = f"{v.name}.reshape({v.name}.shape[0], {v.name}.shape[1], 2, -1).transpose(1, 2)"
    b.body.append(f"h_{v.name} = {h}")
    att = f"torch.matmul(h_{v.name}, h_{v.name}.transpose(-1, -2)).softmax(-1)"
    expr = f"torch.matmul({att}, h_{v.name}).transpose(1, 2).reshape({v.name}.shape[0], {v.name}.shape[1], -1)"
    return b.emit(expr, "seq", v.feat, length=v.length)


def op_view(b: _Builder, v: Value) -> Value:
    n = v.name
    fn = b.rng.choice((f"{n}.transpose(1, 2).contiguous().transpose(1, 2)", f"{n}.unsqueeze(2).squeeze(2)",
                       f"{n}.permute(1, 0, 2).permute(1, 0, 2)", f"{n}.flatten(0, 1).view_as({n})",
                       f"{n}[:, :, :{max(1, v.feat // 2)}]", f"{n}.chunk(2, -1)[0]",
                       f"{n}.reshape({n}.shape[0], -1).reshape({n}.shape)"))
    feat = v.feat // 2 if ":, :, :" in fn else (v.feat + 1) // 2 if "chunk" in fn else v.feat
    return b.emit(fn, "seq", max(1, feat), length=v.length)


def op_cat(b: _Builder, v: Value) -> Value:
    w = b.pick(_same_seq(v)) or v
    if v.length == "S" and w.feat == v.feat and b.rng.random() < 0.3:
        return b.emit(f"torch.cat([{v.name}, {w.name}], dim=1)", "seq", v.feat, length="2S")
    if w.feat == v.feat and b.rng.random() < 0.3:
        return b.emit(f"torch.stack([{v.name}, {w.name}], 0).sum(0)", "seq", v.feat, length=v.length)
    return b.emit(f"torch.cat([{v.name}, {w.name}], -1)", "seq", v.feat + w.feat, length=v.length)


def op_binary(b: _Builder, v: Value) -> Value:
    w = b.pick(lambda u: u.kind == v.kind and u.feat == v.feat and u.hw == v.hw and u.length == v.length)
    if w is None or w is v:
        return op_linear(b, v) if v.kind != "img" else op_conv2d(b, v)
    fn = b.rng.choice(("{} + {}", "{} * {}", "{} - {}", "torch.where({0} > 0, {0}, 0.1 * {0}) + {1}",
                       "torch.maximum({}, {})"))
    return b.emit(fn.format(v.name, w.name), v.kind, v.feat, v.hw, v.length)


def op_broadcast(b: _Builder, v: Value) -> Value:
    """A per-example vector added to every position: ``seq + vec.unsqueeze(1)``."""
    w = b.pick(lambda u: u.kind == "vec")
    if w is None:
        return op_reduce_seq(b, v)
    if w.feat != v.feat:
        w = b.emit(f"{b.module(f'nn.Linear({w.feat}, {v.feat})')}({w.name})", "vec", v.feat)
    return b.emit(f"{v.name} + {w.name}.unsqueeze(1)", "seq", v.feat, length=v.length)


def op_embedding(b: _Builder, v: Value) -> Value:
    t = b.pick(lambda u: u.kind == "tok")
    if v.length == "HW":
        return op_norm(b, v)
    if t is None or v.length != t.length:  # positions index the table (argmax would be discontinuous)
        m = b.module(f"nn.Embedding({POSITIONS}, {v.feat})")
        return b.emit(f"{v.name} + {m}(torch.arange({v.name}.shape[1], device={v.name}.device))", "seq", v.feat,
                      length=v.length)
    m = b.module(f"nn.Embedding({VOCAB}, {v.feat})")
    if b.rng.random() < 0.3:
        return b.emit(f"({v.name} + {m}({t.name})).masked_fill(({t.name} == 0).unsqueeze(-1), 0.0)", "seq",
                      v.feat, length=v.length)
    return b.emit(f"{v.name} + {m}({t.name})", "seq", v.feat, length=v.length)


def op_pool_feat(b: _Builder, v: Value) -> Value:
    if v.feat % 2:
        return op_norm(b, v)
    fn = b.rng.choice(("F.avg_pool1d({}, 2)", "F.max_pool1d({}, 2)"))
    return b.emit(fn.format(v.name), "seq", v.feat // 2, length=v.length)


def op_inplace(b: _Builder, v: Value) -> Value:
    """In-place ops on a copy (rule ``inplace``), and explicit casts written in the model."""
    fn = b.rng.choice(("{0}.clone().mul_({c})", "F.relu({0}.clone(), inplace=True)", "{0}.clone().add_({0})",
                       "F.softmax({0}.float(), dim=-1).type_as({0})", "{0}.to(torch.float32).tanh()"))
    return b.emit(fn.format(v.name, c=b.rng.choice((0.5, 3.0))), v.kind, v.feat, v.hw, v.length)


def op_topk(b: _Builder, v: Value) -> Value:
    """The ``k`` largest features. Its input is detached: the gradient of a selection goes to the
    elements chosen, and rounding to the low dtype can turn near-ties into ties and choose others
    (fuzz seed 50 of an earlier generator: outputs within 0.3%, gradients 50% off, autocast alike
    wherever its topk input is low too), a property of the selection, not of the conversion."""
    k = max(1, v.feat // 2)
    return b.emit(f"torch.topk({v.name}.detach(), {k}, dim=-1).values", "seq", k, length=v.length)


# ----------------------------------------------------------------------------- images and vectors
def op_conv2d(b: _Builder, v: Value) -> Value:
    n, k = b.feat(), b.rng.choice((1, 3))
    return b.emit(f"{b.module(f'nn.Conv2d({v.feat}, {n}, {k}, padding={k // 2})')}({v.name})", "img", n, v.hw)


def op_img_norm(b: _Builder, v: Value) -> Value:
    groups = b.rng.choice([g for g in (1, 2) if v.feat % g == 0])
    expr = b.rng.choice((f"nn.BatchNorm2d({v.feat})", f"nn.GroupNorm({groups}, {v.feat})",
                         f"nn.InstanceNorm2d({v.feat}, affine=True)"))
    return b.emit(f"{b.module(expr)}({v.name})", "img", v.feat, v.hw)


def op_img_pool(b: _Builder, v: Value) -> Value:
    if v.hw < 4:
        return b.emit(f"F.interpolate({v.name}, scale_factor=2.0, mode='nearest')", "img", v.feat, v.hw * 2)
    fn = b.rng.choice(("F.max_pool2d({}, 2)", "F.avg_pool2d({}, 2)", "{m}({})"))
    m = b.module("nn.MaxPool2d(2)") if "{m}" in fn else ""
    return b.emit(fn.format(v.name, m=m), "img", v.feat, v.hw // 2)


def op_img_out(b: _Builder, v: Value) -> Value:
    choice = b.rng.choice(("mean", "adaptive", "flatten", "tokens"))
    if choice == "tokens":  # patches as a sequence, ViT-style
        return b.emit(f"{v.name}.flatten(2).transpose(1, 2)", "seq", v.feat, length="HW")
    if choice == "flatten":
        return b.emit(f"{v.name}.flatten(1)", "vec", v.feat * v.hw * v.hw)
    expr = f"{v.name}.mean((2, 3))" if choice == "mean" else f"F.adaptive_avg_pool2d({v.name}, 1).flatten(1)"
    return b.emit(expr, "vec", v.feat)


def op_vec(b: _Builder, v: Value) -> Value:
    choice = b.rng.choice(("linear", "norm", "softmax", "unary"))
    if choice == "linear":
        n = b.feat()
        return b.emit(f"{b.module(f'nn.Linear({v.feat}, {n})')}({v.name})", "vec", n)
    if choice == "norm":
        return b.emit(f"{b.module(f'nn.LayerNorm({v.feat})')}({v.name})", "vec", v.feat)
    if choice == "softmax":
        return op_softmax(b, v)
    return op_unary(b, v)


SEQ_OPS: dict[str, tuple[Callable[[_Builder, Value], Value], float]] = {
    "linear": (op_linear, 4), "conv1d": (op_conv1d, 1), "norm": (op_norm, 2), "softmax": (op_softmax, 1),
    "unary": (op_unary, 4), "dropout": (op_dropout, 0.5), "reduce_keep": (op_reduce_keep, 1.5),
    "reduce_seq": (op_reduce_seq, 0.7), "attention": (op_attention, 1), "heads": (op_heads, 0.7),
    "view": (op_view, 1.5), "cat": (op_cat, 1), "binary": (op_binary, 2), "broadcast": (op_broadcast, 0.7),
    "embedding": (op_embedding, 0.7), "pool_feat": (op_pool_feat, 0.5), "topk": (op_topk, 0.3),
    "inplace": (op_inplace, 0.5),
}
"""Ops on a (batch, seq, feat) value: (function, weight)."""
IMG_OPS: dict[str, tuple[Callable[[_Builder, Value], Value], float]] = {
    "conv2d": (op_conv2d, 3), "img_norm": (op_img_norm, 2), "unary": (op_unary, 1.5), "img_pool": (op_img_pool, 1),
    "binary": (op_binary, 1), "img_out": (op_img_out, 1.5), "dropout": (op_dropout, 0.3), "inplace": (op_inplace, 0.3),
}
VEC_OPS: dict[str, tuple[Callable[[_Builder, Value], Value], float]] = {"vec": (op_vec, 1), "binary": (op_binary, 0.3)}
KIND_OPS = {"seq": SEQ_OPS, "img": IMG_OPS, "vec": VEC_OPS}


# ----------------------------------------------------------------------------- the case
@dataclass(frozen=True)
class Case:
    """One fuzz case: a model's source, its inputs, and how to convert it.

    ``options`` are the keyword arguments of ``ampfx.convert`` besides the model,
    dtype and example inputs (Policy fields, ``dynamic_dims``, ``tracer``);
    ``train`` is the model's mode when it is converted.
    """

    seed: int
    dtype: torch.dtype
    source: str
    steps: int
    ops: tuple[str, ...]
    options: dict[str, Any]
    train: bool
    has_img: bool
    has_tok: bool
    batch: int = 3
    seq: int = 5

    def model(self) -> nn.Module:
        """A fresh model, its parameters drawn from the seed (non-trivial norm affines and BN statistics)."""
        namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F}
        exec(compile(self.source, f"<fuzz seed {self.seed}>", "exec"), namespace)  # noqa: S102 - our own source
        gen = torch.Generator().manual_seed(self.seed)
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            model = namespace["FuzzNet"]()
        with torch.no_grad():
            for name, t in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(("norm.weight", "running_var")) or (t.dim() == 1 and "weight" in name):
                    t.copy_(1.0 + 0.2 * torch.rand(t.shape, generator=gen))
                elif t.is_floating_point() and t.dim() == 1:
                    t.copy_(0.1 * torch.randn(t.shape, generator=gen))
        return model.train(self.train)

    def inputs(self, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """``(x, img, tok)`` (the ones the model takes) at ``batch`` x ``seq``, drawn from ``seed``."""
        gen = torch.Generator().manual_seed(1000 * self.seed + seed)
        xs = [torch.randn(batch, seq, FEATS_IN, generator=gen)]
        if self.has_img:
            xs.append(torch.randn(batch, IMG_C, IMG_HW, IMG_HW, generator=gen))
        if self.has_tok:
            xs.append(torch.randint(0, VOCAB, (batch, seq), generator=gen))
        return tuple(xs)

    def describe(self) -> str:
        """What a failure message shows: seed, dtype, options and the source."""
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return (f"fuzz seed {self.seed}: dtype={self.dtype}, {'train' if self.train else 'eval'} mode, "
                f"ampfx.convert(model, dtype, example_inputs, {opts})\n{self.source}")


FEATS_IN = 8
IMG_C = 3


def _body(b: _Builder, steps: int) -> None:
    """``steps`` random ops; the last value (and sometimes another) is the output."""
    for _ in range(steps):
        v = b.pick(lambda u: u.kind != "tok")
        table = KIND_OPS[v.kind]
        names = list(table)
        name = b.rng.choices(names, [table[n][1] for n in names])[0]
        b.used_ops.append(name)
        table[name][0](b, v)


def _source(b: _Builder, inputs: list[str]) -> str:
    """The module's source; it returns the last value and up to three other values nothing consumed
    (so most ops reach an output and a loss)."""
    sinks = [v.name for v in b.values[:-1] if v.name.startswith("v") and v.name not in b.consumed]
    out = ", ".join([b.values[-1].name, *sinks[-3:]])
    lines = ["class FuzzNet(nn.Module):", "    def __init__(self):", "        super().__init__()"]
    lines += [f"        {line}" for line in b.init] or ["        pass"]
    lines += [f"    def forward(self, {', '.join(inputs)}):"]
    lines += [f"        {line}" for line in b.body] + [f"        return {out}", ""]
    return "\n".join(lines)


def _options(rng: random.Random, modules: list[str], tracer: str) -> dict[str, Any]:
    """Random ``convert`` options: Policy fields, ``dynamic_dims``, the tracer."""
    opts: dict[str, Any] = {}
    opts["pad"] = rng.choice(("auto", "never", "always"))
    if opts["pad"] == "always" and rng.random() < 0.3:
        opts["pad_multiple"] = rng.choice((4, 16))
    dyn = rng.choices((None, {0: "batch"}, {0: "batch", 1: "seq"}, {1: "seq"}), (6, 1, 2, 1))[0]
    if dyn:
        opts["dynamic_dims"] = dyn
    if rng.random() < 0.3:
        opts["reduction_threshold"] = rng.choice((4, 16, 64))
    if rng.random() < 0.15:
        opts["keep_output_dtype"] = False
    if rng.random() < 0.2:
        opts.update(rng.choice(EDITS))
    if modules and rng.random() < 0.15:
        opts["fp32_modules"] = (rng.choice(modules),)
    if rng.random() < 0.1:
        opts["probe"] = False
    opts["tracer"] = tracer
    return opts


TRACERS = {"auto": (30, 0.6), "fx": (30, 0.28), "export": (12, 0.12)}
"""tracer -> (most steps, weight). torch.export takes seconds per graph (once per training mode),
growing with its size: exported cases are fewer and smaller, so 200 cases fit CI's time."""

EDITS = (
    {"denylist_add": ("gelu",), "inferlist_remove": ("gelu",)},
    {"allowlist_add": ("softmax",), "denylist_remove": ("softmax",)},
    {"denylist_add": ("layer_norm",), "inferlist_remove": ("layer_norm",)},
    {"inferlist_add": ("exp",), "denylist_remove": ("exp",)},
    {"denylist_add": ("linear",), "allowlist_remove": ("linear",)},
    {"clearlist_add": ("tanh",), "inferlist_remove": ("tanh",)},
)
"""List edits (each a valid ADD + REMOVE pair) a case may carry."""


def generate(seed: int) -> Case:
    """The case of ``seed``: the same source, inputs and options every time."""
    rng = random.Random(seed)
    b = _Builder(rng)
    has_img, has_tok = rng.random() < 0.35, rng.random() < 0.35
    inputs = ["x"] + ["img"] * has_img + ["tok"] * has_tok
    b.values.append(Value("x", "seq", FEATS_IN))
    if has_img:
        b.values.append(Value("img", "img", IMG_C, IMG_HW))
    if has_tok:
        b.values.append(Value("tok", "tok", 0))
    tracer = rng.choices(list(TRACERS), [w for _, w in TRACERS.values()])[0]
    steps = rng.randint(5, TRACERS[tracer][0])
    _body(b, steps)
    if b.values[-1].kind == "tok":  # pragma: no cover - ops never end on tokens
        raise AssertionError("a case ended on tokens")
    train = rng.random() < 0.5
    dtype = rng.choice((torch.bfloat16, torch.float16))
    return Case(seed=seed, dtype=dtype, source=_source(b, inputs), steps=steps, ops=tuple(b.used_ops),
                options=_options(rng, b.modules, tracer), train=train, has_img=has_img, has_tok=has_tok)


# ----------------------------------------------------------------------------- the checks
FACTOR = 4.0
"""ampfx's error against float32 may be at most FACTOR x autocast's on the same graph ..."""
FLOOR = {torch.bfloat16: 2.0 ** -6, torch.float16: 2.0 ** -9}
"""... plus this relative floor (two roundings of the dtype's unit): where autocast is exact
(a graph it runs in float32) ampfx may still round once or twice."""
OTHER_BATCH, OTHER_SEQ = 5, 8


@dataclass(frozen=True)
class Failure:
    """One failed check of one case: ``check`` names the check, ``kind`` the class of failure
    (the exception type, or what differed), ``detail`` the evidence."""

    check: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"[{self.check}] {self.kind}: {self.detail}"


@dataclass(frozen=True)
class Outcome:
    """What :func:`run_case` found: the failures, and the counts of what passed."""

    case: Case
    failures: tuple[Failure, ...]
    passed: tuple[str, ...]
    refused: tuple[str, ...] = ()
    ratios: tuple[tuple[str, float, float], ...] = ()

    def message(self) -> str:
        return "\n".join([*(str(f) for f in self.failures), self.case.describe()])


def _floats(out: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def rel_error(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """``||got - ref|| / ||ref||`` over the positions where both are finite (non-finite positions are
    the finiteness check's business)."""
    num = den = 0.0
    for g, r in zip(got, ref):
        g, r = g.detach().double(), r.detach().double()
        ok = torch.isfinite(r) & torch.isfinite(g)
        num += float(((g - r)[ok] ** 2).sum())
        den += float((r[ok] ** 2).sum())
    return math.sqrt(num) / max(math.sqrt(den), 1e-12)


def nonfinite_where_finite(got: list[torch.Tensor], ref: list[torch.Tensor]) -> int:
    """How many positions are finite in ``ref`` and not in ``got``."""
    return sum(int((torch.isfinite(r) & ~torch.isfinite(g)).sum()) for g, r in zip(got, ref))


def is_ampfx_error(e: BaseException) -> bool:
    """A clear refusal: an exception whose class lives in the ampfx package, with a message."""
    return type(e).__module__.split(".")[0] == "ampfx" and bool(str(e).strip())


def graph_modules(amp: nn.Module) -> list[torch.fx.GraphModule]:
    """Every converted graph in ``amp``: the graph modules of its tree and their other-mode graphs."""
    out = []
    for m in amp.modules():
        if isinstance(m, torch.fx.GraphModule):
            out.append(m)
            rt = m.__dict__.get("_ampfx_runtime")
            alt = rt.alt if rt is not None else None
            other = m.mode_module(alt[0]) if alt is not None else None  # made now if not yet
            if isinstance(other, torch.fx.GraphModule):
                out.append(other)
    return out


class _Recorder(torch.fx.Interpreter):
    """Runs a converted graph node by node and notes every node whose output dtype is not what
    its record says: a cast's ``to``, a decision's ``out`` (the value it produces) and, for a
    node that computes on float data, its ``dtype``."""

    def __init__(self, gm: torch.fx.GraphModule, sink: list[str]) -> None:
        super().__init__(gm)
        self.sink = sink

    def run_node(self, n: torch.fx.Node) -> Any:
        from ampfx import meta
        from ampfx.ops import Category
        from ampfx.report.records import COMPUTE, CastInfo, Decision

        out = super().run_node(n)
        r, floats = meta.record(n), _floats(out)
        if r is None or not floats:
            return out
        got = floats[0].dtype
        want = r.to if isinstance(r, CastInfo) else r.out
        if isinstance(want, torch.dtype) and got != want:
            self.sink.append(f"{n.name} ({getattr(r, 'op', 'cast')}): the report says it produces {want}, it "
                             f"produced {got}")
        if (isinstance(r, Decision) and r.kind in COMPUTE and r.category is not Category.PASS
                and isinstance(r.dtype, torch.dtype) and got != r.dtype
                and r.rule != "cost:write-low"):  # computes in float32 inside a kernel that writes low
            self.sink.append(f"{n.name} ({r.op}): the report says it computes in {r.dtype}, it produced {got}")
        return out


def recorded_call(amp: nn.Module, inputs: tuple, sink: list[str]) -> Any:
    """``amp(*inputs)`` with every converted graph run by :class:`_Recorder` (the graph of the
    module's current mode)."""
    patched = []

    def make(m: torch.fx.GraphModule) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            g = m.mode_module(m.training)
            if not isinstance(g, torch.fx.GraphModule):
                return g(*args, **kwargs)
            if kwargs:
                bound = inspect.signature(type(g).forward).bind(g, *args, **kwargs)
                args = tuple(bound.arguments.values())[1:]
            return _Recorder(g, sink).run(*args)
        return forward

    for m in amp.modules():
        if isinstance(m, torch.fx.GraphModule):
            m.__dict__["forward"] = make(m)
            patched.append(m)
    try:
        return amp(*inputs)
    finally:
        for m in patched:
            del m.__dict__["forward"]


def _loss_weights(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen) for o in outs]


def forward_backward(fn: Callable[..., Any], inputs: tuple, params: list[torch.Tensor],
                     seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The float outputs of ``fn(*inputs)`` and the gradients of a fixed random projection of
    them with respect to ``x`` (the first input) and ``params``."""
    x = inputs[0].clone().requires_grad_()
    outs = _floats(fn(x, *inputs[1:]))
    loss = sum((o.float() * w).sum() for o, w in zip(outs, _loss_weights(outs, seed)))
    wrt = [x, *params]
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return [o.detach().float() for o in outs], [None] * len(wrt)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [o.detach().float() for o in outs], list(grads)


def _autocast(model: nn.Module, dtype: torch.dtype) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        with torch.autocast("cpu", dtype=dtype):
            return model(*args)
    return run


@dataclass
class _Checker:
    """The checks of one case, in order; each appends to ``failures`` or ``passed``."""

    case: Case
    failures: list[Failure] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    ratios: list[tuple[str, float, float]] = field(default_factory=list)

    def fail(self, check: str, kind: str, detail: str) -> None:
        self.failures.append(Failure(check, kind, detail[:600]))

    def ok(self, check: str, cond: bool, kind: str, detail: str) -> None:
        if cond:
            self.passed.append(check)
        else:
            self.fail(check, kind, detail)

    def convert(self, model: nn.Module) -> nn.Module | None:
        import ampfx

        ex = self.case.inputs(self.case.batch, self.case.seq)
        try:
            amp = ampfx.convert(model, self.case.dtype, example_inputs=ex, **self.case.options)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            self.fail("convert", type(e).__name__, _short(e))
            return None
        self.passed.append("convert")
        return amp

    def lint(self, amp: nn.Module) -> None:
        for g in graph_modules(amp):
            try:
                g.graph.lint()
            except Exception as e:  # noqa: BLE001
                self.fail("lint", type(e).__name__, _short(e))
                return
        self.passed.append("lint")

    def report_dtypes(self, amp: nn.Module, inputs: tuple, mode: str) -> None:
        sink: list[str] = []
        try:
            with torch.no_grad():
                recorded_call(amp, inputs, sink)
        except Exception as e:  # noqa: BLE001
            self.fail(f"run:{mode}", type(e).__name__, _short(e))
            return
        self.ok("report-dtype", not sink, "report dtype differs", "; ".join(sink[:4]))

    def compare(self, label: str, got: tuple, ref: tuple, ac: tuple | None) -> None:
        """Outputs (and gradients, where given) against float32's, and the error against autocast's."""
        (outs, grads), (r_outs, r_grads) = got, ref
        shapes = [tuple(o.shape) for o in outs], [tuple(o.shape) for o in r_outs]
        if shapes[0] != shapes[1]:
            self.fail(f"{label}:value", "wrong shape", f"ampfx {shapes[0]}, float32 {shapes[1]}")
            return
        bad = nonfinite_where_finite(outs, r_outs)
        self.ok("finite-output", bad == 0, "non-finite output", f"{label}: {bad} positions not finite where "
                "float32's are")
        self._error(f"{label}:output", outs, r_outs, ac[0] if ac else None)
        if grads is None:
            return
        pairs = [(g, r) for g, r in zip(grads, r_grads)]
        missing = [i for i, (g, r) in enumerate(pairs) if (g is None) != (r is None)]
        self.ok("grad-presence", not missing, "gradient presence differs",
                f"{label}: inputs/parameters #{missing} get a gradient in one and not the other")
        both = [(g, r) for g, r in pairs if g is not None and r is not None]
        bad = nonfinite_where_finite([g for g, _ in both], [r for _, r in both])
        self.ok("finite-grad", bad == 0, "non-finite gradient", f"{label}: {bad} gradient entries not finite "
                "where float32's are")
        if ac is not None:
            ac_both = [(a, r) for a, r in zip(ac[1], r_grads) if a is not None and r is not None]
            if len(ac_both) == len(both):
                self._error(f"{label}:grad", [g for g, _ in both], [r for _, r in both], [a for a, _ in ac_both])
                return
        self._error(f"{label}:grad", [g for g, _ in both], [r for _, r in both], None)

    def _error(self, label: str, got: list, ref: list, ac: list | None) -> None:
        e_amp = rel_error(got, ref)
        e_ac = rel_error(ac, ref) if ac is not None else math.inf
        self.ratios.append((label, e_amp, e_ac))
        # where autocast cannot run (or its error is not finite) ampfx is held to the floor alone
        bound = FACTOR * e_ac + FLOOR[self.case.dtype] if math.isfinite(e_ac) else FLOOR[self.case.dtype]
        versus = (f"{FACTOR} x autocast's {e_ac:.3g} + " if math.isfinite(e_ac) else "(autocast cannot run it) ")
        self.ok("error-vs-autocast", e_amp <= bound, "error above bound",
                f"{label}: ampfx relative error {e_amp:.3g} > {versus}{FLOOR[self.case.dtype]:.3g}")


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__module__}.{type(e).__name__}: {text[0] if text else ''}"[:400]


def _example(ck: _Checker, model: nn.Module, amp: nn.Module) -> None:
    """Eval mode at the example's sizes: report dtypes, outputs and gradients against float32 and autocast."""
    case = ck.case
    model.eval(), amp.eval()
    inputs = case.inputs(case.batch, case.seq, seed=2)
    params = list(model.parameters())
    ck.report_dtypes(amp, inputs, "eval")
    ref = forward_backward(model, inputs, params, case.seed)
    try:
        ac = forward_backward(_autocast(model, case.dtype), inputs, params, case.seed)
    except Exception:  # noqa: BLE001 - autocast cannot run it: ampfx is held to the floor alone
        ac = None
    try:
        got = forward_backward(amp, inputs, params, case.seed)
    except Exception as e:  # noqa: BLE001
        ck.fail("run:eval", type(e).__name__, _short(e))
        return
    ck.compare("eval", got, ref, ac)


def _other_sizes(ck: _Checker, model: nn.Module, amp: nn.Module) -> None:
    """Another batch size, then another sequence length: right, or (for a dimension not named in
    ``dynamic_dims``, or fixed after a dynamic export ran out of time) a clear ampfx error; never a wrong
    value or a torch-internal error."""
    case = ck.case
    dynamic = case.options.get("dynamic_dims") or {}
    model.eval(), amp.eval()
    for dim, (batch, seq) in ((0, (OTHER_BATCH, case.seq)), (1, (case.batch, OTHER_SEQ))):
        label = f"{'batch' if dim == 0 else 'seq'}={batch if dim == 0 else seq}"
        inputs = case.inputs(batch, seq, seed=3 + dim)
        with torch.no_grad():
            ref = _floats(model(*inputs))
            try:
                ac = _floats(_autocast(model, case.dtype)(*inputs))
            except Exception:  # noqa: BLE001
                ac = None
            try:
                got = _floats(amp(*inputs))
            except Exception as e:  # noqa: BLE001
                if is_ampfx_error(e) and (dim not in dynamic or _dynamic_export_timed_out(amp)):
                    ck.refused.append(f"{label}: {_short(e)}")
                    continue
                ck.fail("other-size", type(e).__name__, f"{label}: {_short(e)}")
                continue
        ck.compare(label, (got, None), (ref, None), (ac, None) if ac is not None else None)
        ck.passed.append("other-size")


def _dynamic_export_timed_out(amp: nn.Module) -> bool:
    """Did an export with dynamic sizes run past its share of ``export_timeout`` (a loaded machine), so
    that fewer sizes stayed dynamic, as its capture's steps say? A size it then fixed is refused with a
    clear error, as for a dimension not in ``dynamic_dims``."""
    report = getattr(amp, "ampfx_report", None)  # (a stand-in module in the harness's own tests has none)
    return report is not None and any("stopped after" in step for reg in report.parts for step in reg.steps)


def _train_step(ck: _Checker, model: nn.Module, amp: nn.Module) -> None:
    """Train mode (dropout on, batch statistics): report dtypes, and outputs and gradients finite
    where float32's are (dropout draws differ, so no error bound here)."""
    case = ck.case
    model.train(), amp.train()
    inputs = case.inputs(case.batch, case.seq, seed=5)
    params = list(model.parameters())
    ck.report_dtypes(amp, inputs, "train")
    with torch.random.fork_rng():
        torch.manual_seed(case.seed)
        r_outs, r_grads = forward_backward(model, inputs, params, case.seed)
        try:
            torch.manual_seed(case.seed)
            outs, grads = forward_backward(amp, inputs, params, case.seed)
        except Exception as e:  # noqa: BLE001
            ck.fail("run:train", type(e).__name__, _short(e))
            return
    bad = nonfinite_where_finite(outs, r_outs) if len(outs) == len(r_outs) else -1
    ck.ok("finite-output", bad == 0, "non-finite output", f"train: {bad} positions not finite where float32's are")
    both = [(g, r) for g, r in zip(grads, r_grads) if g is not None and r is not None]
    bad = nonfinite_where_finite([g for g, _ in both], [r for _, r in both])
    ck.ok("finite-grad", bad == 0, "non-finite gradient", f"train: {bad} gradient entries not finite where "
          "float32's are")


def run_case(case: Case) -> Outcome:
    """Every check on ``case``: convert succeeds, lint passes, the report's dtypes are the dtypes the
    nodes produce, outputs and gradients finite where float32's are, error against float32 within
    :data:`FACTOR` x autocast's + :data:`FLOOR`, and right (or a clear ampfx refusal) at another
    batch size and another sequence length."""
    ck = _Checker(case)
    model = case.model()
    with torch.random.fork_rng():
        amp = ck.convert(model)
        if amp is not None:
            ck.lint(amp)
            _example(ck, model, amp)
            _other_sizes(ck, model, amp)
            _train_step(ck, model, amp)
    return Outcome(case, tuple(ck.failures), tuple(ck.passed), tuple(ck.refused), tuple(ck.ratios))

