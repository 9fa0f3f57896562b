"""Seed 001's multi-process training, on CPU: the ampfx-converted GNN under
``DistributedDataParallel`` (gloo, ``--world`` processes), each process on its
share of the training nodes, as the tutorial splits ``train_nid``; and the same
converted model trained in one process on the mean of the shares' losses.

``python tests_dgl/ddp_train.py OUT.pt [--world 2] [--steps 5] [--optimizer sgd|adam] [--model gnn|gat]`` writes
the state dicts ``ddp``, ``per-share``, ``mean-loss``, ``share-0`` (see :func:`single`) and ``init``, and
the conversion summary and its low-precision ops, to ``OUT.pt``.
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


def setup(world: int, model_name: str = "gnn"):
    """Data, initial model and the training-node shares, identical in every process. ``gnn`` is seed
    001's model (update_all + NodeUpdate); ``gat`` is seed 000's GAT (dgl.nn leaves)."""
    data = dgl_seeds.powerlaw_graph(n=300, in_feats=50, n_classes=4, seed=1)
    torch.manual_seed(0)
    if model_name == "gat":
        model = dgl_seeds.GAT(50, 8, 4, [2, 2, 2])
    else:
        model = dgl_seeds.GNN(50, 16, 4, 2, F.relu, 0.0)  # dropout 0: both runs draw no random masks
    train_nid = data.train.nonzero().squeeze(1)
    shares = torch.split(train_nid, len(train_nid) // world)[:world]
    return data, model, shares


def inputs(model, data):
    return (data.g,) if isinstance(model, dgl_seeds.GNN) else (data.g, data.feat)


def convert(model, data):
    # tiny models: every GEMM low (on a CPU each would be under the break-even and stay float32)
    return ampfx.convert(copy.deepcopy(model), torch.bfloat16, example_inputs=inputs(model, data), gemm_min_flops=0)


def worker(rank: int, world: int, port: int, steps: int, out: str, opt_name: str, model_name: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    data, model, shares = setup(world, model_name)
    amp = convert(model, data)
    ddp = torch.nn.parallel.DistributedDataParallel(amp)
    opt = optimizer(ddp.parameters(), opt_name)
    nid = shares[rank]
    for _ in range(steps):
        loss = F.cross_entropy(ddp(*inputs(model, data))[nid], data.label[nid])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in amp.state_dict().items()}, out + ".ddp")
    dist.barrier()
    dist.destroy_process_group()


def single(world: int, steps: int, opt_name: str, model_name: str, how: str = "per-share") -> dict:
    """One process on the same data. ``per-share``: a forward and backward per share, gradients summed and
    divided by the number of shares (DDP's arithmetic: each process's bf16 backward, then the average);
    ``mean-loss``: one backward of the mean of the shares' losses (the same gradient up to where bf16
    rounds in the backward); ``share-0``: share 0 alone (what a process learns without averaging)."""
    data, model, shares = setup(world, model_name)
    amp = convert(model, data)
    opt = optimizer(amp.parameters(), opt_name)
    for _ in range(steps):
        opt.zero_grad()
        if how == "per-share":
            grads = []
            for nid in shares:
                loss = F.cross_entropy(amp(*inputs(model, data))[nid], data.label[nid])
                grads.append(torch.autograd.grad(loss, list(amp.parameters())))
            for p, *gs in zip(amp.parameters(), *grads):
                p.grad = sum(gs) / world
        else:
            used = shares if how == "mean-loss" else shares[:1]
            logits = amp(*inputs(model, data))
            loss = sum(F.cross_entropy(logits[nid], data.label[nid]) for nid in used) / len(used)
            loss.backward()
        opt.step()
    rep = amp.ampfx_report
    return {k: v.detach().clone() for k, v in amp.state_dict().items()}, rep.summary(), sorted(r.op for r in rep.low())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    parser.add_argument("--model", choices=["gnn", "gat"], default="gnn")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args.steps, args.out, args.optimizer, args.model), nprocs=args.world, join=True)
    ddp = torch.load(args.out + ".ddp")
    os.remove(args.out + ".ddp")
    runs = {how: single(args.world, args.steps, args.optimizer, args.model, how)
            for how in ("per-share", "mean-loss", "share-0")}
    _, init, _ = setup(args.world, args.model)
    torch.save({"ddp": ddp, **{how: r[0] for how, r in runs.items()}, "init": init.state_dict(),
                "summary": runs["per-share"][1], "low_ops": runs["per-share"][2]}, args.out)


if __name__ == "__main__":
    main()
