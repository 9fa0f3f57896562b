"""The frozen records a conversion writes into ``node.meta['ampfx']``: a :class:`Decision` for each of the
model's own nodes (why it got its dtype, by which :class:`Rule`), a :class:`CastInfo` for each cast ampfx
inserted, a :class:`Part` for each part of the model captured, kept eager or left as is; and how ampfx writes a
dtype (:func:`dtype_name`). The :class:`~ampfx.report.Report` is built from them.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from ..ops import Category

COMPUTE = ("call_function", "call_method", "call_module")

SHORT_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
"""The short spellings of the float dtypes ampfx converts between (cast node names, plots)."""


def dtype_name(d: Any, *, short: bool = False, none: str = "-") -> str:
    """How ampfx writes a dtype: ``"bfloat16"`` for ``torch.bfloat16`` (``"bf16"``
    with ``short``, for the dtypes in :data:`SHORT_NAMES`), ``none`` for ``None``,
    and anything else (``"dynamic"``) as it is.

    >>> dtype_name(torch.bfloat16), dtype_name(torch.float16, short=True), dtype_name(None), dtype_name("dynamic")
    ('bfloat16', 'fp16', '-', 'dynamic')
    """
    if d is None:
        return none
    if short and d in SHORT_NAMES:
        return SHORT_NAMES[d]
    return str(d).replace("torch.", "")


@dataclass(frozen=True)
class _About:
    """What a :class:`Rule` member carries besides its value (see there)."""

    doc: str
    word: str | None = None
    inserted: bool = False
    counted: bool = True


def _about(doc: str, *, word: str | None = None, inserted: bool = False, counted: bool | None = None) -> _About:
    return _About(doc, word, inserted, (not inserted) if counted is None else counted)


_OLD_VALUES = {"region": "eager"}
"""Rule values earlier reports wrote, and the value each is now (``Rule("region")`` reads an old record)."""


class Rule(str, enum.Enum):
    """What decided a node's dtype: ``Decision.rule``.

    A member is its value, a string (``Rule.TABLE == "table"``), and prints,
    formats, reprs and serialises to JSON as that string, so records read the
    same as plain strings. Each member carries:

    - ``doc``: one line saying what the rule means (the report page shows it);
    - ``word``: the short word the summary's ``float32:`` line uses for it;
    - ``inserted``: the node is one ampfx added to the graph (drawn dotted);
    - ``counted``: the node counts as one of the model's compute nodes in the
      summary (not for nodes ampfx added, nor for a module kept eager, whose
      children are counted instead).

    A list edit from the environment is ``env:<VAR>`` with the variable's name:
    ``Rule("env:AMPFX_DENYLIST_ADD")`` (or ``Rule.env("AMPFX_DENYLIST_ADD")``) is
    a member made on demand, with :attr:`ENV`'s documentation.

    >>> Rule("table") is Rule.TABLE, Rule.TABLE == "table", f"{Rule.PAINT_DENY}", Rule.PAINT_DENY.word
    (True, True, 'paint:deny', 'follows deny')
    >>> r = Rule.env("AMPFX_DENYLIST_ADD")
    >>> r, r == "env:AMPFX_DENYLIST_ADD", r.env_var, r.doc == Rule.ENV.doc
    ('env:AMPFX_DENYLIST_ADD', True, 'AMPFX_DENYLIST_ADD', True)
    """

    def __new__(cls, value: str, about: _About) -> "Rule":
        member = str.__new__(cls, value)
        member._value_ = value
        member._info = about
        return member

    TABLE = "table", _about("the default op tables (ampfx.ops) for this dtype", word="deny list")
    ARGUMENT = "argument", _about("a list edit given as a Policy argument")
    ENV = "env:<VAR>", _about("a list edit from that environment variable")
    UNLISTED = "unlisted", _about("the op is in no list: it stays float32")
    NON_FLOAT = "non-float", _about("no float32/16/bf16 data flows through the node")
    OTHER_FLOAT = "other-float", _about("the op computes in float64, a complex dtype or another float dtype that ampfx "
                                        "never converts: it runs as written, in that dtype")
    FP32_MODULES = "fp32_modules", _about("inside a module named in fp32_modules / AMPFX_FP32_MODULES",
                                          word="fp32 module")
    MODULE_FILTER_FN = "module_filter_fn", _about("inside a module the policy's module_filter_fn rejected")
    USER_FLOAT32 = "user-float32", _about("the model's code asks for float32 here: inside "
                                          "torch.autocast(..., enabled=False)", word="user float32")
    PROBE = "probe", _about("the low-precision kernel failed a tiny test run on this device",
                            word="no low kernel here")
    COMPLEX = "complex", _about("makes complex numbers from real data (torch.complex, view_as_complex, x * 1j): "
                                "bfloat16 has no complex dtype and float16's has few kernels, so it reads float32",
                                word="makes complex")
    PAINT_DENY = "paint:deny", _about("follows a deny op through infer/clear ops (TF-AMP deny propagation)",
                                      word="follows deny")
    PAINT_BETWEEN_ALLOW = "paint:between-allow", _about("on a path between low-precision ops (TF-AMP)")
    PAINT_FOLLOW_ALLOW = "paint:follow-allow", _about(
        "an infer op fed by a low op and no deny op (bfloat16); all float inputs low (float16)")
    PAINT_CLEAR = "paint:clear", _about("a clear op next to a low-precision op (TF-AMP clear propagation)")
    PAINT_SAVE_CAST = "paint:save-cast", _about(
        "every user computes in float32 and the inputs are cast to float32 anyway, or its cluster of "
        "infer/clear ops needs fewer casts and moves no more bytes in float32: float32 saves casts",
        word="saves a cast")
    WRITE_LOW = "cost:write-low", _about(
        "a float32 op (softmax) whose low-precision kernel computes in float32 inside and rounds once, and whose "
        "consumers all read its result low: it writes the low dtype (the same values, no cast, its saved output "
        "half the bytes)", word="writes low")
    NO_FLOAT32_COPY = "cost:no-float32-copy", _about(
        "the model's own conversion of a low value to float32, whose users all read it low: left out (they "
        "would get the same values back)", word="float32 copy left out")
    FIDELITY_STREAM = "fidelity:stream", _about(
        "reads a float32 activation (a residual stream, a carried state, positions): computes in float32 as "
        "type promotion would, instead of casting that value down (Policy.float32_stream)", word="float32 stream")
    FIDELITY_OPERAND = "fidelity:operand", _about(
        "an add/sub of a float32 parameter, buffer or factory value (arange, meshgrid), or a product or quotient "
        "with a float32 parameter whose value goes on to more than GEMMs (layer scale): computes in float32 as "
        "type promotion would, so the operand's low bits survive (Policy.float32_operands)", word="float32 operand")
    FIDELITY_EXACT = "fidelity:exact", _about(
        "its value reaches an integer conversion, an index or a comparison: float32 inputs are not rounded "
        "(Policy.exact_values)", word="exact value")
    PAINT_DEFAULT = "paint:default", _about("an infer/clear op with no low-precision neighbours: stays float32",
                                            word="no low neighbour")
    SELECT = "select", _about("indexing keeps its input's dtype; consumers cast the (smaller) selection")
    DGL_DEVICE = "dgl:device", _about(
        "a DGL leaf whose kernels lack the low dtype on this device (no float16 on CPU): bfloat16 or float32")
    DGL_OVERFLOW = "dgl:overflow", _about(
        "a DGL sum/mean aggregation whose example inputs would overflow float16: bfloat16 or float32")
    BIAS_FP32 = "bias-fp32", _about("a GEMM bias added in float32 after the GEMM's float32 cast (no bias cast)",
                                    inserted=True)
    SHAPE_SMALL_REDUCTION = "shape:small-reduction", _about(
        "a reduction over at most reduction_threshold elements: follows its inputs")
    SHAPE_LARGE_REDUCTION = "shape:large-reduction", _about("a reduction over more than reduction_threshold elements")
    SHAPE_SIZE_UNKNOWN = "shape:size-unknown", _about(
        "a reduction whose size is unknown (no example_inputs, or a symbolic range): float32")
    COST_SMALL_GEMM = "cost:small-gemm", _about(
        "a GEMM whose forward floating-point operations are under the device's break-even for the low dtype, or whose "
        "weight is used for fewer rows a call (Policy.gemm_min_flops, gemm_min_rows): float32 is faster there and "
        "needs no casts", word="small GEMM")
    COST_LOW_SLOWER = "cost:low-slower", _about(
        "a GEMM on a device where GEMMs in the low dtype were measured slower than float32 at every size "
        "(ampfx.ops.device_cost; a CPU without native bfloat16 or float16 arithmetic): float32",
        word="low dtype slower here")
    CALIBRATION_OVERFLOW = "calibration:overflow", _about(
        "calibration saw this node's output or gradient exceed the low dtype's range")
    CALIBRATION_SENSITIVE = "calibration:sensitive", _about(
        "calibration saw that rounding this node's result alone to the low dtype moves the output or a parameter "
        "gradient by more than sensitivity_threshold", word="precision-sensitive")
    TUNE = "tune", _about(
        "ampfx.tools.tune found that keeping this node float32 brings the user's metric within tolerance of the float32 "
        "model's (Policy.tuned, or a policy file)", word="tuned")
    PAD = "pad", _about("a node ampfx added to slice a padded GEMM's output back", inserted=True)
    INPLACE = "inplace", _about("an in-place op keeps the dtype of the tensor it mutates", word="in-place")
    RANGE_CONSTANT = "range:constant", _about(
        "a float constant argument the low dtype cannot hold (e.g. a float32 mask minimum)")
    KEPT = "keep_modules", _about("a module kept as a boundary (keep_modules): its forward runs, converted on its "
                                  "own; its inputs and outputs cross in the dtypes its own graph reads and computes "
                                  "them in", word="kept module", counted=False)
    EAGER = "eager", _about("a module that could not be traced keeps its Python (runs eagerly); its children were "
                            "converted one by one", counted=False)
    REGION = EAGER  # deprecated: the name and value ("region") of EAGER before it was renamed
    STRUCTURE = "structure", _about("graph inputs, parameters and outputs")

    # str, not "Rule.TABLE", wherever a rule is printed: records read as they did when rules were strings
    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self._value_)

    @classmethod
    def _missing_(cls, value: object) -> "Rule | None":
        """``env:<VAR>`` for any variable: a member made (once) on demand; ``"region"``, the value
        :attr:`EAGER` had in earlier reports, is :attr:`EAGER`."""
        if isinstance(value, str) and value in _OLD_VALUES:
            return cls(_OLD_VALUES[value])
        if not (isinstance(value, str) and value.startswith("env:") and len(value) > len("env:")):
            return None
        member = str.__new__(cls, value)
        member._name_ = "ENV"
        member._value_ = value
        member._info = _About(cls.ENV.doc)
        return cls._value2member_map_.setdefault(value, member)

    @classmethod
    def env(cls, var: str) -> "Rule":
        """The rule of a list edit read from the environment variable ``var``."""
        return cls(f"env:{var}")

    @property
    def doc(self) -> str:
        """What the rule means, in one line."""
        return self._info.doc

    @property
    def word(self) -> str:
        """The summary's short word for the rule (its value unless it has one)."""
        return self._info.word or self._value_

    @property
    def inserted(self) -> bool:
        """Is a node with this rule one ampfx added to the graph (a bias add, a pad slice)?"""
        return self._info.inserted

    @property
    def counted(self) -> bool:
        """Does a node with this rule count among the model's compute nodes in the summary?"""
        return self._info.counted

    @property
    def env_var(self) -> str | None:
        """The environment variable of an ``env:<VAR>`` rule; ``None`` for other rules."""
        return self._value_[len("env:"):] if self._name_ == "ENV" and self is not Rule.ENV else None


