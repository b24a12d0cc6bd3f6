"""Attention weights of a trained model for one image–caption pair, without touching its code.

SEAM's hops × words matrices (Wehrmann et al., after Lin et al.), SMAN's grid and word softmaxes of
steps 1 and 2 (Ji et al.) and SAF/SGR's text self-attention (Diao et al. eq. 3-4). Every softmax of
``encode_images``, ``encode_captions`` and ``score`` is recorded under a ``TorchFunctionMode``, and those over the
caption's words (their axis grows when the caption is padded by ``PROBE_PAD`` tokens) and over the
G×G grid cells are kept. A model without such attention says why (:func:`no_attention_reason`).
docs/report.md, "Where the numbers come from", says what each model shows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PROBE_PAD = 3  # extra pad tokens of the second, probing run


@dataclass
class AttentionView:
    kind: str                 # "words" or "grid"
    title: str
    weights: np.ndarray       # words: (rows, L); grid: (G, G)


def _softmax_recorder(model):
    """A TorchFunctionMode recording ``(weights as (rows, size), module path)`` of every softmax,
    and the forward hooks that keep track of the module being run."""
    from torch.overrides import TorchFunctionMode

    stack: list[str] = []

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.records: list[tuple[np.ndarray, str]] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if getattr(func, "__name__", "") in ("softmax", "_softmax") and isinstance(out, torch.Tensor):
                dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
                if isinstance(dim, int) and out.dim() > 0:
                    arr = out.detach().float().cpu().movedim(dim % out.dim(), -1).numpy()
                    self.records.append((arr.reshape(-1, arr.shape[-1]), stack[-1] if stack else ""))
            return out

    def enter(name):
        def hook(module, args):
            stack.append(name)  # a pre-hook must return None, or it replaces the input
        return hook

    def leave(module, args, output):
        if stack:
            stack.pop()  # a forward hook must return None, or it replaces the output

    handles = []
    for name, module in model.named_modules():
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave))
    return Recorder(), handles


def _run(model, feats, counts, tokens, lengths) -> list[tuple[np.ndarray, str]]:
    """The softmaxes :func:`_softmax_recorder` records while the pair is encoded and scored."""
    recorder, handles = _softmax_recorder(model)
    try:
        with torch.no_grad(), recorder:
            model.score(model.encode_images(feats, counts), model.encode_captions(tokens, lengths))
    finally:
        for h in handles:
            h.remove()
    return recorder.records


def _word_title(model, module: str, index: int, n: int) -> str:
    """``txt_enc.att.0`` → a readable name (SEAM-C's three modules get their inputs' names)."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[-2] == "att" and parts[-1].isdigit():
        parent = model.get_submodule(".".join(parts[:-2])) if len(parts) > 2 else model
        if getattr(parent, "variant", None) == "c":
            names = ("over conv-2", "over conv-3", "over word embeddings")
            return f"word weights {names[int(parts[-1]) % 3]}"
    if parts[-1] == "t_att":  # SGRAF's text global self-attention
        return "word weights (text self-attention)"
    if len(parts) >= 2 and parts[-2] == "txt_att" and parts[-1].isdigit():  # SMAN's text steps
        return f"word weights, step {int(parts[-1]) + 1}"
    if module:
        return f"word weights ({module_in_words(module)})"
    return f"word weights ({index})" if n > 1 else "word weights"


#: the words for the parts of a module path (``txt_enc.att.0`` → "caption encoder, attention 1")
MODULE_WORDS = {"txt_enc": "caption encoder", "text_encoder": "caption encoder", "txt": "caption",
                "img_enc": "image encoder", "image_encoder": "image encoder", "img": "image",
                "att": "attention", "attn": "attention", "attention": "attention", "t_att": "text self-attention",
                "v_att": "image self-attention", "txt_att": "caption attention", "img_att": "image attention",
                "sim": "similarity", "gru": "GRU", "rnn": "RNN", "fc": "projection", "layers": "layer"}


