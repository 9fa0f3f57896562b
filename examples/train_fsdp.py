"""Train a small GPT with ampfx + activation checkpointing per block + FSDP2 per block, on 2 CPU ranks.

The recipe (docs/scale.md): build -> ampfx.convert -> checkpoint each block -> fully_shard each block,
then the root -> optimizer. ampfx keeps the repeated blocks as real modules (``amp.blocks[i]``), so
the wrappers see them. The same steps run in one process too, and the two loss curves must agree.

The models are tiny: each conversion passes ``gemm_min_flops=0``, which lowers every GEMM (on a CPU ampfx
would keep GEMMs this small float32, where bfloat16 is slower: docs/concepts.md#small-gemms).

    torchrun --nproc-per-node 2 examples/train_fsdp.py     # torchrun starts the ranks
    python examples/train_fsdp.py [--steps 5] [--gather low|mp|float32]   # spawns 2 ranks itself (gloo, CPU)

``--gather low`` (the default): each parameter is all-gathered in the dtype the converted graphs read it in
(``ampfx.integrations.fsdp.gather_low``: bfloat16 for the GEMMs' weights, float32 for the norms and embeddings).
``--gather mp``: FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32) gathers every parameter
in bfloat16. ``--gather float32``: the float32 masters are gathered, and the converted graph casts them. Gradients
are reduced in float32 onto the float32 masters every way.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pickle
import queue
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

import ampfx

VOCAB, SEQ, BATCH, WIDTH, DEPTH = 64, 16, 8, 32, 4
TIMEOUT = datetime.timedelta(seconds=60)  # every collective fails after this instead of hanging


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(att)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.ln_f, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        out.append((idx[:, :-1], idx[:, 1:]))
    return out


def converted() -> nn.Module:
    torch.manual_seed(0)
    return ampfx.convert(GPT(), "bf16", example_inputs=(batches(1)[0][0][:2],), gemm_min_flops=0)


def train(model: nn.Module, data: list, part: slice) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for idx, target in data:
        loss = F.cross_entropy(model(idx[part]).float().flatten(0, 1), target[part].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(loss := loss.detach())
            loss = loss / dist.get_world_size()
        losses.append(loss.item())
    return losses


def rank_main(rank: int, world: int, steps: int, gather: str) -> list[float]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (apply_activation_checkpointing,
                                                                             checkpoint_wrapper)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ampfx.integrations.fsdp import gather_low

    amp = converted()  # 1. convert: amp.blocks[i] are kept, converted modules
    if rank == 0:
        print(amp.ampfx_report.summary())
    blocks = set(amp.blocks)  # 2. checkpoint each block
    apply_activation_checkpointing(amp, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: m in blocks)
    if gather == "low":  # each parameter in the dtype the plan reads it in; no param_dtype then
        gather_low(amp)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
              if gather == "mp" else MixedPrecisionPolicy())
    for block in amp.blocks:  # 3. shard each block, then the root
        fully_shard(block, mp_policy=policy)
    fully_shard(amp, mp_policy=policy)
    per = BATCH // world
    return train(amp, batches(steps), slice(rank * per, (rank + 1) * per))


def _spawned(rank: int, world: int, port: int, steps: int, gather: str, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        results.put((rank, pickle.dumps(_in_group(rank, world, steps, gather))))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        results.put((rank, pickle.dumps(e)))


def _in_group(rank: int, world: int, steps: int, gather: str) -> list[float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        return rank_main(rank, world, steps, gather)
    finally:
        dist.destroy_process_group()


def spawn(steps: int, gather: str, world: int = 2, deadline: float = 180.0) -> list[float]:
    """Run the ranks in child processes; rank 0's loss curve (a rank that fails or hangs fails this)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_spawned, args=(r, world, port, steps, gather, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got, end = {}, time.monotonic() + deadline
    try:
        while len(got) < world:
            try:  # a second at a time: a rank that dies before it can answer fails this at once
                rank, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead or time.monotonic() > end:
                    raise RuntimeError(f"ranks {dead} (rank, exit code) exited without a result" if dead else
                                       f"no result from ranks {sorted(set(range(world)) - set(got))} in "
                                       f"{deadline:.0f} s") from None
                continue
            value = pickle.loads(value)
            if isinstance(value, BaseException):
                raise RuntimeError(f"rank {rank} failed: {value!r}") from value
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got[0]


def main(argv: list[str] | None = None) -> tuple[list[float], list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gather", choices=["low", "mp", "float32"], default="low",
                        help="low: each parameter in the dtype the converted graphs read it in (default); mp: FSDP2 "
                             "MixedPrecisionPolicy(param_dtype=bf16); float32: the masters")
    parser.add_argument("--mp", action="store_const", const="mp", dest="gather", help="--gather mp")
    args = parser.parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # started by torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        curve = _in_group(rank, world, args.steps, args.gather)
        if rank != 0:
            return curve, []
    else:
        curve = spawn(args.steps, args.gather)
    single = train(converted(), batches(args.steps), slice(0, BATCH))  # the same steps in one process
    print("step  2 ranks (FSDP2 + checkpointing)  1 process")
    for i, (a, b) in enumerate(zip(curve, single)):
        print(f"{i:4d}  {a:29.4f}  {b:9.4f}")
    worst = max(abs(a - b) for a, b in zip(curve, single))
    assert worst < 0.02 * max(single), f"loss curves differ by {worst:.4f}"
    print(f"loss curves agree (largest difference {worst:.2e})")
    return curve, single


if __name__ == "__main__":
    main()
