"""The one runtime state of a converted graph module: its call steps, declared in one place, and its entries.

A converted graph module (:class:`~ampfx.runtime.graph_module.AmpGraphModule`) holds one :class:`Runtime`. At
each call it runs the steps of :data:`CALL_STEPS`, in that order, that are on (a field that is not ``None``);
a step that is off costs one attribute test. Choosing the *entry* to run is one of the steps: the module's own
graph while what it fixed holds, else the other training mode's conversion, one made again earlier whose own
checks hold, or a new one made by the one convert-again callable (``reconvert``, within its one limit) --
as ``torch.compile`` keeps guarded cache entries with one recompile limit. Each step's object brings its own
copy and pickle behaviour (its ``__deepcopy__`` / ``__reduce__``); the table says what a copy and a pickle keep.

Threads: choosing among the entries there are takes no lock. Making one (or settling a structure change) holds
the process-wide conversion lock (:func:`ampfx.threads.converting`) and first looks again: a thread that waited
there runs the entry another thread made meanwhile, never a second one for the same values.

>>> [step.field for step in CALL_STEPS]
['check', 'linked', 'fixed', 'guard', 'weights']
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import runtime
from ..errors import BakedValueError, GuardError, StaleModelError, TrainingModeError
from ..threads import converting

log = logging.getLogger("ampfx.runtime.graph_module")  # the converted module's logger, named so in docs/guarantees.md


@dataclasses.dataclass(frozen=True)
class Step:
    """One call step: the :class:`Runtime` field holding its object (the step is off while it is ``None``), what
    it does at a call, and what a deep copy and a pickle keep of it."""

    field: str
    what: str
    copied: str
    pickled: str


CALL_STEPS: tuple[Step, ...] = (
    Step("check", "checks the model's structure (ampfx.runtime.follow): a module replaced or added, a tied tensor "
                  "untied since conversion converts again", "an inert follower: a copy follows nothing",
         "dropped: a loaded copy follows nothing"),
    Step("linked", "runs the rest inside the eager parent's handing (ampfx.runtime.handing)", "copied", "kept"),
    Step("fixed", "chooses the entry: this graph while what it fixed holds (ampfx.runtime.fixed), else the other "
                  "training mode's conversion, one made again that holds, or a new one (reconvert, within its "
                  "limit)", "bound to the copy of the model module", "bound again when loaded"),
    Step("guard", "checks the call's arguments against what the graph was made for (ampfx.runtime.guards); a value "
                  "the graph holds as traced chooses or makes another entry", "copied", "kept"),
    Step("weights", "runs the graph with its weight copies (ampfx.runtime.weight_cache), each made again where its "
                    "weight changed: training mode's casts take them, mode='inference''s graph reads them",
         "copied, empty", "kept, empty"),
)
"""The call steps, in the order a call runs them (:meth:`AmpGraphModule.forward`)."""


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    """What conversion decided for one graph module, frozen: where its graph sits (``where``, the dtype its float
    inputs ``arrive`` in, the ``low`` dtype), what its graph fixed of the model's Python (``recorded``,
    :mod:`ampfx.capture.fixing`), whether it runs its own copies of its module's hooks (``own_hooks``: torch.export
    traced a pre-hook in), the ``guard`` of its arguments and sizes (:mod:`ampfx.runtime.guards`; ``None``: nothing
    to check), how it reads each parameter (``reads``, :func:`ampfx.runtime.reads.scan`: the table the weight cache,
    inference copies and FSDP2's gather dtype read), how it hands values through an eager parent (``linked``,
    :mod:`ampfx.runtime.handing`) and the other training mode it converts when first needed (``other``,
    :class:`PendingMode`).

    :func:`ampfx.rewrite.convert_graph` makes it, :mod:`ampfx.tree` adds ``linked`` and ``other`` (a new frozen
    record each time), and :func:`ampfx.runtime.arming.arm` arms the graph module from it: nothing is written to
    the runtime state before."""

    where: str
    arrive: torch.dtype | None
    low: torch.dtype
    recorded: Any
    own_hooks: bool
    guard: Any
    reads: tuple
    linked: Any = None
    other: Any = None


@dataclasses.dataclass(repr=False)
class Runtime:
    """A converted graph module's runtime state: where its graph sits (set at conversion), its call steps'
    objects (:data:`CALL_STEPS`) and its entries (the other training mode's conversion, those made again).

    Conversion writes it in one place, :func:`ampfx.runtime.arming.arm`, from the graph's :class:`GraphPlan`; after
    that only its own methods change it, as calls and structure changes ask (an entry made, a change heard)."""

    plan: GraphPlan | None = None  # what conversion decided (armed from it); the fields below copy what calls read
    # where the graph sits: set when it is converted
    where: str = ""
    arrive: torch.dtype | None = None
    low_dtype: torch.dtype = torch.bfloat16
    recorded: Any = None  # ampfx.runtime.fixed's record of what the graph fixed, bound to a model module as `fixed`
    own_hooks: bool = False  # the graph runs copies of its module's hooks (torch.export traced a pre-hook in)
    # the call steps
    check: Any = None
    linked: Any = None
    fixed: Any = None
    guard: Any = None
    weights: Any = None
    # the entries
    alt: tuple[bool, nn.Module] | None = None  # (training mode, the conversion that runs in it)
    reconvert: Callable[..., nn.Module] | None = None  # the one convert-again callable, with its limit
    variants: list = dataclasses.field(default_factory=list)  # made again at calls, oldest first
    retired: int | None = None  # once the structure changed: the variants before this index traced the old one
    restructured: list[str] | None = None  # structure changes heard, settled at the next call
    stale: str | None = None  # why the next call raises StaleModelError
    rebind: tuple | None = None  # a pickle's: what `fixed` is bound to again when loaded
    size_said: bool = False  # a call's sizes crossed the plan's and no plan could be made: logged once
    sizes_failed: bool = False  # making a plan for a call's sizes failed once: not tried again

    def __repr__(self) -> str:
        on = [s.field for s in CALL_STEPS if getattr(self, s.field) is not None]
        return (f"Runtime({self.name()}, steps on: {', '.join(on) or 'none'}, "
                f"{'another mode, ' if self.alt is not None else ''}{len(self.variants)} made again)")

    @classmethod
    def from_keys(cls, d: dict) -> "Runtime | None":
        """The runtime state a module pickled before it held one kept as ``_ampfx_*`` keys of its own (popped from
        ``d``); ``None`` where ``d`` holds none of them."""
        found = {f.name: d.pop(f"_ampfx_{f.name}") for f in dataclasses.fields(cls) if f"_ampfx_{f.name}" in d}
        low = d.pop("_ampfx_low", None)  # inference copies from before the weight cache kept them
        if low is not None:
            found["weights"] = low.as_cache()
        return cls(**found) if found else None

    def __setstate__(self, state: dict) -> None:
        """A pickle's state; one made before inference copies were kept by the weight cache holds them as ``low``:
        they become that cache (:meth:`ampfx.runtime.inference.LowCopies.as_cache`)."""
        low = state.pop("low", None)
        self.__dict__.update(state)
        if low is not None:
            self.weights = low.as_cache()

    def heard(self, change: str) -> None:
        """A structure change of the model module where this graph traced it (:mod:`ampfx.runtime.follow`): settled
        at the next call."""
        self.restructured = [*(self.restructured or ()), change]

    def go_stale(self, why: str) -> None:
        """The next call raises :class:`StaleModelError` saying ``why`` (a child replaced on the converted module
        whose forward the graph traced)."""
        self.stale = why

    def bind_loaded(self, model: nn.Module) -> None:
        """A loaded copy: what its graph fixed bound again to ``model`` (its own tree), as the pickle said."""
        rebind, self.rebind = self.rebind, None
        if rebind is not None and self.recorded is not None:
            self.fixed = self.recorded.bind(model, *rebind, low=self.low_dtype)

    def dispatched(self) -> bool:
        """Does a call do more than run the graph (a step is on, or there is another entry)?"""
        return self.alt is not None or any(getattr(self, s.field) is not None for s in CALL_STEPS)

    def for_pickle(self, picklable: bool) -> "Runtime":
        """What a pickle holds (:data:`CALL_STEPS`' "pickled"): no follower and no entries made again, ``fixed``
        as what to bind it to again, the convert-again callable only where the model goes along (``picklable``)."""
        return dataclasses.replace(self, check=None, variants=[], retired=None if self.retired is None else 0,
                                   fixed=None,
                                   rebind=self.fixed.source[2:] if self.fixed is not None else None,
                                   reconvert=self.reconvert if picklable else None)

    # --- choosing the entry ------------------------------------------------------------------------------

    def runner(self, gm: nn.Module, args: tuple, kwargs: dict) -> nn.Module | None:
        """The entry to run for this call of ``gm``: ``None`` for its own graph."""
        fixed, alt = self.fixed, self.alt
        if self.stale is not None:
            raise StaleModelError(self.stale)
        if self.restructured or self.retired is not None:
            return self._since_restructured(gm, args, kwargs)
        if fixed is None:  # a loaded copy, or during conversion: the training flag chooses
            if alt is None or gm.training != alt[0]:
                return None
            if isinstance(alt[1], PendingMode):
                return self.other_mode(gm, (args, kwargs))
            if not stands_for(alt[1]):  # a loaded copy's other mode (a plain module): it follows its flags
                copy_flags(gm, alt[1])
            return alt[1]
        if fixed.holds():  # the usual call: one check, no lock
            return None
        entry = self._holding(gm, args, kwargs, checked=True)
        return entry if entry is not _NONE else self._made(self._holding, gm, args, kwargs, fixed)

    def _holding(self, gm: nn.Module, args: tuple, kwargs: dict, checked: bool = False) -> Any:
        """The entry whose fixed values hold now: ``None`` for this graph (``checked``: they were just found not
        to hold), the other training mode's conversion (made now if it waits for its first use), or one made
        again; ``_NONE`` where none does."""
        if not checked and self.fixed.holds():
            return None
        alt = self.alt
        if alt is not None and isinstance(alt[1], PendingMode) and gm.training == alt[0]:
            alt = (alt[0], self.other_mode(gm, (args, kwargs)))
        if alt is not None and not stands_for(alt[1]):  # a loaded copy's other mode follows its flags
            copy_flags(gm, alt[1])
        if alt is not None and _holds(alt[1], alt[0], gm):
            return alt[1]
        for variant in self.variants:
            if _holds(variant, None, gm):
                return variant
        return _NONE

    @runtime.compile_disabled
    def _made(self, holding: Callable[..., Any], gm: nn.Module, args: tuple, kwargs: dict, fixed: Any,
              changes: list[str] | None = None) -> nn.Module | None:
        """``holding(gm, args, kwargs)`` once more when this thread holds the conversion lock (another thread may
        have made the entry while it waited), else a new entry (:meth:`convert_again`)."""
        with converting():
            entry = holding(gm, args, kwargs)
            return self.convert_again(gm, fixed, args, kwargs, changes) if entry is _NONE else entry

    def _since_restructured(self, gm: nn.Module, args: tuple, kwargs: dict) -> nn.Module:
        """The entry once the structure changed: one made since whose fixed values hold, or a new one."""
        if self.restructured:
            made = self._restructure(gm, args, kwargs)
            if made is not None:
                return made
        entry = self._made_since(gm, args, kwargs)
        return entry if entry is not _NONE else self._made(self._made_since, gm, args, kwargs, self.fixed)

    def _made_since(self, gm: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The entry made since the structure changed whose fixed values hold; ``_NONE`` where none does."""
        return next((v for v in self.variants[self.retired or 0:] if _holds(v, None, gm)), _NONE)

    @runtime.compile_disabled
    def _restructure(self, gm: nn.Module, args: tuple, kwargs: dict) -> nn.Module | None:
        """Retire the entries made before the structure changes heard and make a new one, holding the conversion
        lock; ``None`` where another thread settled those changes while this one waited."""
        with converting():
            changes, self.restructured = self.restructured, None
            if not changes:
                return None
            self.retired = len(self.variants)  # what was made before the change traced the old structure
            return self.convert_again(gm, None, args, kwargs, changes)

    @runtime.compile_disabled
    def other_mode(self, gm: nn.Module, call: tuple[tuple, dict] | None) -> nn.Module:
        """Make the other training mode's conversion that ``alt`` waits for (:class:`PendingMode`), keep it in its
        place and return it (a :class:`ModeUnavailable` where converting in that mode failed). ``call``: the
        arguments of the call that needs it (their device picks the inputs it is converted on)."""
        make = self.reconvert
        if make is None:  # not armed yet (a run during conversion): the model module's own Python, as it is
            return gm.__dict__["_ampfx_model"]
        with converting():
            training, pending = self.alt
            if not isinstance(pending, PendingMode):  # made by another thread while this one waited
                return pending
            args, kwargs = _detached(*pending.arguments(gm.__dict__["_ampfx_model"], call))
            name = "train" if training else "eval"
            log.info("ampfx: converting %s in %s mode, at its first use in that mode", self.name(), name)
            try:
                with torch.inference_mode(False), torch.enable_grad():
                    made = make(gm, args, kwargs, [f"the {name}-mode conversion, made at its first use in {name} "
                                                    f"mode as ampfx.convert(model.{name}()) makes it"],
                                training=training, memo=pending.memo)
            except Exception as e:  # noqa: BLE001 - that mode only: the module raises in it, saying why
                made = ModeUnavailable(training, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                                       if str(e).strip() else type(e).__name__)
            self.alt = (training, made)
            return made

    @runtime.compile_disabled
    def convert_again(self, gm: nn.Module, fixed: Any, args: tuple, kwargs: dict,
                      changes: list[str] | None = None) -> nn.Module:
        """A new entry, made by ``reconvert`` for this call (within its limit), or :class:`StaleModelError`
        naming the change and the fixes. The caller holds the conversion lock (:meth:`_made`)."""
        changes = changes or (fixed.changes() if fixed is not None else []) or ["a value the graph fixed changed"]
        make, variants, where = self.reconvert, self.variants, self.where
        name = self.name()
        if make is None or len(variants) >= make.limit:
            why = ("it has no conversion to make again (a copy loaded from a pickle, or reconvert_limit=0)"
                   if make is None or not make.limit else
                   f"it was converted again {len(variants)} times already (reconvert_limit={make.limit})")
            raise StaleModelError(
                f"{name} changed after conversion: {'; '.join(changes[:3])}. Its graph fixed these values while "
                f"tracing, and {why}. Fix: make a value that changes a tensor buffer (read at every call) or "
                f"an argument of forward, keep the module's Python (leaf_modules=[{where or '<module path>'!r}]), "
                "raise reconvert_limit / AMPFX_RECONVERT_LIMIT, or convert the model again")
        lowered = fixed.lowered() if fixed is not None else []
        if lowered:
            low = str(fixed.low).replace("torch.", "")
            raise StaleModelError(
                f"weights changed dtype after conversion (.half(), .bfloat16() or .to(dtype) on the model or the "
                f"converted module): {', '.join(lowered[:3])}{' and more' if len(lowered) > 3 else ''}, but the "
                f"model was converted to {low}: ops ampfx keeps float32 (norms, softmax) take {low} values with "
                f"float32 weights. Fix: keep the weights float32 (.float() puts them back) and let ampfx cast them "
                f"per op, or convert the model with the dtype its weights have")
        log.info("ampfx: %s: %s; converting it again (%d of at most %d)", name, "; ".join(changes[:3]),
                 len(variants) + 1, make.limit)
        try:
            variant = make(gm, *_detached(args, kwargs), changes)
        except StaleModelError:
            raise
        except Exception as e:
            raise StaleModelError(f"{name} changed after conversion ({'; '.join(changes[:3])}) and converting it "
                                  f"again failed: {type(e).__name__}: {e}. Convert the model again, or undo the "
                                  "change") from e
        variants.append(variant)
        return variant

    def for_values(self, gm: nn.Module, args: tuple, kwargs: dict, error: BakedValueError) -> nn.Module:
        """The entry for a call whose argument differs from the value the graph holds (``error`` says which): one
        made again earlier whose own checks accept the call, or a new one; ``error`` where none can be made."""
        if self.reconvert is None or not self.reconvert.limit:
            raise error
        entry = self._accepting(gm, args, kwargs)
        if entry is not _NONE:
            return entry
        if _inside_autograd():  # a conversion runs its own backward: not inside checkpointing's machinery
            raise error
        what = str(error).split(" (", 1)[0].removeprefix("ampfx: ")
        return self._made(self._accepting, gm, args, kwargs, None, [what])

    def for_signature(self, gm: nn.Module, args: tuple, kwargs: dict, error: GuardError) -> nn.Module:
        """The entry for a call outside the graph's signature (``error``: structure, kind or sizes) of a module
        below the root, which the model's own Python calls with what it passes (a mask left ``None``, one row):
        one made earlier whose guard takes the call, or a new one. ``error`` itself, the caller's to fix, at the
        root (the user's own call), inside autograd's machinery, with no conversion left to make or where making it
        fails (chained to why)."""
        if not self.where:
            raise error
        try:
            return self.for_values(gm, args, kwargs, error)
        except StaleModelError as e:  # past reconvert_limit, or converting again failed
            raise error from e

    def for_sizes(self, gm: nn.Module, args: tuple, kwargs: dict, error: Exception) -> nn.Module | None:
        """The entry for a call whose sizes cross a size-dependent dtype decision (``error``, a
        :class:`~ampfx.runtime.guards.PlanSizeError`): one planned earlier for such sizes, or a new plan; ``None``
        (run this graph as it is: right numbers, planned for other sizes) where no plan can be made (no
        ``reconvert_limit`` left, a loaded copy), said once in the log."""
        entry = self._accepting(gm, args, kwargs)
        if entry is not _NONE:
            return entry
        make = self.reconvert
        inside = _inside_autograd()
        if make is None or len(self.variants) >= make.limit or inside or self.sizes_failed:
            if self.sizes_failed:
                return None
            if not self.size_said:
                self.size_said = True
                why = (f"it is called {inside}, where a conversion's own runs cannot be made" if inside else
                       "reconvert_limit reached, or a loaded copy")
                log.warning("%s; no plan can be made for them (%s): the plan made for other sizes runs",
                            str(error).removeprefix("ampfx: "), why)
            return None
        what = str(error).removeprefix("ampfx: ").split(" (planned again", 1)[0]
        try:
            return self._made(self._accepting, gm, args, kwargs, None, [what])
        except StaleModelError as e:  # the plan for these sizes could not be made: the plan there is runs
            self.size_said = True
            self.sizes_failed = True
            log.warning("%s; planning again for them failed (%s): the plan made for other sizes runs, and no other "
                        "plan for sizes is tried", what, str(e).splitlines()[0][:300])
            return None

    def _accepting(self, gm: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The entry made again whose fixed values hold and whose guard takes the call; ``_NONE`` where none does."""
        return next((v for v in self.variants[self.retired or 0:] if _holds(v, None, gm) and _accepts(v, args, kwargs)),
                    _NONE)

    def name(self) -> str:
        return f"model.{self.where}" if self.where else "the model"


def _detached(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments as a conversion may run them: each tensor detached from the caller's autograd graph
    (its runs' backward must not reach, and free, what the caller's own backward needs)."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else v, (args, kwargs))


def _inside_autograd() -> str | None:
    """Where a call runs inside autograd's own machinery, which a conversion (it runs the model forward and
    backward) must not enter: under activation checkpointing (saved-tensor hooks active) or inside a backward (a
    recompute); ``None`` elsewhere."""
    if torch._C._current_graph_task_id() != -1:
        return "inside a backward (activation checkpointing's recompute)"
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is not None and top(False) is not None:
        return "under saved-tensor hooks (activation checkpointing)"
    return None


_NONE = object()
"""What the lookups of :class:`Runtime` return where no entry holds (``None`` stands for the graph itself)."""


def runtime_of(module: nn.Module) -> Runtime | None:
    """The :class:`Runtime` of a converted graph module (``None`` for any other module)."""
    return module.__dict__.get("_ampfx_runtime")


def stands_for(module: nn.Module) -> bool:
    """Does ``module`` stand for a model module (a graph module or mirror, whose flag is that module's)?"""
    return "_ampfx_model" in module.__dict__ or hasattr(type(module), "_ampfx_base")


def copy_flags(source: nn.Module, target: nn.Module) -> None:
    """Each module of ``target``'s tree gets the flag of the module at its path in ``source``'s (a loaded copy's
    other training mode, which is not inside its tree)."""
    flags = {path: m.training for path, m in source.named_modules(remove_duplicate=False)}
    for path, m in target.named_modules(remove_duplicate=False):
        flag = flags.get(path)
        if flag is not None and m.training != flag:
            m.training = flag


def _holds(module: nn.Module, mode: bool | None, owner: nn.Module) -> bool:
    """May ``module`` (another entry of ``owner``) run now? A graph module when its fixed values hold; Python
    (which reads its values at run time) when ``owner`` is in ``mode``."""
    rt = runtime_of(module)
    if rt is not None:
        return rt.fixed.holds() if rt.fixed is not None else mode is None or owner.training == mode
    return mode is None or owner.training == mode


def _accepts(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Does ``module`` (an entry made again) take these arguments: its guard passes (Python takes any)?"""
    rt = runtime_of(module)
    if rt is None or rt.guard is None:
        return True
    try:
        rt.guard(args, kwargs)
    except GuardError:
        return False
    return True


def run(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run ``module`` (another entry of a converted module) inside that module's call, without firing the model
    module's hooks again: a graph module's graph (through its own call where hooks were registered on it; it was
    chosen because its fixed values hold), Python through its ``forward``."""
    if runtime_of(module) is not None:
        own = any(module.__dict__.get(name) for name in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks",
                                                         "_backward_pre_hooks"))
        return module(*args, **kwargs) if own else module._run_graph(args, kwargs)
    runner = getattr(type(module), "_ampfx_run", None)
    return runner(module, args, kwargs) if runner is not None else module.forward(*args, **kwargs)


class PendingMode(nn.Module):
    """Stands in for the other training mode's conversion until it is first needed: the first call in that
    mode, :meth:`AmpGraphModule.mode_module`, or a pickle (a loaded copy cannot convert). It is then made as
    ``ampfx.convert(model.train(mode))`` makes it, with the model module as it is then, on ``inputs`` (the
    example inputs the converted module was given; the call's own where it runs on another device), and
    ``memo`` (what the first mode's capture learnt: the export size try it ended on).

    >>> PendingMode(False, None, None)
    PendingMode(eval mode: converted when first needed)
    """

    def __init__(self, training: bool, inputs: Any, memo: Any) -> None:
        super().__init__()
        self.mode, self.inputs, self.memo = training, inputs, memo

    def extra_repr(self) -> str:
        return f"{'train' if self.mode else 'eval'} mode: converted when first needed"

    def arguments(self, model: nn.Module, call: tuple[tuple, dict] | None) -> tuple[tuple, dict]:
        """The ``(args, kwargs)`` to convert ``model`` on: the example inputs, or ``call`` (the arguments of
        the call that needs the conversion) where there are none or they are on another device."""
        if self.inputs is None or (call is not None and _device(call) != self.inputs.device()):
            return call if call is not None else ((), {})
        return self.inputs.ordered(model.forward)


def _device(call: tuple[tuple, dict]) -> str | None:
    tensors = [t for t in torch.utils._pytree.tree_leaves(call) if isinstance(t, torch.Tensor)]
    return tensors[0].device.type if tensors else None


class ModeUnavailable(nn.Module):
    """Stands in for the other training mode's conversion when it failed: calling the converted
    module in that mode raises :class:`~ampfx.errors.TrainingModeError`, saying why and what to do."""

    def __init__(self, training: bool, why: str) -> None:
        super().__init__()
        self.mode, self.why = ("train" if training else "eval"), why

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        other = "train" if self.mode == "eval" else "eval"
        raise TrainingModeError(
            f"this converted module has no {self.mode}-mode conversion: converting the model in {self.mode} "
            f"mode failed ({self.why}). Convert the model in {self.mode} mode for that "
            f"(ampfx.convert(model.{self.mode}(), ...)), or use it in {other} mode only.")


def plan_of(gm: nn.Module) -> GraphPlan | None:
    """``gm``'s :class:`GraphPlan`: the one conversion left on it until it is armed, then its runtime's; ``None``
    for a module that is no converted graph module (or one loaded from a pickle made before plans)."""
    plan = gm.__dict__.get("_ampfx_plan")
    if plan is not None:
        return plan
    rt = gm.__dict__.get("_ampfx_runtime")
    return getattr(rt, "plan", None)
