"""The lane layout of packed weight levels (``switchboard_kernels/panel_levels.h``), shared by the
4-bit draft kernel (``q4_native``) and the quantized-base kernel (``wq_native``).

Panels of ``PANEL`` outputs; per group of input features, steps of 64 bytes, one 32-bit lane
per output holding 8 consecutive features' 4-bit levels (low nibbles the first 4, high nibbles
the next 4) or 4 features' 8-bit levels.
"""

from __future__ import annotations

import torch

PANEL = 16  # outputs per panel (PL_NR)


def padded_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` [out, ...] with zero rows appended to a whole number of panels."""
    pad = -t.shape[0] % PANEL
    return t if not pad else torch.cat([t, t.new_zeros(pad, *t.shape[1:])])


def pack_levels(q: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Levels [out, in] uint8 -> [panels, groups, group_size * PANEL * bits / 8] bytes."""
    q = padded_rows(q)
    padded, in_features = q.shape
    panels, groups = padded // PANEL, in_features // group_size
    if bits == 4:
        # [panel, lane, group, step, nibble, byte] -> [panel, group, step, lane, byte, nibble]
        v = q.view(panels, PANEL, groups, group_size // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
        return (v[..., 0] | (v[..., 1] << 4)).reshape(panels, groups, -1).contiguous()
    # [panel, lane, group, step, byte] -> [panel, group, step, lane, byte]
    v = q.view(panels, PANEL, groups, group_size // 4, 4).permute(0, 2, 3, 1, 4)
    return v.reshape(panels, groups, -1).contiguous()


def by_panel(t: torch.Tensor) -> torch.Tensor:
    """Per-output, per-group values [out, groups] -> [panels, groups, PANEL] (padded with 0)."""
    t = padded_rows(t)
    return t.view(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()
