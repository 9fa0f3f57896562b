"""DGL's own mixed-precision examples, trained in float32 and through ``ampfx.convert`` side by side.

The models are the ones DGL's documentation gives (shared/seeds/000: the
mixed-precision chapter's GAT and GCN; shared/seeds/001: the multi-GPU
tutorial's user-defined-function GNN, ``g.update_all(fn.copy_u, fn.mean,
NodeUpdate)``, and its GraphSAGE variant, here on the full graph because
DGL 2.x has no NodeFlow). Cora and Reddit need a download, so the graphs
are generated with their shape (power-law degrees, hundreds of sparse
features, homophilous classes) or come from DGL's offline datasets
(BACommunity, whose features are float64).

The models are tiny: each conversion passes ``gemm_min_flops=0``, which lowers every GEMM (on a CPU ampfx
would keep GEMMs this small float32, where bfloat16 is slower: docs/concepts.md#small-gemms).

Run ``python examples/dgl_seeds.py`` (or ``--quick``); it prints, per model,
float32 and ampfx's final training loss and test accuracy, and shows the
same GAT crashing under ``torch.autocast("cpu", torch.bfloat16)``.
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import dgl
import dgl.function as fn
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from dgl.nn import GATConv, GraphConv

import ampfx


# --------------------------------------------------------------------------- seed 000: DGL's AMP chapter
class GAT(nn.Module):
    """Seed 000's three-layer GAT (its Reddit example), unchanged."""

    def __init__(self, in_feats, n_hidden, n_classes, heads):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(GATConv(in_feats, n_hidden, heads[0], activation=F.elu))
        self.layers.append(GATConv(n_hidden * heads[0], n_hidden, heads[1], activation=F.elu))
        self.layers.append(GATConv(n_hidden * heads[1], n_classes, heads[2], activation=F.elu))

    def forward(self, g, h):
        for l, layer in enumerate(self.layers):
            h = layer(g, h)
            if l != len(self.layers) - 1:
                h = h.flatten(1)
            else:
                h = h.mean(1)
        return h


class GCN(nn.Module):
    """Seed 000's two-layer GCN (its CPU bfloat16 Citeseer example), unchanged."""

    def __init__(self, in_size, hid_size, out_size):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(GraphConv(in_size, hid_size, activation=F.relu))
        self.layers.append(GraphConv(hid_size, out_size))
        self.dropout = nn.Dropout(0.5)

    def forward(self, g, features):
        h = features
        for i, layer in enumerate(self.layers):
            if i != 0:
                h = self.dropout(h)
            h = layer(g, h)
        return h


# --------------------------------------------------------------------------- seed 001: DGL's multi-GPU tutorial
class NodeUpdate(nn.Module):
    """Seed 001's apply function: a linear layer on the aggregated messages."""

    def __init__(self, in_feats, out_feats, activation=None):
        super().__init__()
        self.linear = nn.Linear(in_feats, out_feats)
        self.activation = activation

    def forward(self, nodes):
        h = nodes.data['h']
        h = self.linear(h)
        if self.activation is not None:
            h = self.activation(h)
        return {'h': h}


class GNN(nn.Module):
    """Seed 001's full-graph GNN: mean of neighbours, then NodeUpdate, via ``g.update_all``."""

    def __init__(self, in_feats, n_hidden, n_classes, n_layers, activation, dropout):
        super().__init__()
        self.n_layers = n_layers
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList()
        self.layers.append(NodeUpdate(in_feats, n_hidden, activation))
        for i in range(1, n_layers - 1):
            self.layers.append(NodeUpdate(n_hidden, n_hidden, activation))
        self.layers.append(NodeUpdate(n_hidden, n_classes))

    def forward(self, g):
        h = g.ndata['features']
        for i, layer in enumerate(self.layers):
            h = self.dropout(h)
            g.ndata['h'] = h
            g.update_all(fn.copy_u('h', 'm'), fn.mean('m', 'h'), layer)
            h = g.ndata['h']
        return h


class SAGENodeUpdate(nn.Module):
    """Seed 001's GraphSAGE apply function: concatenate self and neighbour mean, then linear."""

    def __init__(self, in_feats, out_feats, activation=None):
        super().__init__()
        self.linear = nn.Linear(in_feats, out_feats)
        self.activation = activation

    def forward(self, nodes):
        h = torch.cat([nodes.data['h'], nodes.data['h_n']], dim=1)
        h = self.linear(h)
        if self.activation is not None:
            h = self.activation(h)
        return {'h_new': h}


