"""AmpfxPrecision: Lightning trains through ampfx without autocast, like its own bf16 mode."""
import logging

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from conftest import classifier, gap
from torch.utils.data import DataLoader, TensorDataset

from ampfx.errors import ArgumentError
from ampfx.errors import AutocastConflictError, PolicyMismatchError
from ampfx.integrations.lightning import AmpfxPrecision

logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)


Classifier = classifier(pl)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    return DataLoader(TensorDataset(x, y), batch_size=32)


def fit(tmp_path, epochs=3, model=None, ckpt_path=None, val_dataloaders=None, **trainer_kwargs):
    torch.manual_seed(0)
    model = model or Classifier()
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", default_root_dir=tmp_path, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         **trainer_kwargs)
    trainer.fit(model, data(), val_dataloaders, ckpt_path=ckpt_path)
    return model, trainer


def test_trains_like_lightnings_own_bf16_without_autocast(tmp_path, autocast_spy):
    """The loss curve through AmpfxPrecision('bf16') is as close to precision='bf16-mixed' as bf16-mixed is to
    float32 (both are bfloat16 rounding), no autocast is entered, and the report comes from the trainer."""
    fp32, _ = fit(tmp_path / "fp32")
    own, _ = fit(tmp_path / "own", precision="bf16-mixed")
    assert autocast_spy.entered > 0  # the spy sees Lightning's own autocast
    autocast_spy.entered = 0
    amp, trainer = fit(tmp_path / "ampfx", plugins=[AmpfxPrecision("bf16")])
    assert autocast_spy.entered == 0
    assert gap(amp.losses, own.losses) <= 2 * gap(own.losses, fp32.losses) + 1e-3
    assert amp.losses[-1] < 0.8 * amp.losses[0]  # it learns
    report = trainer.precision_plugin.report
    assert report is not None and report.dtype == torch.bfloat16
    assert [r.op for r in report.low()].count("linear") == 2
    assert trainer.precision == "bf16-mixed"
    assert amp.net[0].weight.dtype == torch.float32  # the masters stay float32


def test_decision_log_is_saved_in_the_trainers_log_dir(tmp_path):
    """The decision log lands in <log_dir>/ampfx-log (decisions.jsonl and the HTML page): not a folder named
    ampfx, which would hide the package from a script run in that directory."""
    _, trainer = fit(tmp_path, epochs=1, plugins=[AmpfxPrecision("bf16")])
    saved = tmp_path / "ampfx-log"
    assert trainer.precision_plugin.saved_to == saved
    assert (saved / "decisions.jsonl").stat().st_size > 0 and (saved / "report.html").exists()


