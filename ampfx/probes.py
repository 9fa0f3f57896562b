"""Device capability probes: does a tiny instance of an op run in the low dtype here?

Some kernels have no low-precision (or no mixed-dtype) version on some
devices; for example oneDNN's bf16 LSTM needs AVX-512 on x86 CPUs. Before the
policy assigns a low dtype to such an op, :func:`check` runs a tiny forward
and backward of it on the target device, once per process, and returns the
error text if it fails (the op then stays float32 and the report says why).

>>> check("layer_norm", torch.bfloat16, "cpu") is None
True
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def _norm(fn: Callable, shape: tuple, affine: int) -> Callable:
    def run(dtype: torch.dtype, device: str) -> torch.Tensor:
        x = torch.randn(*shape, device=device).to(dtype).requires_grad_()
        w = torch.ones(affine, device=device, requires_grad=True)
        return fn(x, w)
    return run


def _rnn(cls: type, cell: bool) -> Callable:
    def run(dtype: torch.dtype, device: str) -> torch.Tensor:
        m = cls(4, 4).to(device=device, dtype=dtype)
        x = torch.randn(*((2, 4) if cell else (3, 2, 4)), device=device, dtype=dtype, requires_grad=True)
        out = m(x)
        return out[0] if isinstance(out, tuple) else out
    return run


PROBES: dict[str, Callable[[torch.dtype, str], torch.Tensor]] = {
    "batch_norm": _norm(lambda x, w: F.batch_norm(x, torch.zeros_like(w), torch.ones_like(w), w, w * 0, True),
                        (4, 3, 2, 2), 3),
    "layer_norm": _norm(lambda x, w: F.layer_norm(x, (3,), w, w * 0), (2, 3), 3),
    "group_norm": _norm(lambda x, w: F.group_norm(x, 1, w, w * 0), (2, 3, 4), 3),
    "rms_norm": _norm(lambda x, w: F.rms_norm(x, (3,), w), (2, 3), 3) if hasattr(F, "rms_norm") else None,
    "lstm": _rnn(nn.LSTM, False),
    "gru": _rnn(nn.GRU, False),
    "rnn": _rnn(nn.RNN, False),
    "lstm_cell": _rnn(nn.LSTMCell, True),
    "gru_cell": _rnn(nn.GRUCell, True),
    "rnn_cell": _rnn(nn.RNNCell, True),
}


@functools.lru_cache(maxsize=None)
def check(kind: str, dtype: torch.dtype, device: str) -> str | None:
    """``None`` if probe ``kind`` runs forward and backward in ``dtype`` on
    ``device``, else the error text. Cached per process."""
    probe = PROBES.get(kind)
    if probe is None:
        return None
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe(dtype, device).float().sum().backward()
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return None