class SAGE(nn.Module):
    """Seed 001's GraphSAGE variant on the full graph (DGL 2.x has no NodeFlow):
    ``h_v = act(W [h_v || mean_u h_u])`` per layer, through ``g.update_all``."""

    def __init__(self, in_feats, n_hidden, n_classes, n_layers, activation, dropout):
        super().__init__()
        self.n_layers = n_layers
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList()
        self.layers.append(SAGENodeUpdate(in_feats * 2, n_hidden, activation))
        for i in range(1, n_layers - 1):
            self.layers.append(SAGENodeUpdate(n_hidden * 2, n_hidden, activation))
        self.layers.append(SAGENodeUpdate(n_hidden * 2, n_classes))

    def forward(self, g):
        h = g.ndata['features']
        for layer in self.layers:
            g.ndata['h'] = self.dropout(h)
            g.update_all(fn.copy_u('h', 'm'), fn.mean('m', 'h_n'), layer)
            h = g.ndata['h_new']
        return h


# --------------------------------------------------------------------------- data
@dataclass
class Data:
    """A node-classification graph: features also stored as ``g.ndata['features']`` (seed 001 reads them there)."""

    name: str
    g: dgl.DGLGraph
    feat: torch.Tensor
    label: torch.Tensor
    train: torch.Tensor
    test: torch.Tensor
    n_classes: int


