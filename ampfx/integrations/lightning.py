"""PyTorch Lightning: ``L.Trainer(plugins=[AmpfxPrecision("bf16")])`` trains through ampfx.

Install with ``pip install 'ampfx[lightning]'`` (the unified ``lightning`` package, imported as ``import lightning as
L``, as Lightning's docs teach since 2.0); the standalone ``pytorch-lightning`` package works too. A Trainer takes
only plugins of its own package: :class:`AmpfxPrecision` is a ``Precision`` of each one installed.

- ``convert_module`` routes the LightningModule's ``forward`` so that its first call converts it with
  :func:`ampfx.convert` (that call's inputs are the example inputs: the first batch, or
  ``example_input_array`` where the model summary runs it first) and every later call runs the converted
  forward. The LightningModule itself stays the trainer's: its parameters are the float32 masters the
  optimizer updates, its ``state_dict()`` and methods are unchanged. The loss computed in ``training_step``
  outside ``forward`` stays float32.
- ``forward_context`` enters no autocast; a forward under ``torch.autocast`` raises
  :class:`~ampfx.errors.AutocastConflictError`. Lightning itself refuses ``precision=`` beside a
  precision plugin.
- float16: a ``torch.amp.GradScaler`` for the loss's device scales the loss, unscales the gradients before
  clipping and ``on_before_optimizer_step``, and skips the step where they are not finite (as Lightning's
  ``MixedPrecision`` does). bfloat16 uses no scaler.
- the decision log is saved under the trainer's ``log_dir`` in ``ampfx-log/`` (a folder named ``ampfx`` in the working directory would hide the package from scripts run there) (rank zero), and is
  :attr:`AmpfxPrecision.report` (``trainer.precision_plugin.report``).
- checkpoints keep the scaler's state and the policy; resuming with another policy raises
  :class:`~ampfx.errors.PolicyMismatchError` naming the difference, and
  :meth:`AmpfxPrecision.from_checkpoint` makes the plugin a checkpoint was trained with.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.optim import LBFGS

from ..errors import ArgumentError
from ..policy import Policy
from ..report.records import dtype_name
from ..report import Report
from .lazy import FirstCall, Setup, applied_policy, check_applied

log = logging.getLogger(__name__)

FORMAT = "ampfx-lightning/1"


def _packages() -> list[Any]:
    """The Lightning packages installed: the unified ``lightning`` (``lightning.pytorch``, which its docs teach since
    2.0) and the standalone ``pytorch_lightning``, each with its own ``Precision`` and ``LightningModule`` classes."""
    found = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            found.append(importlib.import_module(name))
        except ImportError:
            continue
    if not found:
        raise ImportError("ampfx.integrations.lightning needs Lightning: pip install lightning (or pytorch-lightning)")
    return found


PACKAGES = _packages()
_PRECISIONS = tuple(importlib.import_module(f"{p.__name__}.plugins.precision").Precision for p in PACKAGES)
_MODULES = tuple(p.LightningModule for p in PACKAGES)


class AmpfxPrecision(*_PRECISIONS):  # a Precision of each package: either's Trainer takes it
    """A Lightning precision plugin that converts the LightningModule's forward with ampfx.

    ``dtype``: ``"bf16"`` (the default, or ``policy.dtype``) or ``"fp16"`` (or a torch dtype); ``policy`` or
    keyword options (the fields of :class:`ampfx.Policy`, ``tracer``, ``dynamic_dims``) as for
    :func:`ampfx.convert`. ``scaler``: a ``torch.amp.GradScaler`` to use under float16 (default: one made for the
    loss's device). ``log_dir``: where the decision log goes (default: ``<trainer.log_dir>/ampfx-log``; ``False``: not
    saved).
    """

    def __init__(self, dtype: Any = None, *, policy: Policy | None = None,
                 scaler: torch.amp.GradScaler | None = None, log_dir: str | os.PathLike | bool | None = None,
                 **options: Any) -> None:
        self.setup = Setup.of("AmpfxPrecision", dtype, policy, dict(options))
        fp16 = self.setup.dtype == torch.float16
        if scaler is not None and not fp16:
            raise ArgumentError(f"AmpfxPrecision({dtype_name(self.setup.dtype)!r}) uses no GradScaler (bfloat16 has "
                                f"float32's range); scaler={scaler!r} is for 'fp16'")
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise ArgumentError(f"AmpfxPrecision: scaler={scaler!r}: give a torch.amp.GradScaler")
        self.precision = "16-mixed" if fp16 else "bf16-mixed"  # what trainer.precision reports; no autocast is used
        self.scaler = scaler
        self.log_dir = log_dir
        self._first: FirstCall | None = None
        self._scaler_state: dict[str, Any] | None = None
        self._resumed: dict[str, Any] | None = None  # the applied policy of a checkpoint's run
        self.saved_to: Path | None = None

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, **kwargs: Any) -> "AmpfxPrecision":
        """The plugin a checkpoint written with :class:`AmpfxPrecision` was trained with (its policy and
        convert options); ``kwargs``: ``scaler``, ``log_dir``."""
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        state = ckpt.get(cls.__qualname__)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ArgumentError(f"AmpfxPrecision.from_checkpoint: {str(path)!r} was not written with AmpfxPrecision "
                                f"(no {cls.__qualname__!r} entry of format {FORMAT!r})")
        setup = Setup.from_state(state, f"AmpfxPrecision.from_checkpoint({str(path)!r})")
        return cls(policy=setup.policy, tracer=setup.tracer, dynamic_dims=setup.dynamic_dims, **kwargs)

    def __repr__(self) -> str:
        return f"AmpfxPrecision({dtype_name(self.setup.dtype)!r}, precision={self.precision!r})"

    # ------------------------------------------------------------------ the module
    @property
    def report(self) -> Report | None:
        """The decision log of the LightningModule's conversion (``None`` before its first forward)."""
        return None if self._first is None else self._first.report

    @property
    def converted(self) -> torch.nn.Module | None:
        """The converted forward's module (a view of the LightningModule), once converted."""
        return None if self._first is None else self._first.converted

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Route ``module``'s forward through ampfx (converted at its first call); ``module`` itself is returned."""
        if self._first is not None:
            if self._first.module is module:  # fit, then validate / test with the same trainer
                return module
            raise ArgumentError("AmpfxPrecision: this plugin already converts another LightningModule; make one "
                                "plugin per Trainer")
        if not isinstance(module, _MODULES):
            raise ArgumentError(f"AmpfxPrecision: expected a LightningModule, got {type(module).__name__}")
        self._first = FirstCall(module, self.setup, self._converted, who="AmpfxPrecision")
        self._first.install()
        return module

    def _converted(self, report: Report) -> None:
        trainer = getattr(self._first.module, "_trainer", None)
        check_applied(self._resumed, report, "AmpfxPrecision")
        if self.log_dir is False:
            return
        # trainer.log_dir broadcasts rank 0's folder under DDP: every rank asks (each converts at its first call),
        # or rank 0 waits for the others until the process group's timeout
        where = self.log_dir if self.log_dir not in (None, True) else (
            Path(trainer.log_dir or trainer.default_root_dir) / "ampfx-log" if trainer is not None else None)
        if where is not None and (trainer is None or trainer.is_global_zero):
            self.saved_to = report.save(where)
            log.info("AmpfxPrecision: decision log saved to %s", self.saved_to)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """No autocast: the converted forward chooses every dtype."""
        yield

    # ------------------------------------------------------------------ float16: the scaler
    def _scaler_for(self, tensor: torch.Tensor) -> torch.amp.GradScaler | None:
        if self.setup.dtype != torch.float16:
            return None
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(tensor.device.type)
        if self._scaler_state is not None:
            self.scaler.load_state_dict(self._scaler_state)
            self._scaler_state = None
        return self.scaler

    def pre_backward(self, tensor: torch.Tensor,  # type: ignore[override]
                     module: Any) -> torch.Tensor:
        scaler = self._scaler_for(tensor)
        if scaler is not None:
            tensor = scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    def optimizer_step(self, optimizer: Any, model: Any,  # type: ignore[override]
                       closure: Callable[[], Any], **kwargs: Any) -> Any:
        """As Lightning's ``MixedPrecision``: bfloat16 steps as usual; float16 runs the closure, unscales the
        gradients (before clipping and ``on_before_optimizer_step``), then the scaler steps (skipped where a
        gradient is not finite) and updates its scale."""
        if self.setup.dtype != torch.float16:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        if isinstance(optimizer, LBFGS):
            raise ArgumentError("AmpfxPrecision('fp16'): LBFGS calls its closure several times per step, which a "
                                "GradScaler cannot unscale; use 'bf16' or another optimizer")
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization  # backward was skipped
        if self.scaler is None or skip:
            self._after_closure(model, optimizer)
            return closure_result
        self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The policy, the convert options, the policy the conversion applied and the scaler's state."""
        scaler = self.scaler.state_dict() if self.scaler is not None else self._scaler_state
        applied = applied_policy(self.report) if self.report is not None else self._resumed
        return {"format": FORMAT, **self.setup.state(), "applied": applied, "scaler": scaler}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check the checkpoint's policy against this plugin's (a difference raises
        :class:`~ampfx.errors.PolicyMismatchError`), then restore the scaler's state."""
        if state_dict.get("format") != FORMAT:
            raise ArgumentError(f"AmpfxPrecision: the checkpoint's precision state is not AmpfxPrecision's "
                                f"(format {state_dict.get('format')!r}, expected {FORMAT!r})")
        self.setup.check_state(state_dict, "AmpfxPrecision",
                               "Resume with the same options, or with AmpfxPrecision.from_checkpoint(ckpt_path)")
        self._resumed = state_dict.get("applied")
        if self.report is not None:
            check_applied(self._resumed, self.report, "AmpfxPrecision")
        if state_dict.get("scaler") is not None:
            if self.scaler is not None:
                self.scaler.load_state_dict(state_dict["scaler"])
            else:
                self._scaler_state = state_dict["scaler"]

    def teardown(self) -> None:
        """Nothing to undo: the LightningModule keeps its converted forward for later fits and tests."""
