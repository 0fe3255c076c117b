"""Linear layers on a CPU: weights packed in panels, multiplied by labkit's own C++ loop.

A decode step multiplies one row per sequence by every weight matrix: at a class's batch
sizes (1 to 16 rows) that reads all of the model's weights for a couple of multiply-adds
per weight, so it runs at the speed memory delivers the weights. ``csrc/linear.cpp``
streams them at that speed: each weight matrix ``W [N, K]`` is packed once, at load, into
*panels* of 16 output columns (:func:`pack_panels`), each a contiguous ``[K, 16]`` block
whose rows are one 64-byte cache line, and the loop keeps a tile of rows times panels in
vector registers while it reads every weight once. The comments there say how and why;
``python -m labkit.bench matmul`` measures it against oneDNN and MKL on this machine.

Every output is summed in the same order whatever the number of rows (``linear.cpp``: batch
invariance), so a sequence's logits do not change with the other sequences of its step.

``linear_panels_ref`` is the reference: ``F.linear`` on the weight unpacked again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANEL = 16  # output columns per panel: one Vec16 (csrc/vec.h)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] (``nn.Linear``'s layout) as panels [ceil(N / 16), K, 16], fp32:
    ``panels[p, k, j] = weight[16 p + j, k]``, the columns past N zero."""
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is [out_features, in_features], got shape {tuple(weight.shape)}")
    if weight.dtype != torch.float32:
        raise ValueError(f"panels are fp32 (the C++ loop multiplies fp32), got {weight.dtype}")
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    w = F.pad(weight.detach(), (0, 0, 0, padded - n)) if padded != n else weight.detach()
    return w.reshape(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight [N, K] that :func:`pack_panels` packed."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features]


def linear_panels_ref(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: ``F.linear`` with the unpacked weight."""
    return F.linear(x, unpack_panels(panels, out_features), bias)


def linear_panels(ext, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for fp32 ``x`` [..., K] through the compiled loop ``ext``
    (``cpu_extension.load()``); any leading dimensions are flattened and restored."""
    lead = x.shape[:-1]
    y = ext.linear_panels(x.reshape(-1, x.shape[-1]).contiguous(), panels, out_features, bias)
    return y.view(*lead, out_features)
