"""Shared checks for the real-model lane (torch 2.14.1, torchvision, timm, transformers).

Every model is built from a config with random init: nothing is downloaded.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import ampfx

torch.set_num_threads(1)


def call(model: torch.nn.Module, inputs: Any) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def primary(out: Any) -> torch.Tensor:
    """The tensor to compare: a plain output, ``logits`` or ``last_hidden_state``."""
    if isinstance(out, torch.Tensor):
        return out
    for key in ("logits", "last_hidden_state"):
        value = getattr(out, key, None) if not isinstance(out, dict) else out.get(key)
        if value is not None:
            return value
    return primary(out[0])


@dataclass(repr=False)  # assertion messages stay short
class Outcome:
    amp: torch.nn.Module
    report: ampfx.Report
    rel_err: float  # eval-mode output vs float32, max |diff| / max |ref|
    casts_ampfx: int  # per training step (forward + backward)
    casts_autocast: int | None  # None: torch.autocast itself fails
    loss_fp32: float
    loss_amp: float
    delta: dict[str, torch.Tensor]  # parameter change of one SGD step taken through the converted model
    delta_fp32: dict[str, torch.Tensor]  # the same step taken in float32
    delta_autocast: dict[str, torch.Tensor] | None  # the same step under torch.autocast (None: it fails)


def run(model: torch.nn.Module, inputs: Any, loss_fn: Callable[[Any], torch.Tensor],
        dtype: torch.dtype = torch.bfloat16, **convert_kw: Any) -> Outcome:
    """Convert ``model``, take one SGD step through the result (on the original
    parameters), compare with float32 and count casts against torch.autocast."""
    torch.manual_seed(0)
    model.train()
    twin = copy.deepcopy(model)  # the float32 reference for the training step
    ac = copy.deepcopy(model)  # the same step under torch.autocast
    amp = ampfx.convert(model, dtype, example_inputs=inputs, **convert_kw)
    report = amp.ampfx_report

    model.eval()
    amp.eval()
    with torch.no_grad():
        ref = primary(call(model, inputs)).float()
        got = primary(call(amp, inputs)).float()
    rel_err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()

    model.train()
    amp.train()
    twin.train()

    def step_amp() -> None:
        loss_fn(call(amp, inputs)).backward()

    def step_autocast() -> None:
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(call(model, inputs))
        loss.backward()

    torch.manual_seed(1)
    casts_ampfx = ampfx.count_casts(step_amp)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    try:
        casts_autocast = ampfx.count_casts(step_autocast)
    except RuntimeError:
        casts_autocast = None
    model.zero_grad(set_to_none=True)

    # one optimizer step on the ORIGINAL model's parameters, driven through the converted module
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    loss_amp = loss_fn(call(amp, inputs))
    loss_amp.backward()
    opt.step()
    opt_twin = torch.optim.SGD(twin.parameters(), lr=0.1)
    torch.manual_seed(2)
    loss_fp32 = loss_fn(call(twin, inputs))
    loss_fp32.backward()
    opt_twin.step()
    delta_autocast = None
    if casts_autocast is not None:
        ac.train()
        torch.manual_seed(2)
        with torch.autocast("cpu", dtype=dtype):
            loss_ac = loss_fn(call(ac, inputs))
        loss_ac.backward()
        torch.optim.SGD(ac.parameters(), lr=0.1).step()
        delta_autocast = {n: p.detach() - before[n] for n, p in ac.named_parameters()}
    return Outcome(amp=amp, report=report, rel_err=rel_err, casts_ampfx=casts_ampfx,
                   casts_autocast=casts_autocast, loss_fp32=loss_fp32.item(), loss_amp=loss_amp.item(),
                   delta={n: p.detach() - before[n] for n, p in model.named_parameters()},
                   delta_fp32={n: p.detach() - before[n] for n, p in twin.named_parameters()},
                   delta_autocast=delta_autocast)


def _norm(ds: Any) -> float:
    return sum(float(d.norm() ** 2) for d in ds) ** 0.5


def step_error(delta: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """|delta - ref| / |ref| over all parameters."""
    return _norm(delta[n] - ref[n] for n in ref) / _norm(ref.values())


def assert_trains_like_fp32(o: Outcome, loss_tol: float = 0.05, step_tol: float = 0.1) -> None:
    """One SGD step taken through the converted module moved the ORIGINAL float32
    parameters as the same step in float32 moved a copy: within ``step_tol``, or
    within 1.25x of autocast's own distance from float32 where that is larger
    (at random init, a low-precision step of a deep batch-norm network is far
    from float32's whoever casts)."""
    assert abs(o.loss_amp - o.loss_fp32) <= loss_tol * max(abs(o.loss_fp32), 1.0), (o.loss_amp, o.loss_fp32)
    assert all(d.dtype == torch.float32 for d in o.delta.values())
    assert _norm(o.delta.values()) > 0, "the optimizer on the original parameters did not move them"
    err = step_error(o.delta, o.delta_fp32)
    bound = step_tol
    if o.delta_autocast is not None:
        bound = max(step_tol, 1.25 * step_error(o.delta_autocast, o.delta_fp32))
    assert err < bound, f"the step differs from float32's by {err:.3g} (bound {bound:.3g})"
