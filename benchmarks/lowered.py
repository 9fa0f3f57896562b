"""What calling a converted graph's torch ops through their C++ handles saves (not a test): figures, printed.

fx writes a captured graph's op as ``torch.ops.aten.mm.default(x, y)``, and each such call runs
``OpOverload.__call__``, a Python frame, before the op's C++ handle; ampfx runs the graph's code with each op bound
to its handle (:mod:`ampfx.runtime.lowered`). This script converts each model once and times its forward (no
gradients) and a training step (forward, a float32 loss, backward, SGD) with fx's code and with the bound code,
switched in the same converted module, interleaved, median of ``--reps`` rounds; CPU, one thread. Only graphs
captured by ``torch.export`` (or holding ``torch.ops`` calls) have ops to bind; a model without any prints so.

Needs the models lane's environment (the models of ``benchmarks/step_time.py``):

    .venv-models/bin/python benchmarks/lowered.py [--models hf_bert_seqcls,hf_t5_nocache] [--reps 9]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

DEFAULT = "hf_bert_seqcls,hf_distilbert,hf_t5_nocache,nn_transformer,hf_bart_nocache,hf_whisper"


def _slots(amp):
    """``(class, attribute, bound forward)`` of every converted graph module whose code binds ops."""
    from ampfx.runtime.graph_module import AmpGraphModule
    out = []
    for m in amp.modules():
        if not isinstance(m, AmpGraphModule):
            continue
        cls = type(m)
        slot = "_ampfx_graph_forward" if "_ampfx_graph_forward" in cls.__dict__ else "forward"
        fn = getattr(cls, slot)
        if hasattr(fn, "_ampfx_plain"):
            out.append((cls, slot, fn))
    return out


def measure(name: str, reps: int) -> str:
    import torch

    import ampfx
    import step_time
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs, spec = step_time.build(name)
    model.train()
    amp = ampfx.convert(model, "bf16", example_inputs=inputs)
    slots = _slots(amp)
    graphs = sum(1 for m in amp.modules() if isinstance(m, ampfx.runtime.graph_module.AmpGraphModule))
    if not slots:
        return f"{name:24s} {graphs} graphs, none with torch.ops calls to bind"

    def use(bound: bool) -> None:
        for cls, slot, fn in slots:
            setattr(cls, slot, fn if bound else fn._ampfx_plain)

    def forward() -> None:
        with torch.no_grad():
            step_time.call(amp, inputs)

    step = step_time.training_step(amp, model, inputs, spec)
    times: dict[tuple[str, bool], list[float]] = {}
    for _ in range(reps):
        for bound in (False, True):
            use(bound)
            for what, fn, n in (("forward", forward, 10), ("step", step, 3)):
                fn()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                times.setdefault((what, bound), []).append((time.perf_counter() - t0) / n * 1e3)
    use(True)
    med = {k: statistics.median(v) for k, v in times.items()}
    return (f"{name:24s} {len(slots)}/{graphs} graphs bound  forward {med['forward', False]:7.3f} -> "
            f"{med['forward', True]:7.3f} ms ({med['forward', True] / med['forward', False]:.3f}x)  step "
            f"{med['step', False]:7.3f} -> {med['step', True]:7.3f} ms ({med['step', True] / med['step', False]:.3f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT)
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    import torch
    print(f"fx's code -> ops bound to their handles; CPU, one thread, median of {args.reps}; torch {torch.__version__}, "
          f"python {sys.version.split()[0]}")
    for name in args.models.split(","):
        print(measure(name, args.reps), flush=True)


if __name__ == "__main__":
    main()
