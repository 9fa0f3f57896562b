"""The names a user writes for the low-precision dtypes (``bf16``, ``half``, ...), in a module that imports
nothing, torch included: the ``ampfx`` command checks ``--dtype`` with them before it imports torch, and
:func:`ampfx.policy.names.parse_dtype` resolves them to torch's dtypes.

>>> LOW_DTYPES["half"], LOW_DTYPES["bf16"]
('float16', 'bfloat16')
"""
from __future__ import annotations

LOW_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "torch.bfloat16": "bfloat16",
              "fp16": "float16", "float16": "float16", "half": "float16", "torch.float16": "float16"}
"""A name as a user writes it, in lower case -> the attribute of ``torch`` that is its dtype."""
