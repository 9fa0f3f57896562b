"""Why ``pow`` stays float32 under float16: ``python benchmarks/pow_fidelity.py`` (the models lane:
transformers installed; ``bash scripts/test-models.sh`` makes ``.venv-models``).

The coverage run's GPT-2 (``hf_gpt2_lm_nocache``, tiny config, random init, training mode) with the
first block's MLP input weights scaled up, so its tanh-GELU (``x + 0.044715 * x**3``) sees
pre-activations from 1 to a few hundred, as outlier features reach in trained LMs. For each scale, one
training step's gradients (same dropout masks) against float32's: ampfx float16 (``pow`` denied, the
GELU polynomial in float32), ampfx float16 with ``pow`` taken off the deny list (``LOW_POW``: the same
plan but for ``pow``) and CPU ``torch.autocast`` float16 (``pow`` in float16). It prints the
largest pre-activation, how many gradient entries are not finite, and max |g - g32| / max |g32|.
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ampfx  # noqa: E402
from coverage import build, call, loss_of  # noqa: E402

SCALES = (1, 40, 100, 200, 400)
LOW_POW = {"AMPFX_DENYLIST_REMOVE": "pow", "AMPFX_INFERLIST_ADD": "pow"}  # autocast's plan for pow, nothing else


def gradients(model, net, inp, spec, autocast=False):
    """One step's gradients of ``net``'s parameters, run through ``model`` (dropout seeded)."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
        loss = loss_of(call(model, inp), spec)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in net.parameters() if p.grad is not None])


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net, inp, spec = build("hf_gpt2_lm_nocache")
    net.train()
    fc = net.transformer.h[0].mlp.c_fc
    print(f"torch {torch.__version__}; GPT-2 tiny, float16, one training step")
    print("| weight scale | max pre-GELU | non-finite grads ampfx / ampfx, pow float16 / autocast "
          "| grad error ampfx / ampfx, pow float16 / autocast |")
    print("|---|---|---|---|")
    done = 1
    for scale in SCALES:
        with torch.no_grad():
            fc.weight.mul_(scale / done)
        done = scale
        seen = {}
        hook = fc.register_forward_hook(lambda mod, args, out: seen.update(max=out.abs().max().item()))
        want = gradients(net, net, inp, spec)
        hook.remove()
        amp = ampfx.convert(net, torch.float16, example_inputs=inp)
        low_pow = ampfx.convert(net, torch.float16, example_inputs=inp, environ=LOW_POW)
        got, ac = gradients(amp, net, inp, spec), gradients(net, net, inp, spec, autocast=True)
        got_low = gradients(low_pow, net, inp, spec)

        def err(g):
            return ((g - want).abs().max() / want.abs().max()).item()

        runs = (got, got_low, ac)
        print(f"| {scale} | {seen['max']:.0f} | " + " / ".join(str((~torch.isfinite(g)).sum().item()) for g in runs)
              + " | " + " / ".join(f"{err(g):.3g}" for g in runs) + " |", flush=True)


if __name__ == "__main__":
    main()
