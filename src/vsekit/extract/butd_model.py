"""The bottom-up-attention Faster R-CNN (Anderson et al., CVPR 2018) in plain PyTorch: the network of
peteanderson80/bottom-up-attention ``models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt``
(Caffe ResNet-101 C4 backbone, RPN, RoIPool 14×14 → res5 → ``pool5``, class and attribute heads).
Module names follow MILVLG/bottom-up-attention.pytorch's converted checkpoint (detectron2 layout), so
its state dict loads by name; :func:`checkpoint_table` lists every key and shape, docs/extract.md
("Region features (BUTD)") the table of keys and Caffe layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

NUM_CLASSES = 1601      # 1,600 objects + background (class 0)
NUM_ATTRIBUTES = 401    # 400 attributes + "no attribute" (0)
POOL_SIZE = 14
SPATIAL_SCALE = 1.0 / 16
STAGES = (("res2", 3, 64, 256, 1), ("res3", 4, 128, 512, 2), ("res4", 23, 256, 1024, 2))


class FrozenBN(nn.Module):
    """Caffe BatchNorm + Scale with global statistics: y = (x - mean) / sqrt(var + eps) * w + b."""

    def __init__(self, channels: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        for name, fill in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((channels,), fill))

    def forward(self, x):
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)
        shift = self.bias - self.running_mean * scale
        return x * scale.view(1, -1, 1, 1).to(x.dtype) + shift.view(1, -1, 1, 1).to(x.dtype)


class ConvBN(nn.Conv2d):
    """A bias-free convolution followed by its frozen batch norm (keys ``weight``, ``norm.*``)."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1, padding: int = 0, dilation: int = 1):
        super().__init__(cin, cout, k, stride=stride, padding=padding, dilation=dilation, bias=False)
        self.norm = FrozenBN(cout)

    def forward(self, x):
        return self.norm(super().forward(x))


class Bottleneck(nn.Module):
    """MSRA bottleneck: 1x1 (stride) → 3x3 (dilation) → 1x1, projection shortcut when widths differ."""

    def __init__(self, cin: int, mid: int, cout: int, stride: int = 1, dilation: int = 1):
        super().__init__()
        self.conv1 = ConvBN(cin, mid, 1, stride=stride)
        self.conv2 = ConvBN(mid, mid, 3, padding=dilation, dilation=dilation)
        self.conv3 = ConvBN(mid, cout, 1)
        self.shortcut = ConvBN(cin, cout, 1, stride=stride) if cin != cout else None

    def forward(self, x):
        out = F.relu(self.conv1(x))
        out = F.relu(self.conv2(out))
        out = self.conv3(out)
        return F.relu(out + (self.shortcut(x) if self.shortcut is not None else x))


