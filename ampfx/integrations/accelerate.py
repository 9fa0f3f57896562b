"""Accelerate: ``AmpfxAccelerator("bf16")`` is an ``accelerate.Accelerator`` whose ``prepare()`` converts the
model with ampfx and never enters autocast.

Install with ``pip install 'ampfx[hf]'``. ``prepare(model, optimizer, ...)`` routes the model's forward so that
its first call converts it (:class:`ampfx.integrations.lazy.FirstCall`: that call's inputs are the example
inputs), then hands the model to Accelerate with ``mixed_precision="no"``: Accelerate wraps no autocast around
the forward, the parameters stay the float32 masters the optimizer updates. Under float16 the accelerator
holds a ``torch.amp.GradScaler`` for its device (Accelerate's own fp16 mode is CUDA-only; this one runs on the
CPU too): ``backward`` scales the loss, ``clip_grad_norm_`` / ``unscale_gradients`` unscale, the optimizer's
step is skipped where a gradient is not finite (``optimizer.step_was_skipped``). ``save_state`` / ``load_state``
keep the scaler and the policy; loading a state written with another policy raises
:class:`~ampfx.errors.PolicyMismatchError`.

``mixed_precision=`` other than ``"no"`` (as an argument, or ``ACCELERATE_MIXED_PRECISION`` from
``accelerate launch --mixed_precision``) disagreeing with ampfx's dtype is an error: autocast and ampfx are
never on together. For HF ``Trainer`` see :mod:`ampfx.integrations.hf`.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer

from ..errors import ArgumentError
from ..policy import Policy
from ..report import Report
from .lazy import FirstCall, Setup, applied_policy, check_applied

log = logging.getLogger(__name__)

FORMAT = "ampfx-accelerate/1"
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class AmpfxAccelerator(Accelerator):
    """An ``Accelerator`` that converts each model given to ``prepare()`` with ampfx (at its first call).

    ``dtype``: ``"bf16"`` (the default, or ``policy.dtype``) or ``"fp16"``; ``policy``, or ``ampfx_options``: a
    dict of the fields of :class:`ampfx.Policy` and ``tracer`` / ``dynamic_dims``, as for :func:`ampfx.convert`;
    ``report_dir``: where each model's decision log is saved (main process only; default none); every other
    keyword goes to ``Accelerator``.
    """

    def __init__(self, dtype: Any = None, *, policy: Policy | None = None, ampfx_options: dict | None = None,
                 report_dir: str | os.PathLike | None = None, **accelerator_kwargs: Any) -> None:
        setup = Setup.of("AmpfxAccelerator", dtype, policy, dict(ampfx_options or {}))
        name = _NAMES[setup.dtype]
        given = accelerator_kwargs.pop("mixed_precision", None)
        from_env = os.environ.get("ACCELERATE_MIXED_PRECISION")
        # an explicit mixed_precision= wins over the environment, as in Accelerate
        asked = [(given, "mixed_precision=")] if given is not None else [
            (from_env, "ACCELERATE_MIXED_PRECISION (accelerate launch --mixed_precision)")]
        for value, where in asked:
            if value is not None and str(value).lower() not in ("no", name):
                raise ArgumentError(f"AmpfxAccelerator({name!r}): {where}{value!r} asks Accelerate for autocast in "
                                    f"another dtype; ampfx does the mixed precision: leave it out, or set 'no'")
            if value is not None and str(value).lower() == name:
                log.info("AmpfxAccelerator: %s%r is done by ampfx (Accelerate's autocast stays off)", where, value)
        super().__init__(mixed_precision="no", **accelerator_kwargs)
        self.ampfx_setup = setup
        self.report_dir = report_dir
        self._firsts: list[FirstCall] = []
        self._resumed: list[dict[str, Any] | None] = []  # the applied policy of each model in a loaded state
        if setup.dtype == torch.float16:
            self.scaler = torch.amp.GradScaler(self.device.type)
        self.register_for_checkpointing(_PolicyState(self))

    @property
    def ampfx_dtype(self) -> torch.dtype:
        return self.ampfx_setup.dtype

    @property
    def reports(self) -> list[Report | None]:
        """The decision log of each prepared model, in the order prepared (``None`` before its first call)."""
        return [f.report for f in self._firsts]

    @property
    def report(self) -> Report | None:
        """The decision log of the one prepared model (an error where several were prepared: see :attr:`reports`)."""
        if len(self._firsts) > 1:
            raise ArgumentError(f"AmpfxAccelerator: {len(self._firsts)} models were prepared; use .reports")
        return self._firsts[0].report if self._firsts else None

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Route ``model``'s forward through ampfx (converted at its first call), then Accelerate's own
        preparation (device placement, DDP), without autocast."""
        if not any(f.module is model for f in self._firsts) and not getattr(model, "_is_accelerate_prepared", False):
            first = FirstCall(model, self.ampfx_setup, self._converted, who="AmpfxAccelerator")
            first.install()
            self._firsts.append(first)
        return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)

    def _converted(self, report: Report) -> None:
        i = next(i for i, f in enumerate(self._firsts) if f.report is report)
        check_applied(self._resumed[i] if i < len(self._resumed) else None, report, "AmpfxAccelerator")
        if self.report_dir is not None and self.is_main_process:
            report.save(Path(self.report_dir) / (f"model{i}" if len(self._firsts) > 1 else ""))

    def _checkpoint_state(self) -> dict[str, Any]:
        """The policy, the convert options and the policy each model's conversion applied (plain data)."""
        applied = [applied_policy(r) if r is not None else None for r in self.reports]
        return {"format": FORMAT, **self.ampfx_setup.state(), "applied": applied}

    def _load_checkpoint_state(self, state: dict[str, Any]) -> None:
        """Check a saved :meth:`_checkpoint_state` against this accelerator's policy (a difference raises
        :class:`~ampfx.errors.PolicyMismatchError`); conversions made after check theirs too."""
        if state.get("format") != FORMAT:
            raise ArgumentError(f"AmpfxAccelerator: the saved ampfx state has format {state.get('format')!r}, "
                                f"expected {FORMAT!r}")
        self.ampfx_setup.check_state(state, "AmpfxAccelerator", "Make the AmpfxAccelerator with the same dtype and "
                                     "options as the run that saved it")
        self._resumed = list(state.get("applied") or [])
        for first, saved in zip(self._firsts, self._resumed):
            if first.report is not None:
                check_applied(saved, first.report, "AmpfxAccelerator")

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Unscale the gradients of ``optimizer`` (default: every prepared optimizer) under float16."""
        if self.scaler is None:
            return
        opts = self._optimizers if optimizer is None else optimizer if isinstance(optimizer, (list, tuple)) \
            else [optimizer]
        for opt in opts:
            while isinstance(opt, AcceleratedOptimizer):
                opt = opt.optimizer
            self.scaler.unscale_(opt)


class _PolicyState:
    """The policy in ``save_state`` / ``load_state`` (``register_for_checkpointing``)."""

    def __init__(self, accelerator: AmpfxAccelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return self.accelerator._checkpoint_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accelerator._load_checkpoint_state(state)
