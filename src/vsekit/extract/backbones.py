"""Backbones by name: VGG-16, VGG-19 and ResNet-152 (torchvision weights enums), Inception-ResNet-v2
and any other timm model (timm pretrained tags).

A backbone is a small registered spec that knows how to build the network, where its preprocessing
config lives (the weights' own transforms / timm ``pretrained_cfg``) and which named layers give the
``global`` feature, the default FNE taps and the last convolutional map (grids, regions).

Papers: the Full-Network Embedding on VGG-16 (Vilalta et al., Sec. 3: 12,416 features), VGG-19 fc7
(the VSE++ / FNE papers' single-layer baseline), Inception-ResNet-v2
global pool (SEAM, Wehrmann et al.), ResNet-152 res5c = torchvision ``layer4`` (SMAN, Ji et al.).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

WEIGHT_CHOICES = ("imagenet", "none")


@dataclass(frozen=True)
class Preprocess:
    """What the weights expect: crop (input) size, resize size, mean/std, interpolation."""

    crop_size: int
    resize: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    interpolation: str  # "bilinear" | "bicubic" | "nearest"


@dataclass(frozen=True)
class BackboneSpec:
    name: str
    build: Callable[[bool], Any]           # pretrained -> nn.Module (eval mode not yet set)
    preprocess: Callable[[Any], Preprocess]  # model -> its weights' preprocessing
    global_tap: Callable[[Any], str]
    conv_tap: Callable[[Any], str]          # last conv map (grid / regions)
    fne_taps: Callable[[Any], list[str]]
    source: str = "timm"
    extra: dict = field(default_factory=dict)


_REGISTRY: dict[str, BackboneSpec] = {}


def register_backbone(spec: BackboneSpec) -> BackboneSpec:
    if spec.name in _REGISTRY:
        raise ValueError(f"backbone {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def registered_backbones() -> list[str]:
    return sorted(_REGISTRY)


# --- torchvision ---------------------------------------------------------------------------------
def _torchvision(name: str, weights_name: str, **taps: Callable) -> BackboneSpec:
    """torchvision's ``name`` with (or without) its ``WEIGHTS_NAME.IMAGENET1K_V1`` weights, whose
    transforms are its preprocessing (torchvision imported when asked)."""
    def weights():
        import torchvision.models as tvm

        return getattr(tvm, weights_name).IMAGENET1K_V1

    def build(pretrained: bool):
        import torchvision.models as tvm

        return getattr(tvm, name)(weights=weights() if pretrained else None)

    def preprocess(model) -> Preprocess:
        t = weights().transforms()
        return Preprocess(crop_size=int(t.crop_size[0]), resize=int(t.resize_size[0]),
                          mean=tuple(float(v) for v in t.mean), std=tuple(float(v) for v in t.std),
                          interpolation=str(t.interpolation.value))
    return register_backbone(BackboneSpec(name=name, build=build, preprocess=preprocess, source="torchvision",
                                          **taps))


def vgg_fne_taps(model) -> list[str]:
    """The Full-Network Embedding taps of a torchvision VGG: every conv layer and fc6, fc7, each
    after its ReLU, spatially averaged (Garcia-Gasulla et al., "An out-of-the-box full-network
    embedding", Sec. 3; used on VGG-16 by Vilalta et al., Sec. 3: 13 conv + 2 fc = 12,416 features).

    Post-ReLU for both kinds: the FNE reads the layers' activations in the authors' Caffe/TF-slim
    VGG-16, where each ReLU is fused into (in place on) its conv / fc output, and fc8 is left out.
    Pre-ReLU values stay reachable with ``--taps`` (``classifier.0``, ``classifier.3``).
    """
    import torch.nn as nn

    def relu_after(seq, kind):
        return [i for i, m in enumerate(seq) if isinstance(m, nn.ReLU) and i > 0 and isinstance(seq[i - 1], kind)]

    return ([f"features.{i}" for i in relu_after(model.features, nn.Conv2d)]
            + [f"classifier.{i}" for i in relu_after(model.classifier, nn.Linear)])


_BLOCK_RE = re.compile(r"(Block|Bottleneck|Mixed|Reduction|Stage)", re.I)


def block_outputs(model) -> list[str]:
    """Default FNE taps of residual/inception nets: the outputs of their top-most blocks."""
    names: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(p + ".") for p in names):
            continue
        if _BLOCK_RE.search(type(module).__name__) and not type(module).__name__.endswith(("Sequential", "ModuleList")):
            names.append(name)
    if not names:  # fall back on timm's feature_info stages
        info = getattr(model, "feature_info", None) or []
        names = [d["module"] for d in info if "module" in d]
    return names


for _depth in (16, 19):  # VGG-16 is the FNE paper's network, VGG-19 its global fc7 baseline's
    _torchvision(f"vgg{_depth}", f"VGG{_depth}_Weights", global_tap=lambda m: "classifier.4",
                 conv_tap=lambda m: f"features.{len(m.features) - 2}", fne_taps=vgg_fne_taps)
_torchvision("resnet152", "ResNet152_Weights", global_tap=lambda m: "avgpool", conv_tap=lambda m: "layer4",
             fne_taps=block_outputs)


# --- timm ----------------------------------------------------------------------------------------
def _timm_build(timm_name: str) -> Callable[[bool], Any]:
    def build(pretrained: bool):
        import timm
        return timm.create_model(timm_name, pretrained=pretrained)
    return build


def _timm_preprocess(model) -> Preprocess:
    from timm.data import resolve_data_config

    cfg = resolve_data_config({}, model=model)
    crop = int(cfg["input_size"][-1])
    crop_pct = float(cfg.get("crop_pct") or 0.875)
    return Preprocess(crop_size=crop, resize=int(crop / crop_pct),
                      mean=tuple(float(v) for v in cfg["mean"]), std=tuple(float(v) for v in cfg["std"]),
                      interpolation=str(cfg.get("interpolation") or "bilinear"))


def _timm_global(model) -> str:
    names = dict(model.named_modules())
    # the pre-logits vector (timm's forward_head(pre_logits=True)): after the head's pooling and norm
    for cand in ("head_drop", "head.drop", "global_pool", "head.global_pool", "avgpool"):
        if cand in names:
            return cand
    raise ValueError(f"cannot find a pooled layer in {type(model).__name__}; use --kind fne --taps NAME")


def _timm_conv(model) -> str:
    info = getattr(model, "feature_info", None) or []
    names = [d["module"] for d in info if "module" in d]
    if names:
        return names[-1]
    raise ValueError(f"{type(model).__name__} has no feature_info; cannot find its last conv map")


register_backbone(BackboneSpec(
    name="inception_resnet_v2", build=_timm_build("inception_resnet_v2.tf_in1k"),
    preprocess=_timm_preprocess, global_tap=_timm_global, conv_tap=lambda m: "conv2d_7b",
    fne_taps=block_outputs))


def get_backbone(name: str) -> BackboneSpec:
    """A registered backbone, or any timm model by name."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    import timm

    if not timm.is_model(name):
        from ..suggest import unknown_model

        raise ValueError(unknown_model(name, registered_backbones(), pool=[*registered_backbones(), *timm.list_models()],
                                       more="or any timm model name, see timm.list_models()"))
    return BackboneSpec(name=name, build=_timm_build(name), preprocess=_timm_preprocess,
                        global_tap=_timm_global, conv_tap=_timm_conv, fne_taps=block_outputs)


# --- building with weights -----------------------------------------------------------------------
def weights_kind(weights: str | None) -> str:
    """``imagenet`` | ``none`` | ``path``; a missing file is an error naming it."""
    w = (weights or "none").strip()
    if w in WEIGHT_CHOICES:
        return w
    if not Path(w).is_file():
        raise ValueError(f"--weights {w!r}: not 'imagenet', 'none' or an existing checkpoint file")
    return "path"


def build_model(name: str, weights: str | None = "imagenet", seed: int = 0, device: str = "meta"):
    """Build backbone ``name`` in eval mode.

    ``weights``: ``imagenet`` (the library's normal download/cache path), ``none`` (random
    initialisation from ``seed``, identical in every process), or a local checkpoint path loaded
    with ``torch.load(weights_only=True)``. ``device="meta"`` builds shapes only (no memory).
    """
    import torch

    spec = get_backbone(name)
    kind = weights_kind(weights)
    if device == "meta":
        with torch.device("meta"):
            model = spec.build(False)
        return model.eval()
    if kind == "imagenet":
        try:
            model = spec.build(True)
        except Exception as exc:  # network, hub or cache errors
            raise ValueError(
                f"cannot load the imagenet weights of {name!r} ({type(exc).__name__}: {exc}); "
                f"download the checkpoint on a machine with internet and pass --weights PATH, "
                f"or use --weights none for a random initialisation") from exc
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            model = spec.build(False)
        if kind == "path":
            load_checkpoint(model, weights)
    return model.eval().to(device)


def load_failure(exc: BaseException) -> str:
    """One line saying why ``torch.load(weights_only=True)`` refused a file.

    torch's own message is several lines of advice, including loading with ``weights_only=False``,
    which would run the file's code: vsekit never does, so only the reason itself is kept.
    """
    text = str(exc)
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            text = line.split("WeightsUnpickler error:", 1)[1]
            break
    else:
        text = text.strip().splitlines()[0] if text.strip() else ""
    text = text.split(" Please use `torch.serialization", 1)[0].strip()
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def read_state(path: str | Path, flag: str = "--weights",
               refused: str = "cannot load it as a PyTorch checkpoint") -> dict:
    """The state dict in the checkpoint at ``path``, read with ``torch.load(weights_only=True)`` (under
    ``state_dict``, ``model`` or ``model_state_dict`` if it is there, ``module.`` prefixes dropped); a
    ValueError naming ``flag`` and the file where it is not one (``refused``: what it says first)."""
    import torch

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ValueError(f"{flag} {path}: {refused} with weights_only=True ({load_failure(exc)}); save the "
                         f"model's state_dict (tensors only)") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"{flag} {path}: expected a state dict, got {type(state).__name__}")
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_checkpoint(model, path: str | Path) -> None:
    state = read_state(path)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(f"--weights {path} does not match {type(model).__name__}: {exc}") from exc