def _stage(n: int, cin: int, mid: int, cout: int, stride: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(*[Bottleneck(cin if i == 0 else cout, mid, cout, stride if i == 0 else 1, dilation)
                           for i in range(n)])


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = ConvBN(3, 64, 7, stride=2, padding=3)

    def forward(self, x):
        return F.max_pool2d(F.relu(self.conv1(x)), kernel_size=3, stride=2, padding=0, ceil_mode=True)


class Backbone(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = Stem()
        cin = 64
        for name, n, mid, cout, stride in STAGES:
            self.add_module(name, _stage(n, cin, mid, cout, stride))
            cin = cout

    def forward(self, x):
        return self.res4(self.res3(self.res2(self.stem(x))))


class RPNHead(nn.Module):
    def __init__(self, cin: int = 1024, mid: int = 512, anchors: int = 12):
        super().__init__()
        self.conv = nn.Conv2d(cin, mid, 3, padding=1)
        self.objectness_logits = nn.Conv2d(mid, 2 * anchors, 1)
        self.anchor_deltas = nn.Conv2d(mid, 4 * anchors, 1)

    def forward(self, x):
        t = F.relu(self.conv(x))
        return self.objectness_logits(t), self.anchor_deltas(t)


class BoxPredictor(nn.Module):
    def __init__(self, dim: int = 2048):
        super().__init__()
        self.cls_score = nn.Linear(dim, NUM_CLASSES)
        self.bbox_pred = nn.Linear(dim, 4 * NUM_CLASSES)
        self.cls_embed = nn.Embedding(NUM_CLASSES, 256)
        self.attr_linear1 = nn.Linear(dim + 256, 512)
        self.attr_linear2 = nn.Linear(512, NUM_ATTRIBUTES)

    def forward(self, pooled):
        """(R, 2048) → class logits (R, 1601), box deltas (R, 6404), attribute probs (R, 401)."""
        logits = self.cls_score(pooled)
        embed = self.cls_embed(logits.argmax(dim=1))   # Caffe ArgMax on cls_score, background included
        hidden = F.relu(self.attr_linear1(torch.cat([pooled, embed.to(pooled.dtype)], dim=1)))
        return logits, self.bbox_pred(pooled), torch.softmax(self.attr_linear2(hidden).float(), dim=1)


class ButdR101(nn.Module):
    """The whole detector; the stages are called one by one by :class:`vsekit.extract.butd.ButdDetector`."""

    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        # containers only (named as the checkpoint's keys): their parts are called one by one
        self.proposal_generator = nn.ModuleDict({"rpn_head": RPNHead()})
        self.roi_heads = nn.ModuleDict({"res5": _stage(3, 1024, 512, 2048, stride=1, dilation=2),
                                        "box_predictor": BoxPredictor()})

    def rpn(self, fmap):
        return self.proposal_generator.rpn_head(fmap)

    def pooled_features(self, fmap, rois, chunk: int = 64):
        """(R, 2048) mean-pooled res5 of RoIPool(14×14) of ``rois`` (R, 4) in scaled-image pixels.

        RoIs go through res5 ``chunk`` at a time, so memory is bounded by the chunk, not by R.
        """
        from torchvision.ops import roi_pool

        out = []
        for s in range(0, rois.shape[0], chunk):
            r = rois[s:s + chunk]
            idx = torch.zeros((r.shape[0], 1), dtype=r.dtype, device=r.device)
            # float32 boxes and map: low-precision box coordinates would move the pooling bins
            x = roi_pool(fmap.float(), torch.cat([idx, r], dim=1).float(), POOL_SIZE, SPATIAL_SCALE)
            out.append(self.roi_heads.res5(x).float().mean(dim=(2, 3)))
        if not out:
            return fmap.new_zeros((0, 2048), dtype=torch.float32)
        return torch.cat(out)

    def heads(self, pooled):
        return self.roi_heads.box_predictor(pooled)


def init_random(model: ButdR101, seed: int) -> ButdR101:
    """Random weights from ``seed`` (``--detector-weights none``): He-normal convs, identity norms
    except the stem's, scaled by 1/64 (Caffe feeds pixels minus the mean, not divided by a std),
    and each residual branch's last, scaled by 0.2 (keeps 33 random blocks O(1)); Caffe's
    N(0, 0.01) fillers for the RPN and the heads."""
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, FrozenBN):
                m.weight.fill_(0.2 if name.endswith("conv3.norm") else 1.0 / 64 if name.startswith("backbone.stem")
                               else 1.0)
                m.bias.zero_()
                m.running_mean.zero_()
                m.running_var.fill_(1.0)
            elif isinstance(m, (nn.Conv2d, nn.Linear, nn.Embedding)):
                fan_in = m.weight[0].numel()
                std = (2.0 / fan_in) ** 0.5 if isinstance(m, ConvBN) else 0.01
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
    return model


def build_empty(device="cpu") -> ButdR101:
    """The model with uninitialised storage on ``device`` (to be loaded or randomly initialised)."""
    with torch.device("meta"):
        model = ButdR101()
    return model.to_empty(device=device).eval()


def checkpoint_table() -> dict[str, tuple[int, ...]]:
    """Every key of the converted checkpoint this model loads, with its shape (built on meta)."""
    return {k: tuple(v.shape) for k, v in build_empty("meta").state_dict().items()}