def _split(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(n, dtype=torch.bool)
    mask[perm[: n // 2]] = True
    return mask, ~mask


def _data(name: str, g: dgl.DGLGraph, feat: torch.Tensor, label: torch.Tensor, n_classes: int, seed: int) -> Data:
    g = dgl.add_self_loop(dgl.remove_self_loop(g))
    g.ndata['features'] = feat
    train, test = _split(g.num_nodes(), seed)
    return Data(name, g, feat, label, train, test, n_classes)


def powerlaw_graph(n: int = 2000, in_feats: int = 300, n_classes: int = 7, avg_degree: float = 5.0,
                   homophily: float = 0.8, exponent: float = 2.1, seed: int = 0, name: str = "cora-like") -> Data:
    """A graph shaped like Cora/Reddit: node weights from a power law (a few hubs
    with degree in the hundreds), edges drawn by weight and mostly within a
    class, sparse bag-of-words features whose vocabulary depends on the class."""
    rng = np.random.default_rng(seed)
    label = rng.integers(0, n_classes, n)
    weight = rng.pareto(exponent - 1, n) + 1.0
    m = int(n * avg_degree)
    src = rng.choice(n, m, p=weight / weight.sum())
    dst = np.empty(m, dtype=np.int64)
    same = rng.random(m) < homophily
    by_class = [np.flatnonzero(label == c) for c in range(n_classes)]
    for i in range(m):
        pool = by_class[label[src[i]]] if same[i] else None
        dst[i] = rng.choice(pool) if pool is not None else rng.integers(n)
    g = dgl.graph((np.concatenate([src, dst]), np.concatenate([dst, src])), num_nodes=n)
    topics = rng.random((n_classes, in_feats)) < 0.05  # each class favours ~5% of the vocabulary
    p = np.where(topics[label], 0.3, 0.01)
    feat = torch.tensor(rng.random((n, in_feats)) < p, dtype=torch.float32)
    feat = feat / feat.sum(1, keepdim=True).clamp(min=1)  # row-normalised, as Cora's features are
    return _data(name, g, feat, torch.tensor(label), n_classes, seed)


def ba_community(seed: int = 0) -> Data:
    """DGL's offline BACommunity dataset (1400 nodes, 8 classes); its float64 features become float32,
    as the float32 model needs."""
    ds = dgl.data.BACommunityDataset(seed=seed, verbose=False)
    g = ds[0]
    feat = g.ndata.pop('feat').float()
    feat = (feat - feat.mean(0)) / feat.std(0)
    label = g.ndata.pop('label')
    return _data("BACommunity", dgl.graph(g.edges(), num_nodes=g.num_nodes()), feat, label, ds.num_classes, seed)


# --------------------------------------------------------------------------- training
SEED_MODELS = {
    "GAT heads [1,1,1]": (lambda d, h: GAT(d.feat.shape[1], h, d.n_classes, [1, 1, 1]), "g,feat", 5e-3),
    "GAT heads [2,2,2]": (lambda d, h: GAT(d.feat.shape[1], h, d.n_classes, [2, 2, 2]), "g,feat", 5e-3),
    "GCN": (lambda d, h: GCN(d.feat.shape[1], h, d.n_classes), "g,feat", 1e-2),
    "GNN (update_all + NodeUpdate)": (lambda d, h: GNN(d.feat.shape[1], h, d.n_classes, 2, F.relu, 0.2), "g", 3e-2),
    "GraphSAGE variant": (lambda d, h: SAGE(d.feat.shape[1], h, d.n_classes, 2, F.relu, 0.2), "g", 1e-2),
}
"""name -> (builder(data, hidden), what forward takes, learning rate as in the seeds where they give one)."""


def inputs(kind: str, data: Data) -> tuple:
    return (data.g, data.feat) if kind == "g,feat" else (data.g,)


def train(model: nn.Module, data: Data, kind: str, lr: float, epochs: int, seed: int = 0) -> dict:
    """Full-graph training as in the seeds (Adam, cross entropy on the training nodes)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=5e-4)
    x = inputs(kind, data)
    torch.manual_seed(seed)
    model.train()
    for _ in range(epochs):
        logits = model(*x)
        loss = F.cross_entropy(logits[data.train], data.label[data.train])
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pred = model(*x).argmax(1)
    acc = (pred[data.test] == data.label[data.test]).float().mean().item()
    return {"loss": loss.item(), "acc": acc}


def compare(name: str, data: Data, dtype: torch.dtype = torch.bfloat16, hidden: int = 16, epochs: int = 60,
            seed: int = 0) -> dict:
    """The seed model ``name`` trained from the same initial weights in float32 and through ampfx."""
    build, kind, lr = SEED_MODELS[name]
    torch.manual_seed(seed)
    base = build(data, hidden)
    fp32_model = copy.deepcopy(base)
    t0 = time.perf_counter()
    fp32 = train(fp32_model, data, kind, lr, epochs, seed)
    t1 = time.perf_counter()
    amp_model = ampfx.convert(copy.deepcopy(base), dtype, example_inputs=inputs(kind, data),
                               gemm_min_flops=0)
    t2 = time.perf_counter()
    low = train(amp_model, data, kind, lr, epochs, seed)
    t3 = time.perf_counter()
    return {"model": name, "data": data.name, "fp32": fp32, "ampfx": low, "report": amp_model.ampfx_report,
            "seconds": (t1 - t0, t3 - t2, t2 - t1)}


def autocast_crash(data: Data, hidden: int = 16) -> str:
    """Seed 000's GAT under ``torch.autocast("cpu", torch.bfloat16)``: the error DGL raises."""
    torch.manual_seed(0)
    model = GAT(data.feat.shape[1], hidden, data.n_classes, [1, 1, 1])
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(data.g, data.feat)
    except Exception as e:  # noqa: BLE001 - the point is to show it
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return "no error"


def run(quick: bool = False) -> list[dict]:
    graphs = [powerlaw_graph(n=600 if quick else 2000, in_feats=100 if quick else 300)]
    if not quick:
        graphs.append(ba_community())
    epochs = 40 if quick else 100
    return [compare(name, data, epochs=epochs) for data in graphs for name in SEED_MODELS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller graph and fewer epochs")
    args = parser.parse_args()
    data = powerlaw_graph(n=600 if args.quick else 2000, in_feats=100 if args.quick else 300)
    print(f"autocast (cpu, bfloat16) on seed 000's GAT: {autocast_crash(data)}")
    rows = run(args.quick)
    print(f"\n{'model':32} {'data':12} {'fp32 loss':>10} {'ampfx loss':>10} {'d loss':>7}  "
          f"{'fp32 acc':>8} {'ampfx acc':>9}")
    for r in rows:
        f, a = r["fp32"], r["ampfx"]
        print(f"{r['model']:32} {r['data']:12} {f['loss']:10.4f} {a['loss']:10.4f} "
              f"{(a['loss'] - f['loss']) / f['loss']:+7.2%}  {f['acc']:8.2%} {a['acc']:9.2%}")
    print()
    for r in rows[:5]:
        print(f"{r['model']}:\n{r['report'].summary()}")


if __name__ == "__main__":
    main()