class Fp8Rule(str, enum.Enum):
    """What decided a GEMM node's FP8 decision (:class:`Fp8Decision`, ``fp8=``): ``doc`` says it in a line.

    >>> Fp8Rule("fp8:cost") is Fp8Rule.COST, f"{Fp8Rule.FP8}"
    (True, 'fp8')
    """

    def __new__(cls, value: str, doc: str) -> "Fp8Rule":
        member = str.__new__(cls, value)
        member._value_ = value
        member.doc = doc
        return member

    FP8 = "fp8", "a linear layer's GEMMs whose sizes pay in FP8 on the target device: they run in FP8 under the recipe"
    FORCED = "fp8:forced", "inside a module named in fp8_modules / AMPFX_FP8_MODULES: FP8 whatever its size or position"
    OP = "fp8:op", ("FP8 runs linear layers (a weight GEMM: F.linear, nn.Linear); other GEMMs (products of "
                    "activations, convolutions, fused attention, leaf modules) stay in the low dtype")
    NOT_LOW = "fp8:not-low", "the node computes in float32 (its dtype decision): FP8 only replaces low-precision GEMMs"
    SHAPE = "fp8:shape", "K or N is not a multiple of 16, or not known: the FP8 kernel (torch._scaled_mm) needs both"
    COST = "fp8:cost", ("on the target device (fp8_roofline) quantising the operands costs more time than the FP8 "
                        "GEMM saves")
    POSITION = "fp8:position", ("the model's first or last linear layer (its input features, its output logits): "
                                "kept in the low dtype, as Megatron and torchao's float8 recipes keep them")
    ROUTER = "fp8:router", "its output chooses among experts (reaches a top-k): routing scores stay in the low dtype"
    SENSITIVE = "fp8:sensitive", ("on the calibration batches its FP8 output differed from its low-dtype output by "
                                  "more than fp8_error_threshold (relative): kept in the low dtype")
    SKIPPED = "fp8:module", "inside a module named in fp8_skip_modules / AMPFX_FP8_SKIP_MODULES"

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self._value_)


