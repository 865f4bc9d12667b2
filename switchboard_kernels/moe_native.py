"""A sparse MoE layer's grouped experts in one native call on CPU (``moe_bf16_cpu.c``,
``moe_f32_cpu.c``, both over ``moe_steps.h``), over the panels each expert's projections
already hold for the native projection kernels (no second copy of the weights).

``GroupedExperts.of`` is None where the kernel cannot serve a layer: no C compiler (or
``SWITCHBOARD_NATIVE_KERNELS=0``), a CPU without the bf16 panels' ISA (then its projections are
not in panels either), experts whose plan multiplies small batches through oneDNN or a 4-bit
copy. ``worker.model.moe`` then runs its per-expert torch path, as it does for steps whose
experts get more rows than the plan gives the panels (``max_rows``: on an AMX Xeon oneDNN's
tiles win from a few rows up).
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import torch

from switchboard_kernels import native
from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_native import Bf16PanelLinear, PanelLinear

MAX_TOP_K = 64  # as MOE_MAX_TOP_K in moe_steps.h
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_STATUS = {1: "an expert id out of range or top_k outside 1..64", 2: "out of memory"}


@functools.cache
def grouped_kernel(dtype: torch.dtype, extra_flags: tuple[str, ...] = ()):
    """``sb_moe_bf16`` / ``sb_moe_f32`` typed for ctypes, built on first use; None where it
    cannot be. ``extra_flags``: a build of another CPU's path (tests)."""
    source = "moe_bf16_cpu.c" if dtype == torch.bfloat16 else "moe_f32_cpu.c"
    if extra_flags:
        from pathlib import Path

        lib = ctypes.CDLL(str(native.build(Path(native.__file__).with_name(source), extra_flags)))
    else:
        lib = native.load(source)
    if lib is None:
        return None
    name = "sb_moe_bf16" if dtype == torch.bfloat16 else "sb_moe_f32"
    if not getattr(lib, f"{name}_available")():
        return None
    kernel = getattr(lib, name)
    kernel.restype = ctypes.c_int
    kernel.argtypes = [_ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr]
    return kernel


class GroupedExperts:
    """One sparse layer's experts for the native kernel: the addresses of each expert's panel
    descriptors (gate_up: hidden -> 2 * intermediate, gate then up; down: intermediate ->
    hidden). Holds the projections, which own the panels, for as long as it lives."""

    __slots__ = ("_down", "_gate_up", "_keep", "_kernel", "dtype", "hidden", "max_rows")
    __slots__ += ("num_experts",)

    def __init__(self, gate_up: Sequence[Linear], down: Sequence[Linear], *, kernel=None) -> None:
        """``kernel``: another build's ``grouped_kernel`` (tests run the path a CPU lacks)."""
        panels = [_panels(linear) for linear in (*gate_up, *down)]
        if not gate_up or len(gate_up) != len(down) or any(p is None for p in panels):
            raise ValueError("grouped experts: every projection in the native panels")
        self.dtype = torch.bfloat16 if isinstance(panels[0], Bf16PanelLinear) else torch.float32
        shapes = {(type(p), p.out_features, p.in_features) for p in panels[: len(gate_up)]}
        shapes_down = {(type(p), p.out_features, p.in_features) for p in panels[len(gate_up) :]}
        if len(shapes) != 1 or len(shapes_down) != 1:
            raise ValueError("grouped experts: one kind and shape for all experts")
        (kind, two_inter, hidden), (kind_down, out, inter) = *shapes, *shapes_down
        if kind is not kind_down or two_inter != 2 * inter or out != hidden:
            raise ValueError("grouped experts: gate_up [2I, H] and down [H, I]")
        self._kernel = kernel or grouped_kernel(self.dtype)
        if self._kernel is None:
            raise RuntimeError("the native grouped-experts kernel is not available here")
        self.num_experts, self.hidden = len(gate_up), hidden
        # The panels serve up to the plan's split (all rows where one kernel serves).
        self.max_rows = min(
            linear.split_rows if linear.large is not linear.small else math.inf
            for linear in (*gate_up, *down)
        )
        table = ctypes.c_void_p * len(gate_up)
        self._keep = (
            panels,
            table(*(p._desc_address for p in panels[: len(gate_up)])),
            table(*(p._desc_address for p in panels[len(gate_up) :])),
        )
        self._gate_up, self._down = (ctypes.addressof(t) for t in self._keep[1:])

    @classmethod
    def of(cls, gate_up: Sequence[Linear], down: Sequence[Linear]) -> GroupedExperts | None:
        """The kernel over these experts, or None where it cannot serve them (see the module)."""
        try:
            return cls(gate_up, down)
        except (ValueError, RuntimeError):
            return None

    def serves(self, x: torch.Tensor, experts: torch.Tensor) -> bool:
        """Whether a step of these rows, routed to ``experts`` ([tokens, top_k]), goes through
        the kernel: x's dtype on CPU, and no expert gets more rows than ``max_rows``."""
        if x.dtype != self.dtype or x.device.type != "cpu" or experts.shape[1] > MAX_TOP_K:
            return False
        if x.shape[0] <= self.max_rows:
            return True
        return int(torch.bincount(experts.flatten()).max()) <= self.max_rows

    def __call__(
        self,
        x: torch.Tensor,  # [tokens, hidden] in self.dtype
        experts: torch.Tensor,  # [tokens, top_k] int64: each token's experts
        weights: torch.Tensor,  # [tokens, top_k]: their routing weights (any float dtype)
    ) -> torch.Tensor:  # [tokens, hidden]
        """Semantics: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) *
        up_e(x[t]))`` over ``e = experts[t, j]`` in ascending expert order, each product,
        the activation, the scaled pair and each partial sum rounded to x's dtype as the
        per-expert torch path rounds them."""
        if (
            x.dtype != self.dtype
            or x.dim() != 2
            or x.shape[1] != self.hidden
            or x.device.type != "cpu"
            or experts.shape != weights.shape
            or experts.dim() != 2
            or experts.shape[0] != x.shape[0]
        ):
            raise ValueError(
                f"grouped experts: x {tuple(x.shape)} {x.dtype}, experts "
                f"{tuple(experts.shape)}, weights {tuple(weights.shape)}: CPU rows of "
                f"{self.hidden} in {self.dtype}, [rows, top_k] ids and weights"
            )
        x = x.contiguous()
        ids = experts.to(torch.int64).contiguous()
        w = weights.to(torch.float32).contiguous()
        out = torch.empty_like(x)
        status = self._kernel(
            self._gate_up,
            self._down,
            self.num_experts,
            x.data_ptr(),
            x.shape[0],
            ids.data_ptr(),
            w.data_ptr(),
            ids.shape[1],
            out.data_ptr(),
        )
        if status:
            raise ValueError(f"grouped experts: {_STATUS.get(status, status)}")
        return out


def _panels(linear: Linear) -> Bf16PanelLinear | PanelLinear | None:
    """The native panels that multiply this projection's small batches, if they do (and no
    4-bit copy stands before them)."""
    if linear.int4 is not None or not isinstance(linear.small, Bf16PanelLinear | PanelLinear):
        return None
    if linear.small.bias is not None:
        return None
    return linear.small
