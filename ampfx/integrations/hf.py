"""HuggingFace ``Trainer``: ``AmpfxTrainer(model, args, ..., ampfx="bf16")`` trains through ampfx.

Install with ``pip install 'ampfx[hf]'``. A ``transformers.Trainer`` whose accelerator is an
:class:`~ampfx.integrations.accelerate.AmpfxAccelerator`: the model is converted at its first forward (the
first batch's ``input_ids``, ``attention_mask``, ``labels``... are the example inputs; HF models convert whole
through ``torch.export``), no autocast is entered, float16 uses a ``GradScaler`` (saved and loaded in
checkpoints by the Trainer as usual). Leave ``TrainingArguments(bf16=False, fp16=False)``: ampfx does the
mixed precision, and those flags would turn the Trainer's own autocast on (an error here). The decision log is
``trainer.ampfx_report`` and is saved in ``<output_dir>/ampfx-log``; each checkpoint holds ``ampfx_policy.json``, and
resuming from one written with another policy raises :class:`~ampfx.errors.PolicyMismatchError`.
"""
from __future__ import annotations

import json
import os
import weakref
from pathlib import Path
from typing import Any
from unittest import mock

import transformers.trainer
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from ..errors import ArgumentError
from ..policy import Policy
from ..report import Report
from .accelerate import AmpfxAccelerator

POLICY_FILE = "ampfx_policy.json"


class AmpfxTrainer(Trainer):
    """``transformers.Trainer`` with ampfx's mixed precision: ``ampfx`` is the dtype (``"bf16"``, the default, or
    ``"fp16"``), ``ampfx_policy`` / ``ampfx_options`` as for
    :class:`~ampfx.integrations.accelerate.AmpfxAccelerator`; every other argument is the Trainer's."""

    def __init__(self, *args: Any, ampfx: Any = None, ampfx_policy: Policy | None = None,
                 ampfx_options: dict | None = None, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None and (training_args.bf16 or training_args.fp16):
            flag = "bf16" if training_args.bf16 else "fp16"
            raise ArgumentError(f"AmpfxTrainer: TrainingArguments({flag}=True) turns the Trainer's own autocast on; "
                                f"ampfx does the mixed precision: set {flag}=False and give AmpfxTrainer(..., "
                                f"ampfx={flag!r})")
        self._ampfx = dict(dtype=ampfx, policy=ampfx_policy,
                           ampfx_options=ampfx_options)
        super().__init__(*args, **kwargs)
        self.add_callback(PolicyWriter(self))

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's own set-up, with an :class:`AmpfxAccelerator` in place of ``Accelerator``."""
        report_dir = os.path.join(self.args.output_dir, "ampfx-log") if self.args.output_dir else None

        def make(**accelerator_kwargs: Any) -> AmpfxAccelerator:
            return AmpfxAccelerator(**self._ampfx, report_dir=report_dir, mixed_precision="no", **accelerator_kwargs)

        with mock.patch.object(transformers.trainer, "Accelerator", make):
            super().create_accelerator_and_postprocess()

    @property
    def ampfx_report(self) -> Report | None:
        """The model's decision log (``None`` before its first forward)."""
        return self.accelerator.report

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """Never autocast (``bf16`` / ``fp16`` are refused when the Trainer is made)."""
        if self.use_cpu_amp:
            raise ArgumentError("AmpfxTrainer: the Trainer's CPU autocast is on; set bf16=False and fp16=False")
        return super().autocast_smart_context_manager(cache_enabled)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; resuming checks the checkpoint's ``ampfx_policy.json`` first (a checkpoint written
        with another policy raises :class:`~ampfx.errors.PolicyMismatchError`) and restores its state."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)  # as Trainer.train resolves it (it raises if none)
        if folder:
            path = Path(folder) / POLICY_FILE
            if not path.is_file():
                raise ArgumentError(f"AmpfxTrainer: {str(folder)!r} holds no {POLICY_FILE}: it was not written by "
                                    "an AmpfxTrainer, so the policy it was trained with is not known")
            self.accelerator._load_checkpoint_state(json.loads(path.read_text(encoding="utf-8")))
        return super().train(resume_from_checkpoint, *args, **kwargs)


class PolicyWriter(TrainerCallback):
    """Writes ``ampfx_policy.json`` into each checkpoint the Trainer saves (``on_save``, after the checkpoint's
    own files): the policy and dtype the model was converted with, checked when training resumes from it."""

    def __init__(self, trainer: AmpfxTrainer) -> None:
        self.trainer = weakref.proxy(trainer)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not args.should_save:
            return control
        name = f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        found = sorted(Path(args.output_dir).glob(f"**/{name}"), key=lambda f: f.stat().st_mtime)
        if found:  # output_dir/checkpoint-N, or output_dir/run-<trial>/checkpoint-N in a hyperparameter search
            state_of = self.trainer.accelerator._checkpoint_state()
            (found[-1] / POLICY_FILE).write_text(json.dumps(state_of, indent=1) + "\n", encoding="utf-8")
        return control
