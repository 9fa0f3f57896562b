"""Collection of ``ampfx/`` (doctests): the trainer integrations import their library at module level, so they
are left out where it is not installed (the core lane); the trainers lane (scripts/test-trainers.sh) tests them."""
import importlib.util

_NEEDS = {"ampfx/integrations/lightning.py": "pytorch_lightning", "ampfx/integrations/accelerate.py": "accelerate",
          "ampfx/integrations/hf.py": "transformers"}
collect_ignore = [path for path, library in _NEEDS.items() if importlib.util.find_spec(library) is None]