def module_in_words(module: str) -> str:
    """A module path in words: known parts named, a number joined to the part before it (1-based)."""
    words: list[str] = []
    for part in module.split("."):
        if part.isdigit():
            if words:
                words[-1] = f"{words[-1]} {int(part) + 1}"
            else:
                words.append(f"module {int(part) + 1}")
            continue
        words.append(MODULE_WORDS.get(part, part.replace("_", " ")))
    return ", ".join(words)


def pair_attention(model, feats, counts, tokens, lengths) -> list[AttentionView]:
    """Attention views of one (image, caption) pair: ``feats`` (1, ...), ``tokens`` (1, L)."""
    n_words = int(lengths[0])
    tokens = tokens[:, :n_words]
    grid_side = int(feats.shape[1]) if feats.dim() == 4 and feats.shape[1] == feats.shape[2] else None
    first = _run(model, feats, counts, tokens, lengths)
    padded = torch.nn.functional.pad(tokens, (0, PROBE_PAD))
    second = _run(model, feats, counts, padded, lengths)
    if len(first) == len(second):
        # over words: the softmax axis grows with the padding, its rows do not (a words × words
        # matrix, such as SGR's graph edges without a global node, grows in both and is left out)
        words = [(r, m) for (r, m), (r2, _) in zip(first, second)
                 if r.shape[-1] == n_words and r2.shape[-1] == n_words + PROBE_PAD and len(r2) == len(r)]
    else:  # the model took another path with padding: fall back to the size alone
        words = [(r, m) for r, m in first if r.shape[-1] == n_words]
    views: list[AttentionView] = []
    titles = [_word_title(model, module, i, len(words)) for i, (_, module) in enumerate(words, 1)]
    steps = [t for t in titles if ", step " in t]
    for i, (r, module) in enumerate(words):
        if steps and not module:  # a later step run outside a module's forward (SMAN's pairwise step 2)
            steps.append(f"word weights, step {len(steps) + 1}")
            titles[i] = steps[-1]
        views.append(AttentionView("words", titles[i] + (f", {len(r)} hops" if len(r) > 1 else ""), r))
    if grid_side:
        # a softmax over G*G cells keeps its size when the caption is padded; one over words (a
        # 49-word caption against SMAN's 7x7 grid) grows, and is never taken for a grid map
        cells = grid_side * grid_side
        if len(first) == len(second):
            grids = [r for (r, _), (r2, _) in zip(first, second) if r.shape[-1] == cells and r2.shape[-1] == cells]
        else:
            taken = {id(r) for r, _ in words}
            grids = [r for r, _ in first if r.shape[-1] == cells and id(r) not in taken]
        for i, r in enumerate(grids, 1):
            title = f"grid weights, step {i}" if len(grids) > 1 else "grid weights"
            views.append(AttentionView("grid", title, r.mean(axis=0).reshape(grid_side, grid_side)))
    return views


def no_attention_reason(model, name: str) -> str:
    """Why ``model`` (registry name ``name``) has no attention view, in its paper's terms."""
    mode, glob = getattr(model, "mode", None), getattr(model, "global_module", None)
    if mode in ("sgr", "saf"):
        vectors = "local (word–region) alignment vectors" if glob == "none" else \
            "local (word–region) and global alignment vectors"
        how = ("similarity graph reasoning over its " + vectors if mode == "sgr"
               else "filtering its " + vectors + " with sigmoid weights")
        why = {"t-emde": "its global vectors come from T-EMDE sketches, not from the text self-attention "
                         "that weights the words",
               "none": "it has no global node (--global-module none), so no text self-attention"
               }.get(glob, "no text self-attention softmax was recorded")
        return (f"{mode.upper()} scores a pair by {how}; {why}. Its other softmaxes (each word's alignment over "
                f"the regions{', the graph edges' if mode == 'sgr' else ''}) are not weights over the caption's "
                f"words or grid cells, so there is nothing to show here")
    if name in ("vse", "order"):
        return (f"{name} embeds images and captions without attention (VSE++ / order embeddings), so there is "
                f"nothing to show here")
    return f"{name}: no softmax over the caption's words or the grid cells was recorded"
