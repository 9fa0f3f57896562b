"""Seed 001's multi-process training, on CPU: the ampfx-converted GNN under
``DistributedDataParallel`` (gloo, ``--world`` processes), each process on its
share of the training nodes, as the tutorial splits ``train_nid``; and the same
converted model trained in one process on the mean of the shares' losses.

``python tests_dgl/ddp_train.py OUT.pt [--world 2] [--steps 5] [--optimizer sgd|adam]`` writes
``{"ddp", "single", "rank0_alone", "init"}`` state dicts and the conversion summary to ``OUT.pt``.
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import ampfx  # noqa: E402
import dgl_seeds  # noqa: E402

LR = 0.03  # the tutorial's learning rate


def optimizer(params, name: str):
    """The tutorial's Adam, or SGD: Adam divides by sqrt(v), so near-zero gradients that differ only by
    rounding (bf16 backward per process vs. once on the summed loss) become full-size, different steps."""
    return torch.optim.Adam(params, lr=LR) if name == "adam" else torch.optim.SGD(params, lr=LR * 10)


def setup(world: int):
    """Data, initial model and the training-node shares, identical in every process."""
    data = dgl_seeds.powerlaw_graph(n=300, in_feats=50, n_classes=4, seed=1)
    torch.manual_seed(0)
    model = dgl_seeds.GNN(50, 16, 4, 2, F.relu, 0.0)  # dropout 0: both runs draw no random masks
    train_nid = data.train.nonzero().squeeze(1)
    shares = torch.split(train_nid, len(train_nid) // world)[:world]
    return data, model, shares


def convert(model, data):
    return ampfx.convert(copy.deepcopy(model), torch.bfloat16, example_inputs=(data.g,))


def worker(rank: int, world: int, port: int, steps: int, out: str, opt_name: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data, model, shares = setup(world)
    amp = convert(model, data)
    ddp = torch.nn.parallel.DistributedDataParallel(amp)
    opt = optimizer(ddp.parameters(), opt_name)
    nid = shares[rank]
    for _ in range(steps):
        loss = F.cross_entropy(ddp(data.g)[nid], data.label[nid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in amp.state_dict().items()}, out + ".ddp")
    dist.barrier()
    dist.destroy_process_group()


def single(world: int, steps: int, opt_name: str, only: int | None = None) -> dict:
    """One process: the mean of every share's loss (what DDP's gradient averaging computes), or share
    ``only``'s loss alone (what a process would learn without averaging)."""
    data, model, shares = setup(world)
    amp = convert(model, data)
    opt = optimizer(amp.parameters(), opt_name)
    used = shares if only is None else shares[only:only + 1]
    for _ in range(steps):
        logits = amp(data.g)
        loss = sum(F.cross_entropy(logits[nid], data.label[nid]) for nid in used) / len(used)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in amp.state_dict().items()}, amp.ampfx_report.summary()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args.steps, args.out, args.optimizer), nprocs=args.world, join=True)
    ddp = torch.load(args.out + ".ddp")
    os.remove(args.out + ".ddp")
    ref, summary = single(args.world, args.steps, args.optimizer)
    alone, _ = single(args.world, args.steps, args.optimizer, only=0)
    _, init, _ = setup(args.world)
    torch.save({"ddp": ddp, "single": ref, "rank0_alone": alone, "init": init.state_dict(), "summary": summary},
               args.out)


if __name__ == "__main__":
    main()
