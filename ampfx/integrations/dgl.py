"""``ampfx.integrations.dgl`` is :mod:`ampfx.libraries.dgl` (the DGL plugin moved there, below the trainer
integrations): the same module object, for code and saved converted modules that name this path."""
import sys

from ..libraries import dgl as _dgl

sys.modules[__name__] = _dgl