@dataclass(frozen=True)
class Fp8Decision:
    """A GEMM node's FP8 decision under ``fp8=``: the ``recipe``, which of its three GEMMs run in FP8 (``output``
    ``x @ w.T``, ``input_grad`` ``g @ w``, ``weight_grad`` ``g.T @ x``), the :class:`Fp8Rule` and the reason, and
    ``flops``, its forward GEMM's floating-point operations on the example inputs (``None``: unknown). With
    ``calibrate=`` batches, what they showed (largest over the batches; ``None`` without calibration): ``amax_input``,
    ``amax_weight``, ``amax_grad``, the largest magnitudes of the GEMM's input, weight and output gradient, from which
    each call's scales are made (tensorwise: ``amax / 448`` for the e4m3 operands, ``amax / 57344`` for the e5m2
    gradient); ``error``, the relative difference of the FP8 output from the low dtype's (``|y_fp8 - y| / |y|``);
    ``underflow``, the share of the input's nonzero values that quantise to zero; ``saturated``, under delayed
    scaling, the largest share of a batch's input values past the amax of the batches before it (where delayed
    scaling would clip them; ampfx scales such a call by its own amax)."""

    recipe: str
    rule: Fp8Rule
    reason: str
    output: bool = False
    input_grad: bool = False
    weight_grad: bool = False
    flops: int | None = None
    amax_input: float | None = None
    amax_weight: float | None = None
    amax_grad: float | None = None
    error: float | None = None
    underflow: float | None = None
    saturated: float | None = None

    def __post_init__(self) -> None:
        if type(self.rule) is not Fp8Rule:
            object.__setattr__(self, "rule", Fp8Rule(self.rule))


