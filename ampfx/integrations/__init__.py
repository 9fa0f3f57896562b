"""The trainer integrations: PyTorch Lightning (:mod:`~ampfx.integrations.lightning`), Hugging Face
Accelerate (:mod:`~ampfx.integrations.accelerate`) and the Hugging Face Trainer (:mod:`~ampfx.integrations.hf`),
over a conversion made at the model's first call (:mod:`~ampfx.integrations.lazy`). Each imports its trainer
library only when it is imported itself. They sit above :func:`ampfx.convert` and use it as users do.

Other libraries' modules (DGL) are plugins of the conversion itself: :mod:`ampfx.libraries`
(``ampfx.integrations.dgl`` is that module, for code and saved modules that name it).
"""
