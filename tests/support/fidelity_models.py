"""Small models of the families issue #16 names, and the fidelity measurement both
``tests/test_fidelity.py`` and ``benchmarks/fidelity.py`` use.

Each family is a function ``family(seed=0) -> (model, inputs, loss_fn)``: the weights come from a
fixed seed (the same model for every ``seed``), the batch from ``seed``, and ``loss_fn(output)``
is a scalar (targets closed over). No dropout; every model is tiny (CPU, well under a second a step).

:func:`measure_fidelity` runs one family through float32, ``ampfx.convert`` (default policy and
each fidelity switch of :class:`ampfx.Policy` off, where the policy has it) and ``torch.autocast``
(loss inside the region), on the same weights and batches, and returns one :class:`Fidelity` per
variant: the output error and the worst parameter-gradient error against float32, averaged over
the batches, and the casts and bytes of one training step (forward + backward).

>>> model, inputs, loss_fn = small_norm()
>>> loss_fn(model(*inputs)).shape
torch.Size([])
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

import ampfx
from ampfx.tools.measure import measure_step
from ampfx.state import kept_buffers

WEIGHT_SEED = 0
"""Every family builds its weights from this seed, so all batches see one model."""


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU random state seeded, and put the caller's state back after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _gpt_init(model: nn.Module) -> nn.Module:
    """GPT-2's initialisation: N(0, 0.02) weights and embeddings, zero biases (LayerNorms: 1, 0)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    return model


# ----------------------------------------------------------------------------- pre-LN GPT
class CausalSelfAttention(nn.Module):
    """Causal attention written out: matmul, scale, ``masked_fill(-inf)``, softmax, matmul."""

    def __init__(self, d: int, heads: int, t_max: int):
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.register_buffer("future", torch.triu(torch.ones(t_max, t_max, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        hd = self.d // self.heads
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        y = scores.softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, self.d))


class PreLNBlock(nn.Module):
    def __init__(self, d: int, heads: int, t_max: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, t_max)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LayerNorm, LM head."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, t_max: int = 16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t_max, d)
        self.blocks = nn.ModuleList(PreLNBlock(d, heads, t_max) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(seed: int = 0):
    """Pre-LN GPT (2 blocks, d=32, T=16, vocab 64), next-token cross-entropy."""
    with _seeded(WEIGHT_SEED):
        model = _gpt_init(TinyGPT())
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 64, (4, 17), generator=g)
    return model, (tokens[:, :-1],), lambda logits: F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))


