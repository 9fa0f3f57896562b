"""AmpfxTrainer: HF Trainer fine-tunes a transformers model through ampfx, like its own bf16 mode."""
import pytest
import torch
from accelerate.state import AcceleratorState
from conftest import gap
from hf_parts import Data, Losses, bert
from transformers import Trainer, TrainingArguments

from ampfx.errors import ArgumentError
from ampfx.integrations.hf import POLICY_FILE, AmpfxTrainer
from ampfx.errors import PolicyMismatchError


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def train(tmp_path, cls=Trainer, steps=12, resume=None, save=False, **kwargs):
    flags = {k: kwargs.pop(k) for k in ("bf16", "fp16") if k in kwargs}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=16,
                             logging_steps=1, learning_rate=2e-3, report_to=[], use_cpu=True, seed=0,
                             save_strategy="steps" if save else "no", save_steps=steps // 2,
                             disable_tqdm=True, **flags)
    losses = Losses()
    trainer = cls(model=bert(), args=args, train_dataset=Data(), callbacks=[losses], **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, losses.losses


def test_fine_tunes_like_the_trainers_own_bf16_without_autocast(tmp_path, autocast_spy):
    """The loss curve is as close to TrainingArguments(bf16=True) as that is to float32; no autocast is
    entered; the report is trainer.ampfx_report and is saved in <output_dir>/ampfx."""
    _, fp32 = train(tmp_path / "fp32")
    AcceleratorState._reset_state(True)
    _, own = train(tmp_path / "own", bf16=True)
    assert autocast_spy.entered > 0
    autocast_spy.entered = 0
    AcceleratorState._reset_state(True)
    trainer, amp = train(tmp_path / "ampfx", cls=AmpfxTrainer, ampfx="bf16")
    assert autocast_spy.entered == 0
    assert gap(amp, own) <= 2 * gap(own, fp32) + 2e-3
    report = trainer.ampfx_report
    assert report.dtype == torch.bfloat16 and len(report.low()) > 10
    assert (tmp_path / "ampfx" / "ampfx-log" / "decisions.jsonl").exists()  # <output_dir>/ampfx-log
    metrics = trainer.evaluate(Data(32))  # eval mode, no gradients: the converted model's other mode
    assert 0 < metrics["eval_loss"] < 1.0 and autocast_spy.entered == 0


def test_the_trainers_own_precision_flags_are_refused(tmp_path):
    """bf16=True / fp16=True would turn the Trainer's autocast on beside ampfx: an error naming the flag."""
    args = TrainingArguments(output_dir=str(tmp_path), bf16=True, use_cpu=True, report_to=[])
    with pytest.raises(ArgumentError, match="bf16=True"):
        AmpfxTrainer(model=bert(), args=args, train_dataset=Data(), ampfx="bf16")


def test_float16_uses_the_accelerators_scaler(tmp_path):
    """fp16 through ampfx on the CPU: the Trainer's accelerator holds a GradScaler, which the Trainer uses."""
    trainer, losses = train(tmp_path, cls=AmpfxTrainer, steps=6, ampfx="fp16")
    assert isinstance(trainer.accelerator.scaler, torch.amp.GradScaler)
    assert trainer.accelerator.scaler._scale is not None  # it scaled a loss
    assert trainer.ampfx_report.dtype == torch.float16 and all(l == l for l in losses)


def test_checkpoint_resumes_with_the_same_policy(tmp_path):
    """Each checkpoint holds the policy; resuming with the same one goes on, with another one raises."""
    options = {"fp32_modules": ("classifier",)}
    train(tmp_path, cls=AmpfxTrainer, steps=4, save=True, ampfx_options=options)
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / POLICY_FILE).exists()
    AcceleratorState._reset_state(True)
    trainer, _ = train(tmp_path, cls=AmpfxTrainer, steps=4, resume=str(ckpt), ampfx_options=options)
    assert trainer.state.global_step == 4
    AcceleratorState._reset_state(True)
    with pytest.raises(PolicyMismatchError, match="fp32_modules"):
        train(tmp_path, cls=AmpfxTrainer, steps=4, resume=str(ckpt))


def test_resume_from_the_last_checkpoint_and_from_one_not_written_by_ampfx(tmp_path):
    """``resume_from_checkpoint=True`` checks the last checkpoint's policy file, as the Trainer resolves it; a
    checkpoint the plain Trainer wrote holds none, and resuming from it is refused, naming the file."""
    train(tmp_path, cls=AmpfxTrainer, steps=4, save=True)
    AcceleratorState._reset_state(True)
    trainer, _ = train(tmp_path, cls=AmpfxTrainer, steps=6, resume=True)
    assert trainer.state.global_step == 6
    plain = tmp_path / "plain"
    train(plain, steps=4, save=True)
    AcceleratorState._reset_state(True)
    with pytest.raises(ArgumentError, match=POLICY_FILE):
        train(tmp_path / "other", cls=AmpfxTrainer, steps=4, resume=str(plain / "checkpoint-2"))


def test_ampfx_trainer_overrides_no_private_method_and_pins_the_one_seam_it_patches():
    """AmpfxTrainer uses the Trainer's public extension points (a callback's ``on_save``, ``train``,
    ``autocast_smart_context_manager``) and overrides no underscore method; the one seam it patches, the name
    ``Accelerator`` that ``create_accelerator_and_postprocess`` calls in ``transformers.trainer``, is pinned here,
    so a transformers release that moves it fails this test rather than training without ampfx."""
    import inspect

    import transformers.trainer

    private = [n for n in vars(AmpfxTrainer) if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n)]
    assert private == []
    assert hasattr(transformers.trainer, "Accelerator")
    assert "Accelerator(" in inspect.getsource(Trainer.create_accelerator_and_postprocess)


def test_a_plan_with_no_gemm_low_is_said_through_the_trainer(tmp_path, monkeypatch):
    """Rule: where ampfx's plan keeps every GEMM float32, AmpfxTrainer's conversion warns so, with the switch."""
    monkeypatch.setenv("AMPFX_GEMM_MIN_FLOPS", str(10 ** 12))
    with pytest.warns(UserWarning, match=r"no GEMM runs in bfloat16.*AMPFX_GEMM_MIN_FLOPS=0"):
        trainer, _ = train(tmp_path, cls=AmpfxTrainer, ampfx="bf16", steps=2)
    assert "no GEMM runs in bfloat16" in trainer.ampfx_report.summary()
