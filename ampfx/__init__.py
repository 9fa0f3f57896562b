"""ampfx: automatic mixed precision for PyTorch as a torch.fx graph rewrite.

>>> import torch, ampfx
>>> amp = ampfx.convert(torch.nn.Linear(4, 2), torch.bfloat16)
>>> amp.ampfx_report.by_node("linear").dtype
torch.bfloat16
"""
from . import libraries  # noqa: F401 - registers other libraries' op tables (imports no library)
from .tools.debug import debug
from .errors import NonFiniteError, PolicyError, TuneError
from .tools.measure import count_casts
from .api import convert
from .tools.compare import Comparison, ParamError, compare
from .tools.numerics import NodeSensitivity, SensitivityResult, sensitivity
from .ops import Category
from .policy import Policy
from .ops.registration import register_op
from .report import Report
from .report.records import CastInfo, Decision
from .tools.tune import TuneResult, tune
from .runtime import weight_cache
from .runtime.weight_cache import attach
from .integrations.dynamo import Backend, backend

__all__ = ["convert", "Policy", "PolicyError", "Category", "Decision", "CastInfo", "Report", "count_casts",
           "debug", "NonFiniteError",
           "compare", "Comparison", "ParamError",
           "sensitivity", "SensitivityResult", "NodeSensitivity",
           "tune", "TuneResult", "TuneError", "register_op", "attach", "weight_cache",
           "backend", "Backend"]
__version__ = "0.1.0"
