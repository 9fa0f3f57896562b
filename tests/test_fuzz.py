"""Fuzz: seeded random graphs through every check of :func:`fuzzgraphs.run_case`.

Each case is a random DAG of 5-30 ops (GEMMs, convolutions, norms, reductions, softmax,
elementwise, views, concatenation, embedding, pooling, dropout) with random ``convert``
options (``pad``, ``dynamic_dims``, list edits, ``fp32_modules``, tracer, training mode) in
bfloat16 or float16. A failure prints the model's source and the options. The long run is
``python benchmarks/fuzz.py --n 2000`` (figures in docs/fuzz.md).
"""
import pytest
import torch
import torch.nn as nn

import ampfx
import fuzzgraphs as fg

N_CI = 200


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: one intra-op thread (two threads on a busy two-core machine make a small conv 100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("seed", range(N_CI))
def test_random_graph(seed):
    """Convert succeeds, lint passes, the report's dtypes are the dtypes the nodes produce, outputs and
    gradients are finite where float32's are, the error against float32 is within FACTOR x autocast's
    + FLOOR, and another batch size and sequence length give the right values (or, for a dimension
    not in dynamic_dims, a clear ampfx error)."""
    outcome = fg.run_case(fg.generate(seed))
    if outcome.failures:
        cause = fg.known_cause(outcome)
        if cause is not None:
            pytest.xfail(cause)
    assert not outcome.failures, outcome.message()

