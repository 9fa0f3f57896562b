"""What each rank runs (importable by spawned processes): a tiny GPT converted by ampfx, wrapped
one way, one training step on the rank's half of the batch; the loss and full gradients back."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import ampfx
from ampfx.integrations.fsdp import gather_low
from ampfx.runtime.fp8 import linear_fp8

BATCH, SEQ, VOCAB = 4, 8, 32


class Block(nn.Module):
    def __init__(self, d: int, p: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, d: int = 32, n: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d, p) for _ in range(n))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return idx, torch.roll(idx, -1, 1)


def converted(p: float = 0.0, **options: Any) -> nn.Module:
    torch.manual_seed(0)
    model = GPT(p=p)
    return ampfx.convert(model, torch.bfloat16, example_inputs=(data()[0][:2],), **options)


def loss_of(model: nn.Module, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(idx).float().flatten(0, 1), target.flatten())


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):
            g = g.full_tensor()  # FSDP2: a collective, bounded by the process group's timeout
        if g is not None:
            out[name.replace("._checkpoint_wrapped_module", "").replace("module.", "", 1)
                if name.startswith("module.") else name.replace("._checkpoint_wrapped_module", "")] = g.float()
    return out


FP8 = {"fp8": "tensorwise", "fp8_roofline": "none"}
"""The FP8 options the ``fp8_*`` runs convert with (every linear of the tiny model in FP8 but the first and last)."""


def reference(halves: int = 1, **options: Any) -> tuple[float, dict[str, torch.Tensor]]:
    """One step of the converted model (``options``: convert's) on the whole batch, in one process; with ``halves``,
    on each rank's part of it in turn, the gradients averaged as DDP and FSDP2 average them (FP8 scales each part by
    its own amax, as each rank does)."""
    model = converted(**options)
    idx, target = data()
    total = 0.0
    for rank in range(halves):
        part = slice(rank * BATCH // halves, (rank + 1) * BATCH // halves)
        loss = loss_of(model, idx[part], target[part]) / halves
        loss.backward()
        total += loss.item()
    return total, full_grads(model)


class Traffic(contextlib.AbstractContextManager):
    """Bytes each rank sends to FSDP2's all-gathers and reduce-scatters while inside."""

    def __enter__(self) -> "Traffic":
        self.gathered = self.scattered = 0
        self.saved = dist.all_gather_single, dist.reduce_scatter_single

        def sent(args: tuple, kwargs: dict, name: str) -> int:
            t = kwargs[name] if name in kwargs else args[1]
            return t.numel() * t.element_size()

        def gather(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.gathered += sent(a, k, "input_tensor")
            return self.saved[0](*a, **k)

        def scatter(*a, **k):  # noqa: ANN002, ANN003, ANN202
            self.scattered += sent(a, k, "input")
            return self.saved[1](*a, **k)

        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_gather_single, dist.reduce_scatter_single = self.saved


def step(rank: int, world: int, how: str) -> dict[str, Any]:
    """One step of the converted model wrapped as ``how`` on this rank's half of the batch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    fp8 = FP8 if how.startswith("fp8_") else {}  # "fp8_ddp": the same wrapper over FP8 linears
    how = how.removeprefix("fp8_")
    amp = converted(weight_cache=how not in ("ddp", "fsdp_low"), **fp8)  # plain DDP as by default; others the cache
    fp8_linears = sum(n.target is linear_fp8 for m in amp.modules() if isinstance(getattr(m, "graph", None), fx.Graph)
                      for n in m.graph.nodes)
    gathered = [str(d) for d in gather_low(amp)] if how == "fsdp_low" else []
    idx, target = data()
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    fired = []
    amp.blocks[1].register_forward_hook(lambda m, a, out: fired.append(out.dtype))
    if how.startswith("ac"):
        blocks = set(amp.blocks)
        apply_activation_checkpointing(amp, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: m in blocks)
    if how.endswith("ddp"):
        model = DDP(amp)
    else:
        mp_policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                          cast_forward_inputs=False) if how == "fsdp_mp" else MixedPrecisionPolicy())
        for block in amp.blocks:
            fully_shard(block, mp_policy=mp_policy)
        model = fully_shard(amp, mp_policy=mp_policy)
    with Traffic() as traffic:
        logits = model(idx[half])
        loss = F.cross_entropy(logits.float().flatten(0, 1), target[half].flatten())
        loss.backward()
    dist.all_reduce(loss := loss.detach())
    masters = {n: p.dtype for n, p in model.named_parameters()}
    return {"loss": loss.item() / world, "grads": full_grads(model), "fired": len(fired), "gather": gathered,
            "fp8_linears": fp8_linears,
            "logits": logits.detach().float(),
            "cache": ampfx.runtime.weight_cache.status(amp).splitlines(),
            "gathered": traffic.gathered, "scattered": traffic.scattered, "masters": set(masters.values()),
            "grad_dtypes": {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}}


def float32_and_autocast() -> dict[str, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The logits and gradients of one step of the model in float32 and under ``torch.autocast`` (bf16), in one
    process on the whole batch: what a low-precision run's error is measured against."""
    idx, target = data()
    out = {}
    for how in ("float32", "autocast"):
        torch.manual_seed(0)
        model = GPT()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how == "autocast"):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        loss.backward()
        out[how] = logits.detach().float(), full_grads(model)
    return out


