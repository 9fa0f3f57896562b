import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

DTYPES = [torch.bfloat16, torch.float16]


def rel(got, want):
    """Relative L2 error of ``got`` against ``want`` (both taken as float32)."""
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def rel_err(got, want):
    """Largest absolute error of ``got`` against ``want``, relative to ``want``'s largest magnitude."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.fixture(autouse=True)
def _seeded():
    """Every test starts from the same random state (the AMPFX_* variables are cleared by the root conftest)."""
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny tensors: one intra-op thread (two threads on a busy two-core machine make a small conv 100x
    slower). Modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
