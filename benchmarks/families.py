"""Models of families that cost more than autocast in earlier held-out runs, built small from configs (no downloads).

Each builder returns ``(model, inputs, loss spec)`` as :func:`coverage.build` does; :mod:`coverage` and
:mod:`step_time` take them by name:

- ``codec``: a neural audio codec (transformers' EnCodec: weight-normed conv1d, an LSTM, residual vector
  quantisation), loss: the reconstruction against the input;
- ``dlrm``: a recommender (embedding bags, pairwise dot interactions);
- ``gcn``: a graph network written with scatter (``index_add_``), degree-normalised;
- ``fpn_det``: a two-stage detector's shape (ResNet + FPN, a group-norm head on every level, RoIAlign on given boxes);
- ``raft``: optical flow (torchvision's RAFT-small: correlation volumes, ``grid_sample``, recurrent updates);
- ``vae``: a diffusion VAE (diffusers' ``AutoencoderKL``: group norm, mid-block attention, a sampled latent);
- ``deit_distilled``: a distilled ViT (timm, class and distillation tokens, two heads);
- ``xcit``: a vision transformer with cross-covariance attention (L2-normalised queries and keys, a learned
  temperature), local patch interaction and layer scale (timm).
"""
FAMILIES = ["codec", "dlrm", "gcn", "fpn_det", "raft", "vae", "deit_distilled", "xcit"]
B, NC = 2, 10


def build(name):
    import torch
    g = torch.Generator().manual_seed(0)
    img = lambda hw: torch.randn(B, 3, hw, hw, generator=g)
    tgt = torch.randint(0, NC, (B,), generator=g)
    if name == "codec":
        import transformers as tf
        # a hop of 8 samples at 600 Hz: 75 frames a second, so 1.5 kbps is two codebooks of 10 bits
        cfg = tf.EncodecConfig(target_bandwidths=[1.5, 3.0], sampling_rate=600, hidden_size=32, num_filters=8,
                               upsampling_ratios=[4, 2], codebook_size=1024, codebook_dim=32, num_lstm_layers=1,
                               norm_type="weight_norm")
        audio = torch.randn(B, 1, 512, generator=g)
        return tf.EncodecModel(cfg), {"input_values": audio}, ("mse_audio", audio)
    if name == "dlrm":
        return _dlrm(), (torch.randn(64, 13, generator=g), torch.randint(0, 1000, (64, 8), generator=g)), \
            ("bce", torch.randint(0, 2, (64,), generator=g).float())
    if name == "gcn":
        n, e = 512, 4096
        src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
        return _gcn(), (torch.randn(n, 32, generator=g), src, dst), ("ce", torch.randint(0, NC, (n,), generator=g))
    if name == "fpn_det":
        boxes = torch.tensor([[0, 4.0, 4.0, 40.0, 40.0], [1, 8.0, 0.0, 60.0, 30.0], [1, 0.0, 16.0, 32.0, 64.0]])
        return _fpn_det(), (img(64), boxes), ("sum_sq", None)
    if name == "raft":
        from torchvision.models.optical_flow import raft_small
        # RAFT's correlation pyramid needs feature maps of 16 a side: images of 128
        return raft_small(weights=None), (img(128), img(128)), ("flows", torch.randn(B, 2, 128, 128, generator=g))
    if name == "vae":
        import diffusers
        m = diffusers.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                                    up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64),
                                    layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32)
        x = img(32)
        return m, {"sample": x}, ("mse", x)  # the posterior's mode: a sampled latent would differ per run
    if name == "deit_distilled":
        import timm
        return timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, num_classes=NC, img_size=64), \
            (img(64),), ("ce_all", tgt)
    if name == "xcit":
        import timm
        return timm.create_model("xcit_nano_12_p16_224", pretrained=False, num_classes=NC, img_size=64), \
            (img(64),), ("ce", tgt)
    raise KeyError(name)


