"""Models that converted into a crash, or into an error that named the wrong cause: each now gives the
model's result, or an ampfx error naming the real cause and a fix that works."""
import inspect

import pytest
import torch
import torch.nn as nn

import ampfx
from ampfx.errors import GuardError
from conftest import rel


# -- optional non-tensor arguments fixed while tracing -------------------------------------------------------------

class Flag(nn.Module):
    """Python control flow on a bool argument, and a tuple argument read by index."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(s, x, flag=False, mix=(0.5, 0.5)):  # noqa: N805 - not called self: torch.fx's pytree code broke on it
        y = s.l(x)
        if flag:
            y = y * mix[0]
        return y * mix[1]


@pytest.mark.parametrize("tracer", ["auto", "fx"])
def test_fixed_container_and_bool_defaults_convert_and_are_guarded(tracer):
    """Arguments torch.fx fixed at their defaults, a tuple among them, keep forward's signature (one
    argument each, with its default, in forward's order): calls at those values, by position or
    keyword, give the model's result; any other value raises GuardError naming the argument and the fix,
    never a graph built for the defaults."""
    model, x = Flag(), torch.randn(3, 4)
    amp = ampfx.convert(model, example_inputs=(x,), tracer=tracer)
    assert amp.ampfx_report.regions[0].method == "fx, optional arguments fixed"
    params = inspect.signature(amp.forward).parameters
    assert [(p.name, p.default) for p in params.values()][1:] == [("flag", False), ("mix", (0.5, 0.5))]
    want = model(x)
    for args, kwargs in [((x,), {}), ((x, False), {}), ((x, False, (0.5, 0.5)), {}),
                         ((x,), {"mix": (0.5, 0.5)}), ((), {"x": x, "flag": False, "mix": (0.5, 0.5)})]:
        assert rel(amp(*args, **kwargs), want) < 0.03, (args, kwargs)
    for args, kwargs, name in [((x,), {"flag": True}, "flag"), ((x, True), {}, "flag"),
                               ((x,), {"mix": (0.1, 0.9)}, "mix"), ((x, False, (0.1, 0.9)), {}, "mix")]:
        with pytest.raises(GuardError, match=rf"input {name} .*fixed it while tracing.*example_inputs that give {name}"):
            amp(*args, **kwargs)