# ----------------------------------------------------------------------------- post-LN encoder
class PostLNLayer(nn.Module):
    """BERT's layer: attention with an additive float mask, LayerNorm after each residual add."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        hd = self.d // self.heads
        q, k, v = (z.view(b, t, self.heads, hd).transpose(1, 2) for z in self.qkv(x).split(self.d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd) + mask
        y = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, self.d)
        x = self.ln1(x + self.proj(y))
        return self.ln2(x + self.out(F.gelu(self.fc(x))))


class TinyBert(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 2, t_max: int = 16):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t_max, d)
        self.ln_emb = nn.LayerNorm(d)
        self.layers = nn.ModuleList(PostLNLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.ln_emb(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def bert(seed: int = 0):
    """Post-LN encoder (2 layers, d=32, T=16); padded rows masked by an additive float mask
    (0 / -10000, shape (B, 1, 1, T)); token-classification cross-entropy on the real tokens."""
    with _seeded(WEIGHT_SEED):
        model = _gpt_init(TinyBert())
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 16), generator=g)
    lengths = torch.tensor([16, 12, 9, 5])
    keep = torch.arange(16)[None, :] < lengths[:, None]
    mask = torch.where(keep, 0.0, -10000.0)[:, None, None, :]
    labels = torch.where(keep, torch.randint(0, 64, (4, 16), generator=g), -100)
    return model, (ids, mask), lambda logits: F.cross_entropy(logits.reshape(-1, 64), labels.reshape(-1))


# ----------------------------------------------------------------------------- ResNet blocks
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.down(x))


def resnet(seed: int = 0):
    """Stem conv + BN, two basic blocks (the second strided, with a 1x1 projection), pooling, a
    linear classifier; training mode (batch statistics), cross-entropy."""
    with _seeded(WEIGHT_SEED):
        model = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                              BasicBlock(16, 16, 1), BasicBlock(16, 32, 2),
                              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g)
    return model, (x,), lambda logits: F.cross_entropy(logits, y)


# ----------------------------------------------------------------------------- iterative refinement
class Refine(nn.Module):
    """RAFT-like: coordinates in pixel units from arange/meshgrid, ``coords = coords + delta`` for
    ``iters`` steps, each step reading features at ``coords`` through ``grid_sample``; the output
    is the flow ``coords - coords0``."""

    def __init__(self, feat: int = 8, iters: int = 4):
        super().__init__()
        self.iters = iters
        self.encode = nn.Conv2d(3, feat, 3, 1, 1)
        self.update = nn.Conv2d(2 * feat + 2, 2, 3, 1, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b, h, w = img.shape[0], img.shape[2], img.shape[3]
        feat = torch.tanh(self.encode(img))
        ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32),
                                indexing="ij")
        coords0 = torch.stack([xs, ys], dim=0)[None].expand(b, 2, h, w)
        coords = coords0
        for _ in range(self.iters):
            grid = torch.stack([coords[:, 0] / (w - 1), coords[:, 1] / (h - 1)], dim=-1) * 2 - 1
            sampled = F.grid_sample(feat, grid, align_corners=True)
            coords = coords + self.update(torch.cat([sampled, feat, coords - coords0], dim=1))
        return coords - coords0


def refine(seed: int = 0):
    """The refinement net on 2 images of 128 x 128 pixels (coordinates up to 127); MSE to a
    random smooth flow."""
    with _seeded(WEIGHT_SEED):
        model = Refine()
    g = torch.Generator().manual_seed(seed)
    img = torch.randn(2, 3, 128, 128, generator=g)
    target = F.interpolate(torch.randn(2, 2, 8, 8, generator=g), size=(128, 128), mode="bilinear")
    return model, (img,), lambda flow: F.mse_loss(flow, target)


# ----------------------------------------------------------------------------- SSM scan
class SelectiveScan(nn.Module):
    """Mamba-style selective scan, unrolled: ``h = exp(dt*A) * h + dt * B * x``, ``y = (C*h).sum(-1)``."""

    def __init__(self, d_model: int = 16, d_inner: int = 16, n: int = 8, steps: int = 16):
        super().__init__()
        self.n, self.steps = n, steps
        self.inp = nn.Linear(d_model, d_inner)
        self.dt = nn.Linear(d_inner, d_inner)
        self.bc = nn.Linear(d_inner, 2 * n, bias=False)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.out = nn.Linear(d_inner, d_model)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.inp(u))
        dt = F.softplus(self.dt(x))
        b_, c_ = self.bc(x).split(self.n, dim=-1)
        a = -torch.exp(self.a_log)
        h = torch.zeros(u.shape[0], x.shape[2], self.n)
        ys = []
        for t in range(self.steps):
            dt_t = dt[:, t, :, None]
            h = torch.exp(dt_t * a) * h + dt_t * b_[:, t, None, :] * x[:, t, :, None]
            ys.append((c_[:, t, None, :] * h).sum(-1))
        return self.out(torch.stack(ys, dim=1))


def _mse_case(build: Callable[[], nn.Module], shape: tuple[int, ...], seed: int,
              output: Callable[[Any], torch.Tensor] = lambda out: out):
    """``build()`` under the weight seed, an input and a random target of ``shape`` from ``seed``, and
    the MSE of ``output(model's output)`` to the target."""
    with _seeded(WEIGHT_SEED):
        model = build()
    g = torch.Generator().manual_seed(seed)
    x, target = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    return model, (x,), lambda out: F.mse_loss(output(out), target)


def ssm(seed: int = 0):
    """The scan over 16 steps (batch 4, width 16, state 8); MSE to a random target."""
    return _mse_case(SelectiveScan, (4, 16, 16), seed)


# ----------------------------------------------------------------------------- positions
class Positions(nn.Module):
    """``pos = arange(T, dtype=float32)`` plus a GEMM output in (0.25, 0.75), then ``.long()``: the
    index is the position whatever the GEMM's rounding, if the add is exact. The indices select
    rows of a position table (1024 rows, as a model for sequences up to 1024 has); the model
    returns the output and the indices."""

    def __init__(self, d: int = 16, rows: int = 1024):
        super().__init__()
        self.off, self.mix, self.head = nn.Linear(d, 1), nn.Linear(d, d), nn.Linear(d, d)
        self.table = nn.Embedding(rows, d)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(x.shape[1], dtype=torch.float32)
        idx = (pos + (0.5 + 0.25 * torch.tanh(self.off(x)).squeeze(-1))).long()
        return self.head(self.table(idx) + self.mix(x)), idx


def positions(seed: int = 0):
    """T = 600 positions, batch 2, width 16; MSE on the output (the indices carry no gradient)."""
    return _mse_case(Positions, (2, 600, 16), seed, output=lambda out: out[0])


# ----------------------------------------------------------------------------- small norm
class SmallNorm(nn.Module):
    """A LayerNorm over 3 features between GEMMs (ill-conditioned: its gradient is a difference
    of nearly equal terms)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.norm = nn.Linear(d, 3), nn.LayerNorm(3)
        self.fc2, self.fc3 = nn.Linear(3, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(self.norm(self.fc1(x)))))


def small_norm(seed: int = 0):
    """Batch 8 x 4 tokens x width 16; MSE to a random target."""
    return _mse_case(SmallNorm, (8, 4, 16), seed)


# ----------------------------------------------------------------------------- layer scale
class LayerScale(nn.Module):
    """timm's ``LayerScale``: ``x * gamma``, ``gamma`` a float32 parameter per channel."""

    def __init__(self, d: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((d,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ScaledBlock(nn.Module):
    """A pre-LN block with layer scale (CaiT, DeiT-III, ConvNeXt's ``gamma``): ``x + gamma * branch(norm(x))``,
    once through timm's module (``x * gamma``) and once written out (``gamma * x``)."""

    def __init__(self, d: int, heads: int, init: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ls1 = LayerScale(d, init)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.gamma2 = nn.Parameter(torch.full((d,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.ls1(self.attn(h, h, h, need_weights=False)[0])
        return x + self.gamma2 * self.out(F.gelu(self.fc(self.ln2(x))))


class LayerScaleViT(nn.Module):
    """Patch embedding (a linear over flattened patches: the residual stream starts as a GEMM's output, as
    after ConvNeXt's downsampling convolutions), layer-scaled blocks in an ``nn.Sequential`` (timm's), a
    final LayerNorm, a classifier over the mean token."""

    def __init__(self, patch: int = 48, d: int = 32, heads: int = 2, layers: int = 3, init: float = 0.1,
                 classes: int = 10):
        super().__init__()
        self.embed = nn.Linear(patch, d)
        self.blocks = nn.Sequential(*(ScaledBlock(d, heads, init) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(patches))).mean(1))


def layer_scale(seed: int = 0):
    """The layer-scale ViT (3 blocks, d=32, 16 patches of 48 values, gamma 0.1); cross-entropy over 10
    classes, batch 8."""
    with _seeded(WEIGHT_SEED):
        model = LayerScaleViT()
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, 48, generator=g), torch.randint(0, 10, (8,), generator=g)
    return model, (x,), lambda logits: F.cross_entropy(logits, y)


FAMILIES: dict[str, Callable[..., tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]]] = {
    "gpt": gpt, "bert": bert, "resnet": resnet, "refine": refine, "ssm": ssm, "positions": positions,
    "small_norm": small_norm, "layer_scale": layer_scale,
}
"""Every family, by the name the tables and tests use."""


# ============================================================================= measurement
FIDELITY_SWITCHES = ("float32_stream", "float32_operands", "exact_values", "small_norm", "float32_small_norm")
"""Policy switches of issue #16 (bool, default True); each one the policy has gets an "off" variant."""
NOT_FIDELITY = frozenset({"keep_output_dtype", "probe", "disable"})
"""Bool fields of Policy that are not fidelity rules; any other bool field defaulting to True is
taken for one (the lead may name the small-norm switch differently)."""


def fidelity_switches() -> tuple[str, ...]:
    """The fidelity switches :class:`ampfx.Policy` has on this branch (none before issue #16's rules).

    >>> set(fidelity_switches()) <= {f.name for f in dataclasses.fields(ampfx.Policy)}
    True
    """
    found = [n for n in FIDELITY_SWITCHES if n in {f.name for f in dataclasses.fields(ampfx.Policy)}]
    found += [f.name for f in dataclasses.fields(ampfx.Policy)
              if f.default is True and f.name not in NOT_FIDELITY and f.name not in found]
    return tuple(found)


Run = Callable[[tuple, Callable[[Any], torch.Tensor]], tuple[Any, torch.Tensor]]
"""``run(inputs, loss_fn) -> (output, loss)``: one forward and the loss, ready for backward."""


def _float32(model: nn.Module, dtype: torch.dtype, example: tuple) -> Run:
    def run(inputs, loss_fn):
        out = model(*inputs)
        return out, loss_fn(out)
    return run


def _autocast(model: nn.Module, dtype: torch.dtype, example: tuple) -> Run:
    def run(inputs, loss_fn):
        with torch.autocast("cpu", dtype=dtype):  # the loss inside the region, as the autocast recipe has it
            out = model(*inputs)
            return out, loss_fn(out)
    return run


def _ampfx(**options: Any) -> Callable[[nn.Module, torch.dtype, tuple], Run]:
    def prepare(model: nn.Module, dtype: torch.dtype, example: tuple) -> Run:
        amp = ampfx.convert(model, dtype, example_inputs=example, **options)

        def run(inputs, loss_fn):
            out = amp(*inputs)
            return out, loss_fn(out)
        return run
    return prepare


def variants(switches: bool = True) -> dict[str, Callable[[nn.Module, torch.dtype, tuple], Run]]:
    """``name -> prepare(model, dtype, example_inputs) -> run``: ampfx by default, ampfx with each
    fidelity switch off (with ``switches``), torch.autocast. float32 is the reference, always run."""
    out = {"ampfx": _ampfx()}
    if switches:
        out.update({f"ampfx {name}=False": _ampfx(**{name: False}) for name in fidelity_switches()})
        if len(fidelity_switches()) > 1:  # TF-AMP's painting alone: the plan before issue #16's rules
            out["ampfx all off"] = _ampfx(**{name: False for name in fidelity_switches()})
    out["autocast"] = _autocast
    return out


@dataclass(frozen=True)
class Fidelity:
    """One variant of one family at one dtype, against float32 on the same weights and batches.

    ``out_err``: relative L2 error of the float outputs (``||y - y32|| / ||y32||``), mean over the
    batches. ``grad_err``: per parameter ``||g - g32|| / ||g32||``, mean over the batches, worst
    parameter (``grad_param``); parameters whose float32 gradient is zero or absent are left out, and
    a missing gradient counts as error 1. ``wrong``: entries of integer outputs (indices) that differ
    from float32's, over all batches. ``casts``, ``cast_mb``, ``mb_written``: one forward + backward
    (:func:`ampfx.tools.measure.measure_step`). ``failed``: the exception, when the variant could not run.
    """

    family: str
    dtype: torch.dtype
    variant: str
    out_err: float = math.inf
    grad_err: float = math.inf
    grad_param: str = ""
    wrong: int = 0
    casts: int = 0
    cast_mb: float = 0.0
    mb_written: float = 0.0
    batches: int = 0
    failed: str = ""


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64; NaN becomes inf (worse than any finite error)."""
    want = want.detach().double()
    err = (got.detach().double() - want).norm().item()
    scale = want.norm().item()
    value = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    return math.inf if math.isnan(value) else value


def _leaves(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The float and the non-float tensors of an output, each in order."""
    tensors = [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
    return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]


@dataclass(frozen=True)
class _Step:
    floats: list
    ints: list
    grads: dict


def _step(run: Run, model: nn.Module, inputs: tuple, loss_fn: Callable) -> _Step:
    """One forward + backward; the gradients of the model's parameters (taken, not accumulated);
    buffers (batch-norm statistics) put back, so every variant starts from the same state."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with kept_buffers(model):
        out, loss = run(inputs, loss_fn)
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    floats, ints = _leaves(out)
    return _Step(floats, ints, {n: g for (n, _), g in zip(named, grads)})


def _errors(steps: list[_Step], refs: list[_Step]) -> tuple[float, float, str, int]:
    """(mean output error, worst mean parameter-gradient error, that parameter, wrong integer entries)."""
    out_err = sum(_rel(torch.cat([t.flatten() for t in s.floats]), torch.cat([t.flatten() for t in r.floats]))
                  for s, r in zip(steps, refs)) / len(refs)
    wrong = 0
    for s, r in zip(steps, refs):
        for got, want in zip(s.ints, r.ints):
            wrong += int((got != want).sum()) if got.shape == want.shape else want.numel()
    per_param: dict[str, list[float]] = {}
    for s, r in zip(steps, refs):
        for name, want in r.grads.items():
            if want is None or not want.abs().sum() > 0:
                continue  # float32 gives this parameter no gradient on this batch
            got = s.grads.get(name)
            per_param.setdefault(name, []).append(1.0 if got is None else _rel(got, want))
    means = {name: sum(v) / len(v) for name, v in per_param.items()}
    worst = max(means, key=means.get, default="")
    return out_err, means.get(worst, 0.0), worst, wrong


def _measured(name: str, dtype: torch.dtype, label: str, run: Run, model: nn.Module, batches: list,
              refs: list[_Step] | None) -> tuple[Fidelity, list[_Step]]:
    """Run every batch (the first one counted by ``measure_step``); errors against ``refs``."""
    steps: list[_Step] = []
    counter = measure_step(lambda: steps.append(_step(run, model, *batches[0])))
    steps += [_step(run, model, *b) for b in batches[1:]]
    cost = dict(casts=counter.count, cast_mb=counter.bytes / 2**20, mb_written=counter.written / 2**20)
    if refs is None:
        return Fidelity(name, dtype, label, 0.0, 0.0, "", 0, batches=len(batches), **cost), steps
    out_err, grad_err, param, wrong = _errors(steps, refs)
    return Fidelity(name, dtype, label, out_err, grad_err, param, wrong, batches=len(batches), **cost), steps


def measure_fidelity(name: str, dtype: torch.dtype, *, batches: int = 3, switches: bool = True) -> list[Fidelity]:
    """float32, then every variant of :func:`variants`, on family ``name`` at ``dtype``, over
    ``batches`` batches (seeds 0, 1, ...) of one model; a variant that raises gets ``failed``.

    >>> rows = measure_fidelity("small_norm", torch.bfloat16, batches=1, switches=False)
    >>> [r.variant for r in rows], rows[0].out_err
    (['float32', 'ampfx', 'autocast'], 0.0)
    """
    family = FAMILIES[name]
    model, example, _ = family(0)
    model.train()
    data = [family(seed)[1:] for seed in range(batches)]
    ref_row, refs = _measured(name, dtype, "float32", _float32(model, dtype, example), model, data, None)
    rows = [ref_row]
    for label, prepare in variants(switches).items():
        try:
            row, _ = _measured(name, dtype, label, prepare(model, dtype, example), model, data, refs)
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is a row of the table
            row = Fidelity(name, dtype, label, batches=batches, failed=f"{type(e).__name__}: {e}"[:200])
        rows.append(row)
    return rows


FACTOR_OUT, FACTOR_GRAD = 1.5, 2.0
"""Issue #16's bounds: ampfx's output error <= 1.5 x autocast's, worst gradient error <= 2 x."""
FLOOR = 1e-6
"""Absolute slack added to each bound. It matters only where both errors are ~0, i.e. both ran the
value in float32: then they differ from float32's run by float32 roundings of reordered sums
(a few units of 2**-24 ~ 6e-8), and a ratio of two such numbers means nothing."""


def verdict(ampfx_row: Fidelity, autocast_row: Fidelity) -> tuple[bool, str]:
    """Whether ``ampfx_row`` is within the bounds of issue #16 against ``autocast_row``, and a line
    saying by how much (the ratios ampfx / autocast)."""
    if ampfx_row.failed:
        return False, f"ampfx failed: {ampfx_row.failed}"
    if autocast_row.failed:
        return True, f"autocast failed ({autocast_row.failed}); nothing to compare"
    out_ok = ampfx_row.out_err <= FACTOR_OUT * autocast_row.out_err + FLOOR
    grad_ok = ampfx_row.grad_err <= FACTOR_GRAD * autocast_row.grad_err + FLOOR
    ok = out_ok and grad_ok and ampfx_row.wrong <= autocast_row.wrong

    def ratio(a: float, b: float) -> str:
        return f"{a / b:.2f}x" if b > 0 else ("1x (both 0)" if a == 0 else "inf")
    text = (f"out {ratio(ampfx_row.out_err, autocast_row.out_err)} (<= {FACTOR_OUT}x: {out_ok}), "
            f"grad {ratio(ampfx_row.grad_err, autocast_row.grad_err)} (<= {FACTOR_GRAD}x: {grad_ok}), "
            f"wrong indices {ampfx_row.wrong} vs {autocast_row.wrong}")
    return ok, text