def loss_of(out, spec):
    """The float32 loss of ``out`` for the families' own specs; ``None`` for another spec."""
    import torch
    import torch.nn.functional as F
    kind, tgt = spec
    if kind == "bce":
        return F.binary_cross_entropy_with_logits(out.float(), tgt)
    if kind == "mse_audio":
        audio = out["audio_values"] if isinstance(out, dict) else out.audio_values
        return F.mse_loss(audio.float()[..., :tgt.shape[-1]], tgt)
    if kind == "sum_sq":
        return sum(o.float().pow(2).mean() for o in torch.utils._pytree.tree_leaves(out)
                   if isinstance(o, torch.Tensor) and o.is_floating_point())
    if kind == "flows":  # RAFT's sequence loss: every update's flow against the target
        return sum(F.l1_loss(f.float(), tgt) for f in out) / len(out)
    if kind == "ce_all":  # a distilled ViT trains both heads (one output in eval mode)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return sum(F.cross_entropy(o.float(), tgt) for o in outs) / len(outs)
    return None


def _dlrm():
    """A DLRM-style recommender: a bottom MLP on dense features, embedding bags on sparse ones, pairwise dot
    interactions, a top MLP."""
    import torch
    import torch.nn as nn

    class DLRM(nn.Module):
        def __init__(self, tables=8, rows=1000, d=32):
            super().__init__()
            self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, d), nn.ReLU())
            self.emb = nn.ModuleList(nn.EmbeddingBag(rows, d, mode="sum") for _ in range(tables))
            n = tables + 1
            self.top = nn.Sequential(nn.Linear(d + n * (n - 1) // 2, 64), nn.ReLU(), nn.Linear(64, 1))
            self.register_buffer("li", torch.tril_indices(n, n, -1)[0], persistent=False)
            self.register_buffer("lj", torch.tril_indices(n, n, -1)[1], persistent=False)

        def forward(self, dense, sparse):
            x = self.bottom(dense)
            feats = [x] + [e(sparse[:, i:i + 1]) for i, e in enumerate(self.emb)]
            t = torch.stack(feats, dim=1)
            z = torch.bmm(t, t.transpose(1, 2))[:, self.li, self.lj]
            return self.top(torch.cat([x, z], dim=1)).squeeze(1)

    return DLRM()


def _gcn():
    """A graph convolutional network written with scatter (index_add_): degree-normalised neighbour sums."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class GCN(nn.Module):
        def __init__(self, d_in=32, d=64, classes=10):
            super().__init__()
            self.l1, self.l2, self.l3 = nn.Linear(d_in, d), nn.Linear(d, d), nn.Linear(d, classes)

        def propagate(self, h, src, dst):
            ones = torch.ones(dst.shape[0], dtype=h.dtype, device=h.device)  # as PyG's gcn_norm makes its weights
            deg = torch.zeros(h.shape[0], dtype=h.dtype, device=h.device).index_add_(0, dst, ones)
            out = torch.zeros_like(h).index_add_(0, dst, h[src])
            return out / deg.clamp(min=1)[:, None]

        def forward(self, x, src, dst):
            h = F.relu(self.propagate(self.l1(x), src, dst))
            h = F.relu(self.propagate(self.l2(h), src, dst))
            return self.l3(h)

    return GCN()


def _fpn_det():
    """A two-stage detector's shape: a ResNet-18 with a feature pyramid, a head of group-normed convolutions shared
    by every level (class and box maps, as FCOS / RetinaNet heads), and a second stage that pools given boxes
    from the finest level (RoIAlign) into a small box head."""
    import torch
    import torch.nn as nn
    import torchvision
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    class Detector(nn.Module):
        def __init__(self, classes=NC, c=64):
            super().__init__()
            self.backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
            width = self.backbone.out_channels

            def tower():
                layers = []
                for _ in range(2):
                    layers += [nn.Conv2d(width, width, 3, padding=1), nn.GroupNorm(32, width), nn.ReLU()]
                return nn.Sequential(*layers)
            self.cls_tower, self.box_tower = tower(), tower()
            self.cls = nn.Conv2d(width, classes, 3, padding=1)
            self.box = nn.Conv2d(width, 4, 3, padding=1)
            self.box_head = nn.Sequential(nn.Flatten(), nn.Linear(width * 7 * 7, c), nn.ReLU(), nn.Linear(c, classes))

        def forward(self, images, rois):
            feats = self.backbone(images)
            dense = [(self.cls(self.cls_tower(f)), self.box(self.box_tower(f)).relu()) for f in feats.values()]
            finest = feats["0"]
            pooled = torchvision.ops.roi_align(finest, rois, (7, 7), spatial_scale=finest.shape[-1] / images.shape[-1],
                                               sampling_ratio=2, aligned=True)
            return dense, self.box_head(pooled)

    return Detector()