GEMM_COST_RULES = (Rule.COST_SMALL_GEMM, Rule.COST_LOW_SLOWER)
"""The rules that keep a GEMM float32 because the low dtype would be slower on the device (the category shown
``cost``)."""

@dataclass(frozen=True)
class Decision:
    """Why one node got its dtype.

    ``dtype`` is the dtype the node computes in (``None``: left as written).
    ``shapes`` / ``in_shapes`` are its output and tensor-input shapes, as
    ``dtype[sizes]`` before conversion (symbolic sizes by name), when
    ``example_inputs`` were given.
    ``rule`` is the :class:`Rule` that decided (a rule's value is accepted and
    made a member); ``reason`` says it in words. ``out`` is the dtype of the value the node produces after
    conversion (``"dynamic"`` when only known at run time). ``fp32_inside`` says what stays float32
    inside a low-precision op, one ``"what: names"`` item each (``"running statistics: bn.running_mean,
    bn.running_var"``, ``"affine parameters: bn.weight, bn.bias"``, ``"accumulation"``).
    ``autocast`` is the dtype ``torch.autocast`` would compute the node in on the conversion device
    (``"unknown"`` where that cannot be known, ``None`` for non-float values, on devices without
    autocast, and for nodes ampfx inserted): see :meth:`Report.autocast_diff`. ``history`` is the
    sequence of ``(step, rule)`` that set the decision, first to last (:class:`ampfx.observer.Observer`):
    ``(("classify", "table"), ("paint", "paint:clear"))`` reads "the tables put it on a list, painting
    chose its dtype". ``inputs`` names what the node reads in the converted graph, in order (its
    ``all_input_nodes``): other records' ``node`` and the ``node`` of casts ampfx inserted (:class:`CastInfo`),
    the report's edges (:func:`ampfx.report.html.edges`). ``bias_after``: a low-precision GEMM whose consumers
    all want float32 adds its float32 bias after its float32 cast (the bias is never cast;
    :mod:`ampfx.passes.writes`). ``gemms`` is how many ATen GEMMs (:data:`ampfx.ops.ATEN_GEMMS`) one call of the
    converted node runs on the example inputs, those inside a leaf or an opaque function included, and
    ``gemms_low`` how many of them read the low dtype (:mod:`ampfx.passes.gemms`); ``None`` where not
    counted (no example inputs). ``fp8``: with ``fp8=``, a GEMM node's :class:`Fp8Decision` (``None`` otherwise).
    """

    node: str
    op: str
    target: str
    module: str
    category: Category
    dtype: torch.dtype | None
    rule: Rule
    reason: str
    kind: str = "call_function"
    shapes: tuple[str, ...] = ()
    in_shapes: tuple[str, ...] = ()
    out: torch.dtype | str | None = None
    inplace: bool = False
    fp32_inside: tuple[str, ...] = ()
    autocast: torch.dtype | str | None = None
    history: tuple[tuple[str, str], ...] = ()
    inputs: tuple[str, ...] = ()
    bias_after: bool = False
    gemms: int | None = None
    gemms_low: int | None = None
    fp8: Fp8Decision | None = None

    def __post_init__(self) -> None:
        if type(self.rule) is not Rule:  # dataclasses.replace passes the member back: skip Enum's lookup
            object.__setattr__(self, "rule", Rule(self.rule))

    @property
    def shown_category(self) -> str:
        """The category as tables show it: ``cost`` for a GEMM kept float32 by the device's cost
        (:data:`GEMM_COST_RULES`; painting treats it as ``deny``: float32 flows on from it), else the category's word.

        >>> Decision("linear", "linear", "linear", "", Category.DENY, None, "cost:small-gemm", "").shown_category
        'cost'
        """
        return "cost" if self.rule in GEMM_COST_RULES else self.category.value

    @property
    def key(self) -> str:
        """The node's name across the whole conversion, as ``Policy.tuned`` names it: ``module:node``
        (``node`` alone at the root); a name repeats in different graphs, a module's graph is one.

        >>> Decision("linear", "linear", "linear", "head", Category.ALLOW, None, "table", "").key
        'head:linear'
        """
        return f"{self.module}:{self.node}" if self.module else self.node

    def as_json(self) -> dict[str, Any]:
        """The record as ``decisions.jsonl`` holds it (:func:`to_json`); the shapes' dtypes are the original
        model's, ``dtype`` and ``out`` the conversion's, and the keys say so (:data:`JSON_KEYS`)."""
        return {JSON_KEYS.get(k, k): v for k, v in to_json(self).items()}


