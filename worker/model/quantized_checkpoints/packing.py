"""What the published formats share: levels packed into int32 words, least significant first.

GPTQ packs 32 // bits levels of consecutive input features (its qweight) or output features (its
qzeros) into each word; compressed-tensors packs along the input (its levels) or the output (its
zero points) the same way; AWQ packs eight output features per word in its own interleaved order
(``awq.AWQ_ORDER``). Every reader checks what it is given before it unpacks, so a malformed
checkpoint is refused by name (``ModelLoadError``) instead of failing in torch.
"""

from __future__ import annotations

import torch

from worker.errors import ModelLoadError


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """[.., n, ..] int32 words -> [.., n * 32 // bits, ..] uint8 levels along ``dim``: word k holds
    levels k * per .. (k + 1) * per - 1, the first in its lowest ``bits``."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    dim = dim % packed.dim()
    view = [1] * (packed.dim() + 1)
    view[dim + 1] = per
    # an arithmetic shift of a negative word only fills bits the mask drops
    levels = (packed.unsqueeze(dim + 1) >> shifts.view(view)) & (2**bits - 1)
    shape = list(packed.shape)
    shape[dim] *= per
    return levels.reshape(shape).to(torch.uint8)


def pack_int32(levels: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The inverse of ``unpack_int32`` (for building test checkpoints): levels along ``dim``, a
    multiple of 32 // bits of them, into int32 words."""
    per = 32 // bits
    dim = dim % levels.dim()
    shape = list(levels.shape)
    shape[dim : dim + 1] = [shape[dim] // per, per]
    grouped = levels.to(torch.int64).reshape(shape)
    view = [1] * grouped.dim()
    view[dim + 1] = per
    shifts = torch.arange(0, 32, bits, dtype=torch.int64).view(view)
    words = (grouped << shifts).sum(dim + 1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def tensor(tensors: dict[str, torch.Tensor], module: str, name: str) -> torch.Tensor:
    """``module.name`` from a module's tensors, or a refusal naming the missing one."""
    try:
        return tensors[name]
    except KeyError:
        raise ModelLoadError(f"the quantized checkpoint has no {module}.{name}") from None


def expect(t: torch.Tensor, where: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]):
    """Refuse ``t`` unless it has ``shape`` and one of ``dtypes``."""
    if tuple(t.shape) != shape or t.dtype not in dtypes:
        wanted = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelLoadError(
            f"{where} is {str(t.dtype).removeprefix('torch.')} {list(t.shape)}, "
            f"expected {wanted} {list(shape)}"
        )


FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def scales_fp32(t: torch.Tensor, where: str) -> torch.Tensor:
    """Scales widened exactly to fp32; a non-finite or negative one is refused."""
    s = t.float()
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ModelLoadError(f"{where} has non-finite or negative scales")
    return s.contiguous()