def test_float16_uses_a_scaler_that_skips_non_finite_steps(tmp_path):
    """fp16: a GradScaler for the CPU scales the loss; the step whose gradients are infinite is skipped (the
    weights keep their values) and the scale halves, gradient clipping included; training goes on and learns."""
    torch.manual_seed(0)
    model = Classifier(poison_first=True)
    before = model.net[0].weight.detach().clone()
    plugin = AmpfxPrecision("fp16")
    seen = {}

    class Watch(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            if i == 0 and trainer.current_epoch == 0:
                seen["weight"] = module.net[0].weight.detach().clone()
                seen["scale"] = plugin.scaler.get_scale()

    fit(tmp_path, model=model, plugins=[plugin], callbacks=[Watch()], gradient_clip_val=1.0)  # clips unscaled
    assert isinstance(plugin.scaler, torch.amp.GradScaler) and plugin.scaler.is_enabled()
    assert torch.equal(seen["weight"], before)
    assert seen["scale"] == 2.0 ** 16 / 2
    assert plugin.report.dtype == torch.float16
    assert model.losses[-1] < 0.8 * model.losses[0]


def test_bfloat16_uses_no_scaler_and_refuses_one():
    """bf16 has float32's range: no scaler, and a given one is an error."""
    assert AmpfxPrecision("bf16").scaler is None
    with pytest.raises(ArgumentError, match="uses no GradScaler"):
        AmpfxPrecision("bf16", scaler=torch.amp.GradScaler("cpu"))


def test_precision_flag_beside_the_plugin_is_refused():
    """precision='bf16-mixed' with AmpfxPrecision would mean autocast and ampfx: Lightning refuses the pair."""
    with pytest.raises(Exception, match="precision"):
        pl.Trainer(precision="bf16-mixed", plugins=[AmpfxPrecision("bf16")], accelerator="cpu", logger=False)


def test_autocast_inside_the_training_step_is_an_error(tmp_path):
    """A torch.autocast block around the converted forward raises, naming the conflict."""

    class Autocasting(Classifier):
        def training_step(self, batch, i):
            with torch.autocast("cpu", torch.bfloat16):
                return super().training_step(batch, i)

    with pytest.raises(AutocastConflictError, match="torch.autocast is on"):
        fit(tmp_path, epochs=1, model=Autocasting(), plugins=[AmpfxPrecision("bf16")])


def test_bad_options_are_named_when_the_plugin_is_made():
    """A misspelt option, a mode the plugin does not offer and a bad dtype fail at once, naming the input."""
    with pytest.raises(ArgumentError, match="fp32_modules"):
        AmpfxPrecision("bf16", fp32_module=("head",))
    with pytest.raises(ArgumentError, match="not offered"):
        AmpfxPrecision("bf16", mode="inference")
    with pytest.raises(ValueError, match="float64|dtype"):
        AmpfxPrecision("float64")


def test_checkpoint_resumes_with_the_same_policy(tmp_path):
    """A checkpoint holds the policy: resuming with the same one trains on; with another one it raises naming
    the field; from_checkpoint builds the plugin the checkpoint was trained with."""
    plugin = AmpfxPrecision("bf16", fp32_modules=("net.3",))
    _, trainer = fit(tmp_path / "a", epochs=1, plugins=[plugin])
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["AmpfxPrecision"]
    assert saved["policy"]["fp32_modules"] == ["net.3"] and saved["applied"]["fp32_matched"]

    resumed = AmpfxPrecision.from_checkpoint(ckpt)
    assert resumed.setup.policy.fp32_modules == ("net.3",)
    _, again = fit(tmp_path / "b", epochs=2, plugins=[resumed], ckpt_path=ckpt)
    assert again.current_epoch == 2
    assert again.precision_plugin.report.by_node("linear_1").dtype == torch.float32

    with pytest.raises(PolicyMismatchError, match="fp32_modules"):
        fit(tmp_path / "c", epochs=2, plugins=[AmpfxPrecision("bf16")], ckpt_path=ckpt)


def test_float16_checkpoint_keeps_the_scalers_state(tmp_path):
    """The scaler's scale and growth tracker go into the checkpoint and come back on resume."""
    plugin = AmpfxPrecision("fp16")
    _, trainer = fit(tmp_path, epochs=1, model=Classifier(poison_first=True), plugins=[plugin])
    ckpt = tmp_path / "fp16.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["AmpfxPrecision"]["scaler"]
    assert saved["scale"] == plugin.scaler.get_scale() == 2.0 ** 15
    resumed = AmpfxPrecision("fp16")
    resumed.load_state_dict(torch.load(ckpt, weights_only=True)["AmpfxPrecision"])
    resumed._scaler_for(torch.ones(1))
    assert resumed.scaler.get_scale() == 2.0 ** 15


def test_first_forward_in_the_validation_sanity_check_converts_and_training_follows(tmp_path):
    """With a validation loader, the first forward runs in eval mode under inference_mode (Lightning's sanity
    check): that call converts, training then learns as without validation, and trainer.validate runs the
    converted forward."""

    class Validated(Classifier):
        def validation_step(self, batch, i):
            x, y = batch
            self.log("val_loss", F.cross_entropy(self(x), y))

    plain, _ = fit(tmp_path / "plain", plugins=[AmpfxPrecision("bf16")])
    torch.manual_seed(0)  # the same initial weights as fit's own Classifier()
    model, trainer = fit(tmp_path / "val", model=Validated(), plugins=[AmpfxPrecision("bf16")],
                         val_dataloaders=data())
    assert trainer.sanity_checking is False and trainer.precision_plugin.report is not None
    assert gap(model.losses, plain.losses) < 1e-3
    (metrics,) = trainer.validate(model, data(), verbose=False)
    assert metrics["val_loss"] < model.losses[0]


def test_a_module_converted_by_hand_is_refused():
    """ampfx.convert's result is not a LightningModule; a LightningModule's forward converted twice (two
    plugins) is refused too, naming the fix."""
    import ampfx

    model = Classifier()
    with pytest.raises(ArgumentError, match="LightningModule"):
        AmpfxPrecision("bf16").convert_module(ampfx.convert(model.net, "bf16"))
    AmpfxPrecision("bf16").convert_module(model)
    with pytest.raises(ArgumentError, match="already converted by ampfx at its first call"):
        AmpfxPrecision("bf16").convert_module(model)


def test_a_dtype_that_disagrees_with_the_policy_is_an_error():
    """AmpfxPrecision('bf16', policy=Policy('fp16')) names both; the policy alone sets the dtype."""
    from ampfx import Policy

    with pytest.raises(ArgumentError, match="disagrees with policy.dtype"):
        AmpfxPrecision("bf16", policy=Policy("fp16"))
    assert AmpfxPrecision(policy=Policy("fp16")).precision == "16-mixed"
    assert AmpfxPrecision().precision == "bf16-mixed"


def test_resuming_without_the_ampfx_variables_of_the_checkpoints_run_is_an_error(tmp_path, monkeypatch):
    """An AMPFX_* variable applies on top of the plugin's policy: a run resumed without the one the checkpoint's
    run had converts with another policy, which raises at its first forward, naming the variable."""
    monkeypatch.setenv("AMPFX_DENYLIST_ADD", "gelu")
    monkeypatch.setenv("AMPFX_INFERLIST_REMOVE", "gelu")
    _, trainer = fit(tmp_path / "a", epochs=1, plugins=[AmpfxPrecision("bf16")])
    assert trainer.precision_plugin.report.by_node("net_1").dtype == torch.float32
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    monkeypatch.delenv("AMPFX_DENYLIST_ADD")
    monkeypatch.delenv("AMPFX_INFERLIST_REMOVE")
    with pytest.raises(PolicyMismatchError, match="AMPFX_DENYLIST_ADD"):
        fit(tmp_path / "b", epochs=2, plugins=[AmpfxPrecision("bf16")], ckpt_path=ckpt)


def test_fp8_linears_train_through_the_plugin_and_its_checkpoint_keeps_the_fp8_options(tmp_path):
    """AmpfxPrecision takes convert's FP8 options: the forced linear runs in FP8 (its decision in the trainer's
    report), the model learns as under bf16, and a checkpoint resumes with the same FP8 options (another recipe is
    refused, naming the field)."""
    plugin = AmpfxPrecision("bf16", fp8="tensorwise", fp8_modules=("net.0",))
    amp, trainer = fit(tmp_path / "a", plugins=[plugin])
    bf16, _ = fit(tmp_path / "bf16", plugins=[AmpfxPrecision("bf16")])
    report = trainer.precision_plugin.report
    decided = {r.module: r.fp8 for r in report.records if r.fp8 is not None}
    assert decided["net.0"].output and decided["net.0"].rule == "fp8:forced"
    assert not decided["net.3"].output  # the last linear layer stays bf16
    assert amp.losses[-1] < 0.8 * amp.losses[0] and abs(amp.losses[-1] - bf16.losses[-1]) < 0.05
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)["AmpfxPrecision"]["policy"]
    assert saved["fp8"] == "tensorwise" and saved["fp8_modules"] == ["net.0"]
    _, again = fit(tmp_path / "b", epochs=4, plugins=[AmpfxPrecision.from_checkpoint(ckpt)], ckpt_path=ckpt)
    assert again.current_epoch == 4
    with pytest.raises(PolicyMismatchError, match="fp8"):
        fit(tmp_path / "c", epochs=4, plugins=[AmpfxPrecision("bf16", fp8="rowwise", fp8_modules=("net.0",))],
            ckpt_path=ckpt)


def test_a_plan_with_no_gemm_low_is_said_through_the_plugin(tmp_path, monkeypatch):
    """Rule: where ampfx's plan keeps every GEMM float32 (a break-even above them), training through the plugin
    warns so, with the switch, and the report's summary says it: the trainer's 'bf16-mixed' is not taken for a
    bfloat16 run."""
    monkeypatch.setenv("AMPFX_GEMM_MIN_FLOPS", str(10 ** 12))
    with pytest.warns(UserWarning, match=r"no GEMM runs in bfloat16.*AMPFX_GEMM_MIN_FLOPS=0"):
        _, trainer = fit(tmp_path, epochs=1, plugins=[AmpfxPrecision("bf16")])
    assert "no GEMM runs in bfloat16" in trainer.precision_plugin.report.summary()