def train(rank: int, world: int, how: str, steps: int = 3) -> dict[str, Any]:
    """``steps`` AdamW steps of the converted model under FSDP2 per block + root, each rank on its half of the
    batch: gathering float32 (``fsdp``) or as :func:`ampfx.integrations.fsdp.gather_low` decides (``fsdp_low``).
    The losses, the bytes each step all-gathers, and the full state dict at the end."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    amp = converted()
    if how == "fsdp_low":
        gather_low(amp)
    for block in amp.blocks:
        fully_shard(block)
    fully_shard(amp)
    opt = torch.optim.AdamW(amp.parameters(), lr=1e-2)
    idx, target = data()
    half = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    losses, gathered = [], []
    for _ in range(steps):
        with Traffic() as traffic:
            loss = loss_of(amp, idx[half], target[half])
            loss.backward()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss := loss.detach())
        losses.append(loss.item() / world)
        gathered.append(traffic.gathered)
    state = get_model_state_dict(amp, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"losses": losses, "gathered": gathered, "state": {k: (type(v).__name__, v.dtype, v.clone())
                                                               for k, v in state.items()}}


def plan_from_rank_zero(rank: int, world: int, cache: str) -> dict[str, Any]:
    """Each rank's plan of a model whose GEMMs sit between the two ranks' measured break-evens: rank 0 measured
    bfloat16 paying from 2^20 FLOPs, rank 1 from 2^30 (a noisy machine); both plan from rank 0's table."""
    import os

    import ampfx
    from ampfx.ops import device_cost
    from ampfx.ops.device_cost import Point, Table
    os.environ["AMPFX_CACHE_DIR"] = f"{cache}/rank{rank}"  # each its own cache: only the broadcast can agree them
    device_cost.measure_on(("cpu",))
    pays_from = 64 if rank == 0 else 1024

    def measured(device, dtype, budget_s=None):
        return Table(device_cost.device_name(device), torch.__version__.split("+")[0], str(dtype).split(".")[-1],
                     tuple(Point(r, w, 1.0, 0.5 if r * w * w >= pays_from ** 3 else 2.0)
                           for r, w in ((64, 64), (256, 256), (1024, 1024), (64, 256))))
    device_cost.measure = measured
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    amp = ampfx.convert(model, "bf16", example_inputs=(torch.randn(256, 256),))
    source = device_cost.limits(None, None, "cpu", None, torch.bfloat16)[1]["flops"]
    return {"rules": [r.rule.value for r in amp.ampfx_report.compute if r.op == "linear"], "source": source}


def convert_alone(rank: int, world: int, cache: str) -> dict[str, Any]:
    """Only one rank converts (rank 0 to inspect, or rank 1 alone): rank 0 never waits; rank 1 waits for rank 0's
    table a short while, then uses its own, with a warning. Neither hangs."""
    import os
    import warnings

    import ampfx
    from ampfx.ops import device_cost
    from ampfx.ops.device_cost import Point, Table
    os.environ["AMPFX_CACHE_DIR"] = f"{cache}/rank{rank}"
    device_cost.measure_on(("cpu",))
    device_cost.RANK_WAIT_S = 1.0
    ampfx.ranks.WAIT_S = 1.0  # nor for its plan
    device_cost.measure = lambda device, dtype, budget_s=None: Table(
        device_cost.device_name(device), torch.__version__.split("+")[0], str(dtype).split(".")[-1],
        tuple(Point(r, w, 1.0, 0.5) for r, w in ((64, 64), (256, 256), (1024, 1024), (64, 256))))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if rank == 1:  # rank 0 converts nothing: rank 1 waits for a table that never comes
            ampfx.convert(nn.Sequential(nn.Linear(8, 8)), "bf16", example_inputs=(torch.randn(4, 8),))
    dist.barrier()
    return {"said": [str(w.message) for w in said if "device-cost" in str(w.message)]}


def plans_compared(rank: int, world: int, cache: str) -> dict[str, Any]:
    """Two conversions on every rank: one on the same example (the same plan), one on an example of 256 rows on rank
    0 and 4 rows on rank 1, whose GEMMs are over the (recorded) break-even on rank 0 only: rank 1 refuses it."""
    import os

    import ampfx
    from ampfx.errors import PlanMismatchError
    from ampfx.ops import device_cost
    from ampfx.ops.device_cost import Point, Table
    os.environ["AMPFX_CACHE_DIR"] = f"{cache}/rank{rank}"
    device_cost.measure_on(("cpu",))
    device_cost.measure = lambda device, dtype, budget_s=None: Table(
        device_cost.device_name(device), torch.__version__.split("+")[0], str(dtype).split(".")[-1],
        tuple(Point(r, w, 1.0, 0.5 if r * w * w >= 256 ** 3 else 2.0)
              for r, w in ((64, 64), (256, 256), (1024, 1024), (4, 256))))
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    ampfx.convert(model, "bf16", example_inputs=(torch.randn(256, 256),))
    try:
        ampfx.convert(model, "bf16", example_inputs=(torch.randn(256 if rank == 0 else 4, 256),))
    except PlanMismatchError as e:
        return {"error": str(e)}
    return {"error": None}


def plans_of_other_models(rank: int, world: int) -> dict[str, Any]:
    """Pipeline-like: each rank converts a model of its own first (rank 1's is not on rank 0: it waits once, says it
    could not compare, and is not held up again for that model), then both convert the same model, compared."""
    import warnings

    import ampfx
    ampfx.ranks.WAIT_S = 1.0
    stage = nn.Sequential(nn.Linear(8, 8)) if rank == 0 else nn.Sequential(nn.Linear(8, 4), nn.ReLU())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            ampfx.convert(stage, "bf16", example_inputs=(torch.randn(4, 8),), gemm_min_flops=0)
        ampfx.convert(nn.Linear(8, 8), "bf16", example_inputs=(torch.randn(4, 8),), gemm_min_flops=0)
    dist.barrier()
    return {"said": [str(w.message) for w in said if "compare its plan" in str(w.message)]}
