"""ampfx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

>>> import torch, ampfx
>>> amp = ampfx.convert(torch.nn.Linear(4, 2), torch.bfloat16)
>>> amp.ampfx_report.by_node("linear").dtype
torch.bfloat16

``import ampfx`` imports none of its modules (nor torch): each public name is imported at its first use
(PEP 562), so that the ``ampfx`` command answers ``--help`` and argument errors without torch, and what only
converting needs (sympy, torch.export, the passes) is imported when converting. The first public name used
also imports :mod:`ampfx.libraries`, which registers other libraries' op tables (``dgl.GATConv`` in a list).
A submodule is an attribute too (``ampfx.ops``), imported when first read.
"""
from importlib import import_module as _import_module, util as _util
import typing as _typing

_MODULES = {"weight_cache"}  # public names that are modules themselves

_PUBLIC = {  # public name -> the module defining it (or, for _MODULES, that module)
    "convert": "ampfx.api",
    "plan": "ampfx.api",
    "Plan": "ampfx.api",
    "Policy": "ampfx.policy",
    "PolicyError": "ampfx.errors",
    "Category": "ampfx.ops",
    "Decision": "ampfx.report.records",
    "CastInfo": "ampfx.report.records",
    "Report": "ampfx.report",
    "count_casts": "ampfx.tools.measure",
    "debug": "ampfx.tools.debug",
    "NonFiniteError": "ampfx.errors",
    "compare": "ampfx.tools.compare",
    "Comparison": "ampfx.tools.compare",
    "ParamError": "ampfx.tools.compare",
    "sensitivity": "ampfx.tools.numerics",
    "SensitivityResult": "ampfx.tools.numerics",
    "NodeSensitivity": "ampfx.tools.numerics",
    "tune": "ampfx.tools.tune",
    "TuneResult": "ampfx.tools.tune",
    "TuneError": "ampfx.errors",
    "register_op": "ampfx.ops.registration",
    "attach": "ampfx.runtime.weight_cache",
    "weight_cache": "ampfx.runtime.weight_cache",
    "backend": "ampfx.integrations.dynamo",
    "Backend": "ampfx.integrations.dynamo",
}

__all__ = list(_PUBLIC)
__version__ = "0.1.0"

if _typing.TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports each at its first use
    from .api import Plan, convert, plan
    from .errors import NonFiniteError, PolicyError, TuneError
    from .integrations.dynamo import Backend, backend
    from .ops import Category
    from .ops.registration import register_op
    from .policy import Policy
    from .report import Report
    from .report.records import CastInfo, Decision
    from .runtime import weight_cache
    from .runtime.weight_cache import attach
    from .tools.compare import Comparison, ParamError, compare
    from .tools.debug import debug
    from .tools.measure import count_casts
    from .tools.numerics import NodeSensitivity, SensitivityResult, sensitivity
    from .tools.tune import TuneResult, tune


def __getattr__(name: str) -> object:
    """A public name or a submodule, imported at its first use and kept as an attribute (PEP 562)."""
    if name in _PUBLIC:
        _import_module("ampfx.libraries")  # other libraries' op tables, before any name reads the lists
        module = _import_module(_PUBLIC[name])
        value = module if name in _MODULES else getattr(module, name)
    elif not name.startswith("_") and _util.find_spec(f"{__name__}.{name}") is not None:
        value = _import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What the module holds (the submodules imported so far among them) and every public name, imported or not."""
    return sorted({n for n in globals() if not n.startswith("_") or n.startswith("__")} | set(__all__))
