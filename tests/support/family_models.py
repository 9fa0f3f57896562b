"""Small models of the families where ampfx once made more casts or saved more bytes than autocast
(issue #15): windowed attention, conv/attention hybrids, selective-scan LMs, conformer speech
encoders, neural audio codecs, diffusion UNets, segmentation heads, fire-module CNNs. Plain torch,
random weights, written as those families' reference code writes them (tests/test_families.py).

Each builder returns ``(model, example inputs, loss(output))`` from a seed.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Case = tuple[nn.Module, tuple, Callable[[Any], torch.Tensor]]


# ----------------------------------------------------------------------------- windowed attention
class WindowBlock(nn.Module):
    """A Swin block: attention inside ``window`` x ``window`` windows (shifted by ``shift``), with a
    relative-position bias gathered from a table and the shifted windows' mask, then an MLP."""

    def __init__(self, dim: int, heads: int, res: int, window: int, shift: int):
        super().__init__()
        self.dim, self.heads, self.res, self.window, self.shift = dim, heads, res, window, shift
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", rel[..., 0] * (2 * window - 1) + rel[..., 1], persistent=False)
        mask = torch.zeros(1, res, res, 1)
        if shift:
            for i, hs in enumerate((slice(0, -window), slice(-window, -shift), slice(-shift, None))):
                for j, ws in enumerate((slice(0, -window), slice(-window, -shift), slice(-shift, None))):
                    mask[:, hs, ws, :] = 3 * i + j
        windows = self._partition(mask).squeeze(-1)
        diff = windows[:, None, :] - windows[:, :, None]
        self.register_buffer("mask", diff.ne(0).float() * -100.0, persistent=False)

    def _partition(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        x = x.view(b, h // self.window, self.window, w // self.window, self.window, c)
        return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, self.window * self.window, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        shortcut = x
        x = self.norm1(x).view(b, self.res, self.res, c)
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
        win = self._partition(x)
        q, k, v = self.qkv(win).view(win.shape[0], -1, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attn = (q * (c // self.heads) ** -0.5) @ k.transpose(-2, -1)
        bias = self.table[self.index.view(-1)].view(self.window ** 2, self.window ** 2, -1).permute(2, 0, 1)
        attn = attn + bias.unsqueeze(0)
        n_win = self.mask.shape[0]
        attn = attn.view(-1, n_win, self.heads, self.window ** 2, self.window ** 2) + self.mask[None, :, None]
        attn = attn.view(-1, self.heads, self.window ** 2, self.window ** 2).softmax(-1)
        out = self.proj((attn @ v).transpose(1, 2).reshape(win.shape[0], -1, c))
        g = self.res // self.window
        out = out.view(b, g, g, self.window, self.window, c).permute(0, 1, 3, 2, 4, 5).reshape(b, self.res, self.res, c)
        if self.shift:
            out = torch.roll(out, (self.shift, self.shift), dims=(1, 2))
        x = shortcut + out.reshape(b, n, c)
        return x + self.mlp(self.norm2(x))


class Swin(nn.Module):
    def __init__(self, dim: int = 32, res: int = 8, classes: int = 10):
        super().__init__()
        self.embed, self.norm = nn.Conv2d(3, dim, 4, 4), nn.LayerNorm(dim)
        self.blocks = nn.Sequential(WindowBlock(dim, 2, res, 4, 0), WindowBlock(dim, 2, res, 4, 2))
        self.head = nn.Linear(dim, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.embed(img).flatten(2).transpose(1, 2))
        return self.head(self.blocks(x).mean(1))


# ----------------------------------------------------------------------------- conv/attention hybrid
class MobileViTBlock(nn.Module):
    """Local convolutions, then a transformer layer across 2x2 patches unfolded from the feature map,
    folded back and fused with the block's input (MobileViT)."""

    def __init__(self, ch: int, dim: int, patch: int = 2):
        super().__init__()
        self.patch = patch
        self.local = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.SiLU(),
                                   nn.Conv2d(ch, dim, 1, bias=False))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.back = nn.Sequential(nn.Conv2d(dim, ch, 1, bias=False), nn.BatchNorm2d(ch), nn.SiLU())
        self.fuse = nn.Sequential(nn.Conv2d(2 * ch, ch, 3, padding=1, bias=False), nn.BatchNorm2d(ch), nn.SiLU())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        b, d, h, w = y.shape
        p = self.patch
        t = y.reshape(b, d, h // p, p, w // p, p).permute(0, 3, 5, 2, 4, 1).reshape(b * p * p, -1, d)
        n = self.norm1(t)
        t = t + self.attn(n, n, n, need_weights=False)[0]
        t = self.norm3(t + self.mlp(self.norm2(t)))
        y = t.reshape(b, p, p, h // p, w // p, d).permute(0, 5, 3, 1, 4, 2).reshape(b, d, h, w)
        return self.fuse(torch.cat([x, self.back(y)], 1))


class Hybrid(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.SiLU())
        self.block = MobileViTBlock(16, 32)
        self.head = nn.Linear(16, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.stem(img)).mean((2, 3)))


# ----------------------------------------------------------------------------- selective-scan LM
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MambaBlock(nn.Module):
    """Mamba's mixer: gated, a causal depthwise convolution, and the selective scan
    ``h = exp(dt * A) * h + dt * B * x``, ``y = C . h + D * x``, unrolled over time."""

    def __init__(self, dim: int, inner: int, state: int = 8, conv: int = 4, rank: int = 4):
        super().__init__()
        self.inner, self.state, self.rank = inner, state, rank
        self.norm = RMSNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.d = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, length, _ = hidden.shape
        x, z = self.in_proj(self.norm(hidden)).chunk(2, dim=-1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., :length].transpose(1, 2))
        dt, bb, cc = self.x_proj(x).split([self.rank, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))
        a = -torch.exp(self.a_log.float())
        h = torch.zeros(b, self.inner, self.state, device=x.device)
        ys = []
        for t in range(length):
            h = torch.exp(dt[:, t, :, None] * a) * h + dt[:, t, :, None] * bb[:, t, None, :] * x[:, t, :, None]
            ys.append((h @ cc[:, t, :, None]).squeeze(-1))
        y = torch.stack(ys, dim=1) + x * self.d
        return hidden + self.out_proj(y * F.silu(z))


class Mamba(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.Sequential(*[MambaBlock(dim, 2 * dim) for _ in range(layers)])
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.embed(ids))))


# ----------------------------------------------------------------------------- conformer
class ConformerLayer(nn.Module):
    """Macaron feed-forwards around self-attention and a convolution module (pointwise, GLU,
    depthwise, batch norm, SiLU, pointwise), each with a pre-norm and a residual."""

    def __init__(self, dim: int, heads: int = 2, kernel: int = 7):
        super().__init__()

        def ffn() -> nn.Sequential:
            return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.SiLU(), nn.Dropout(0.1),
                                 nn.Linear(4 * dim, dim), nn.Dropout(0.1))
        self.ff1, self.ff2 = ffn(), ffn()
        self.norm_att, self.att = nn.LayerNorm(dim), nn.MultiheadAttention(dim, heads, dropout=0.1, batch_first=True)
        self.norm_conv = nn.LayerNorm(dim)
        self.pw1, self.dw = nn.Conv1d(dim, 2 * dim, 1), nn.Conv1d(dim, dim, kernel, padding=kernel // 2, groups=dim)
        self.bn, self.pw2 = nn.BatchNorm1d(dim), nn.Conv1d(dim, dim, 1)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 0.5 * self.ff1(x)
        n = self.norm_att(x)
        x = x + self.att(n, n, n, need_weights=False)[0]
        c = F.glu(self.pw1(self.norm_conv(x).transpose(1, 2)), dim=1)
        x = x + self.pw2(F.silu(self.bn(self.dw(c)))).transpose(1, 2)
        return self.norm_out(x + 0.5 * self.ff2(x))


class Conformer(nn.Module):
    """Two stride-2 convolutions over a log-mel spectrogram, then conformer layers and a frame classifier."""

    def __init__(self, mels: int = 16, dim: int = 32, classes: int = 12):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, dim, 3, 2), nn.ReLU(), nn.Conv2d(dim, dim, 3, 2), nn.ReLU())
        self.lin = nn.Linear(dim * (((mels - 1) // 2 - 1) // 2), dim)
        self.layers = nn.Sequential(ConformerLayer(dim), ConformerLayer(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, spec: torch.Tensor) -> torch.Tensor:
        x = self.sub(spec.unsqueeze(1))
        x = self.lin(x.permute(0, 2, 1, 3).flatten(2))
        return self.head(self.layers(x)).log_softmax(-1)


# ----------------------------------------------------------------------------- neural audio codec
class Snake(nn.Module):
    """DAC's periodic activation ``x + sin(alpha x)**2 / alpha``."""

    def __init__(self, ch: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, ch, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.alpha + 1e-9).reciprocal() * torch.sin(self.alpha * x).pow(2)


def _wn(conv: nn.Module) -> nn.Module:
    return nn.utils.parametrizations.weight_norm(conv)


class ResidualUnit(nn.Module):
    def __init__(self, ch: int, dilation: int):
        super().__init__()
        self.block = nn.Sequential(Snake(ch), _wn(nn.Conv1d(ch, ch, 7, dilation=dilation, padding=3 * dilation)),
                                   Snake(ch), _wn(nn.Conv1d(ch, ch, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class Codec(nn.Module):
    """DAC / EnCodec in small: a strided convolutional encoder with residual units and snake
    activations, residual vector quantisation (nearest codebook entry, straight-through gradient,
    commitment loss), and a transposed-convolution decoder."""

    def __init__(self, ch: int = 16, latent: int = 8, codes: int = 32, stages: int = 2):
        super().__init__()
        self.enc = nn.Sequential(_wn(nn.Conv1d(1, ch, 7, padding=3)), ResidualUnit(ch, 1), ResidualUnit(ch, 3),
                                 Snake(ch), _wn(nn.Conv1d(ch, 2 * ch, 8, stride=4, padding=2)),
                                 ResidualUnit(2 * ch, 1), Snake(2 * ch), _wn(nn.Conv1d(2 * ch, latent, 3, padding=1)))
        self.codebooks = nn.ParameterList([nn.Parameter(torch.randn(codes, latent)) for _ in range(stages)])
        self.dec = nn.Sequential(_wn(nn.Conv1d(latent, 2 * ch, 7, padding=3)), Snake(2 * ch),
                                 _wn(nn.ConvTranspose1d(2 * ch, ch, 8, stride=4, padding=2)), ResidualUnit(ch, 1),
                                 Snake(ch), _wn(nn.Conv1d(ch, 1, 7, padding=3)), nn.Tanh())

    def forward(self, wav: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.enc(wav).transpose(1, 2)
        residual, quantized, commit = z, torch.zeros_like(z), z.new_zeros(())
        for book in self.codebooks:
            dist = residual.pow(2).sum(-1, keepdim=True) - 2 * residual @ book.t() + book.pow(2).sum(-1)
            q = F.embedding(dist.argmin(-1), book)
            commit = commit + F.mse_loss(residual, q.detach()) + F.mse_loss(q, residual.detach())
            quantized = quantized + q
            residual = residual - q.detach()
        quantized = z + (quantized - z).detach()
        return self.dec(quantized.transpose(1, 2)), commit


# ----------------------------------------------------------------------------- diffusion UNet
def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(temb, cout)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x))) + self.time(F.silu(emb))[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(self.norm2(h)))


class AttnBlock(nn.Module):
    def __init__(self, ch: int):
        super().__init__()
        self.norm, self.qkv, self.out = nn.GroupNorm(4, ch), nn.Conv2d(ch, 3 * ch, 1), nn.Conv2d(ch, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        attn = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        return x + self.out((v @ attn.transpose(1, 2)).reshape(b, c, h, w))


class UNet(nn.Module):
    def __init__(self, ch: int = 16, temb: int = 32):
        super().__init__()
        self.temb = temb
        self.time = nn.Sequential(nn.Linear(temb, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.inp = nn.Conv2d(3, ch, 3, padding=1)
        self.down1, self.down = ResBlock(ch, ch, temb), nn.Conv2d(ch, ch, 3, 2, 1)
        self.mid, self.attn = ResBlock(ch, 2 * ch, temb), AttnBlock(2 * ch)
        self.up1 = ResBlock(3 * ch, ch, temb)
        self.out = nn.Sequential(nn.GroupNorm(4, ch), nn.SiLU(), nn.Conv2d(ch, 3, 3, padding=1))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        emb = self.time(timestep_embedding(t, self.temb))
        h1 = self.down1(self.inp(x), emb)
        h = self.attn(self.mid(self.down(h1), emb))
        h = F.interpolate(h, scale_factor=2.0, mode="nearest")
        return self.out(self.up1(torch.cat([h, h1], 1), emb))


# ----------------------------------------------------------------------------- segmentation head
def _cbr(cin: int, cout: int, k: int = 3, stride: int = 1, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, dilation * (k // 2), dilation, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU())


class Segmenter(nn.Module):
    """A strided backbone, DeepLab's ASPP (dilated branches and an image-pooling branch upsampled
    back), a classifier, and bilinear upsampling of the logits to the input's size."""

    def __init__(self, classes: int = 5, ch: int = 16):
        super().__init__()
        self.backbone = nn.Sequential(_cbr(3, ch, stride=2), _cbr(ch, 2 * ch, stride=2), _cbr(2 * ch, 2 * ch))
        self.branches = nn.ModuleList([_cbr(2 * ch, ch, 1), _cbr(2 * ch, ch, dilation=2), _cbr(2 * ch, ch, dilation=3)])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(2 * ch, ch, 1, bias=False), nn.ReLU())
        self.project, self.classify = _cbr(4 * ch, ch, 1), nn.Conv2d(ch, classes, 1)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        f = self.backbone(img)
        pooled = F.interpolate(self.pool(f), size=f.shape[-2:], mode="bilinear", align_corners=False)
        x = self.project(torch.cat([b(f) for b in self.branches] + [pooled], 1))
        return F.interpolate(self.classify(x), size=img.shape[-2:], mode="bilinear", align_corners=False)


# ----------------------------------------------------------------------------- fire modules
class Fire(nn.Module):
    def __init__(self, cin: int, squeeze: int, expand: int):
        super().__init__()
        self.squeeze = nn.Sequential(nn.Conv2d(cin, squeeze, 1), nn.ReLU(inplace=True))
        self.e1 = nn.Sequential(nn.Conv2d(squeeze, expand, 1), nn.ReLU(inplace=True))
        self.e3 = nn.Sequential(nn.Conv2d(squeeze, expand, 3, padding=1), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.squeeze(x)
        return torch.cat([self.e1(s), self.e3(s)], 1)


class SqueezeNet(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 32, 3, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, ceil_mode=True),
                                      Fire(32, 8, 16), Fire(32, 8, 16), nn.MaxPool2d(3, 2, ceil_mode=True),
                                      Fire(32, 16, 32))
        self.classifier = nn.Sequential(nn.Dropout(0.5), nn.Conv2d(64, classes, 1), nn.ReLU(inplace=True),
                                        nn.AdaptiveAvgPool2d(1))

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(img)).flatten(1)


# ----------------------------------------------------------------------------- cases
def _images(size: int, g: torch.Generator, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=g)


def build(name: str, seed: int = 0) -> Case:
    """The model ``name`` (random weights from ``seed``), its example inputs, and its loss."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.randint(0, 10, (2,), generator=g)
    if name == "swin":
        return Swin(), (_images(32, g),), lambda out: F.cross_entropy(out.float(), labels)
    if name == "hybrid":
        return Hybrid(), (_images(16, g),), lambda out: F.cross_entropy(out.float(), labels)
    if name == "ssm":
        ids = torch.randint(0, 64, (2, 12), generator=g)
        return Mamba(), (ids,), lambda out: F.cross_entropy(out.float()[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    if name == "conformer":
        frames = torch.randint(0, 12, (2, 7), generator=g)
        return Conformer(), (torch.randn(2, 32, 16, generator=g),), lambda out: F.nll_loss(out.float().flatten(0, 1),
                                                                                             frames.flatten())
    if name == "codec":
        wav = torch.randn(2, 1, 256, generator=g).tanh()
        return Codec(), (wav,), lambda out: F.l1_loss(out[0].float(), wav) + 0.25 * out[1].float()
    if name == "unet":
        noise = torch.randn(2, 3, 16, 16, generator=g)
        return UNet(), (torch.randn(2, 3, 16, 16, generator=g), torch.tensor([10, 500])), \
            lambda out: F.mse_loss(out.float(), noise)
    if name == "segmentation":
        mask = torch.randint(0, 5, (2, 32, 32), generator=g)
        return Segmenter(), (_images(32, g),), lambda out: F.cross_entropy(out.float(), mask)
    if name == "fire":
        return SqueezeNet(), (_images(48, g),), lambda out: F.cross_entropy(out.float(), labels)
    raise KeyError(name)


FAMILIES = ("swin", "hybrid", "ssm", "conformer", "codec", "unet", "segmentation", "fire")