JSON_KEYS = {"shapes": "shapes_before", "in_shapes": "in_shapes_before"}
"""Decision fields renamed in :meth:`Decision.as_json`: their dtypes are before conversion."""


@dataclass(frozen=True)
class CastInfo:
    """One cast ampfx inserted: ``value`` to ``to``, shared by ``consumers``."""

    node: str
    value: str
    source: torch.dtype | str | None
    to: torch.dtype
    consumers: tuple[str, ...]
    weight: bool = False
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        """The record as ``casts.jsonl`` holds it (:func:`to_json`)."""
        return to_json(self)


@dataclass(frozen=True)
class Part:
    """How one part of the model was converted: ``path`` ('' = root), ``method`` (how it was captured,
    or that it keeps its Python, ``"eager (children converted separately)"``, or is ``"left as is: ..."``),
    the ``steps`` tried, the ``leaves`` kept opaque (path, why), ``why`` the capture was accepted, and the
    ``functions`` ``torch.fx.wrap`` kept whole, opaque nodes computing in float32 (qualified name, why)."""

    path: str
    method: str
    steps: tuple[str, ...] = ()
    leaves: tuple[tuple[str, str], ...] = ()
    why: str = ""
    functions: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class AutocastDiff:
    """One compute node whose dtype under ampfx (``dtype``) is not the one ``torch.autocast`` would
    compute it in (``autocast``), with the ``rule`` and ``reason`` that decided ampfx's dtype."""

    node: str
    op: str
    module: str
    dtype: torch.dtype
    autocast: torch.dtype
    rule: Rule
    reason: str

    def as_json(self) -> dict[str, Any]:
        """:func:`to_json`, with a missing dtype written ``"-"`` as the table shows it."""
        return {**to_json(self), "dtype": dtype_name(self.dtype), "autocast": dtype_name(self.autocast)}


def to_json(value: Any) -> Any:
    """``value`` as JSON holds it: the one encoder of ampfx's records. A record (a dataclass) is a dict of
    its fields, a dtype its name (:func:`dtype_name`), an enum (:class:`Rule`, ``Category``) its value,
    tuples lists, a path a string; numbers, strings, booleans and ``None`` stay as they are.

    >>> to_json(CastInfo("x_bf16", "x", torch.float32, torch.bfloat16, ("linear",), "allow op"))["to"]
    'bfloat16'
    >>> to_json({"rule": Rule.TABLE, "pairs": (("a", 1),)})
    {'rule': 'table', 'pairs': [['a', 1]]}
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def computes_in(r: Decision) -> torch.dtype | None:
    """The dtype a record's node computes in under ampfx: its ``dtype``, else (left as written) the
    dtype of its value, else ``None``."""
    if r.dtype is not None:
        return r.dtype
    return r.out if isinstance(r.out, torch.dtype) else None


def __getattr__(name: str) -> Any:
    """``Region``, the name :class:`Part` had: deprecated, kept so that older code imports."""
    if name == "Region":
        warnings.warn("ampfx.report.records.Region is deprecated: it is Part now", DeprecationWarning, stacklevel=2)
        return Part
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
