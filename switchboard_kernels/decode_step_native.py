"""A served model's decode step in one native call (``decode_step_cpu.c``), exactly as its
torch path computes it, through the same kernels, plain LoRA adapters included.

``NativeDecodeStep.build`` returns None where a projection's kernel is not one the native
step can call (oneDNN, torch's, an act-order quantized weight) or a kernel is not built;
the model runner then runs every step through torch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from switchboard_kernels import native
from switchboard_kernels.activation_native import native_activation
from switchboard_kernels.attention_native import MAX_HEAD_DIM, native_attention
from switchboard_kernels.linear_native import Bf16PanelLinear, PanelLinear
from switchboard_kernels.lora_native import native_library as native_lora
from switchboard_kernels.norm_native import native_norm
from switchboard_kernels.wq_native import WqLinear

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
PANELS, WQ = 0, 1  # ``kind`` in decode_step_cpu.c
INTERRUPTED = 1  # SB_STEP_INTERRUPTED: the step stopped before a layer


class Projection(Protocol):
    """What the step needs of a projection (``switchboard_kernels.linear.Linear``)."""

    split_rows: int
    small: object
    large: object
    int4: object


class DecoderLayer(Protocol):
    """What the step needs of each layer (``worker.model.layers.LayerWeights``)."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


class _Projection(ctypes.Structure):
    """``struct sb_step_projection``."""

    _fields_ = [("kind", _i64), ("fn", _ptr), ("desc", _ptr), ("sum_desc", _ptr)]
    _fields_ += [("out_fp32", _i64)]


class _Layer(ctypes.Structure):
    """``struct sb_step_layer``."""

    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr)]
    _fields_ += [(name, _Projection) for name in ("qkv", "o", "gate_up", "down")]


class _LoraGroup(ctypes.Structure):
    """``struct sb_step_lora_group``."""

    _fields_ = [("table", _ptr), ("scales", _ptr)]


class _Lora(ctypes.Structure):
    """``struct sb_step_lora``."""

    _fields_ = [("num_groups", _i64), ("slots", _ptr), ("starts", _ptr), ("rows", _ptr)]
    _fields_ += [("groups", _ptr), ("bgmv", _ptr)]


LORA_GROUPS = ("qkv", "o", "gate_up", "down")  # each layer's, in decode_step_cpu.c's order


class StepLora(Protocol):
    """What the step needs of a step's LoRA (``worker.model.lora_manager.LoraBatch``, built
    for the native kernel: ``mapping.cpu.native`` set; no DoRA, mixes or saved modules)."""

    mapping: object
    stacks: list


class _Model(ctypes.Structure):
    """``struct sb_step_model``."""

    _fields_ = [
        *[(n, _i64) for n in ("num_layers", "hidden", "heads", "kv_heads", "head_dim")],
        *[(n, _i64) for n in ("intermediate", "block_size", "logits_width")],
        ("eps", _f32),
        ("scale", _f32),
        ("fp32", _i64),
        *[(n, _ptr) for n in ("embed", "final_norm", "cos", "signed_sin", "layers")],
        ("lm_head", _Projection),
        *[(n, _ptr) for n in ("key_caches", "value_caches", "norm", "activation", "attention")],
    ]


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value  # type: ignore[arg-type]


def _projection(linear: Projection) -> tuple[_Projection, int] | None:
    """The struct for ``linear``'s small-row kernel and the most rows that kernel takes, or
    None where the step cannot call it as the torch path does."""
    if linear.int4 is not None:  # a draft's approximate copy
        return None
    kernel = linear.small
    rows = 1 << 62 if linear.large is kernel else linear.split_rows
    if isinstance(kernel, Bf16PanelLinear):
        fields = (PANELS, _address(kernel._call), kernel._desc_address)
        return _Projection(*fields, kernel._fp32_sum_address, int(kernel.fp32_out)), rows
    if isinstance(kernel, PanelLinear):
        fields = (PANELS, _address(kernel._call), kernel._desc_address)
        return _Projection(*fields, None, 1), rows
    if isinstance(kernel, WqLinear) and kernel.input_order is None:
        fields = (WQ, _address(kernel._call), kernel.desc_address)
        return _Projection(*fields, None, int(kernel.fp32_out)), rows
    return None


class NativeDecodeStep:
    """A decode step for up to ``max_rows`` sequences feeding one token each: the K/V written
    into the given caches, the sampled rows' logits returned, fp32."""

    def __init__(
        self,
        lib: NativeStepKernel,
        model: _Model,
        keep: list[object],
        *,
        max_rows: int,
        vocab: int,
        num_blocks: int,
        block_size: int,
        max_positions: int,
    ) -> None:
        self._call = lib.step
        self._model = model
        self._address = ctypes.addressof(model)
        self._keep = keep  # everything the struct points at
        self.max_rows = max_rows
        self.vocab, self.num_blocks, self.block_size = vocab, num_blocks, block_size
        self.max_positions = max_positions
        self.logits_width = model.logits_width
        self.dtype = torch.float32 if model.fp32 else torch.bfloat16

    @classmethod
    def build(
        cls,
        *,
        embed: torch.Tensor,  # [vocab, hidden], the model's dtype
        layers: Sequence[DecoderLayer],
        final_norm: torch.Tensor,  # [hidden]
        lm_head: Projection,
        cos: torch.Tensor,  # [max_positions, head_dim], the model's dtype, rotate-half
        signed_sin: torch.Tensor,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer
        heads: int,
        eps: float,
        scale: float,
    ) -> NativeDecodeStep | None:
        """The step over these weights, or None where a kernel it needs is not one it can
        call (see the module's docstring)."""
        lib, norms, act = native_step(), native_norm(), native_activation()
        attention = native_attention()
        dtype = embed.dtype
        if lib is None or norms is None or act is None or attention is None:
            return None
        if dtype not in (torch.bfloat16, torch.float32) or embed.device.type != "cpu":
            return None
        num_blocks, block_size, kv_heads, head_dim = kv_caches[0][0].shape
        caches_fit = all(t.dtype == dtype and t.is_contiguous() for kv in kv_caches for t in kv)
        if not caches_fit or head_dim > MAX_HEAD_DIM or head_dim % 2:
            return None
        norm_weights = [w.contiguous() for y in layers for w in (y.input_norm, y.post_norm)]
        tables = [cos.contiguous(), signed_sin.contiguous()]
        if any(t.dtype != dtype for t in (*norm_weights, *tables, final_norm)):
            return None
        structs = [[_projection(p) for p in (y.qkv, y.o, y.gate_up, y.down)] for y in layers]
        head = _projection(lm_head)
        if head is None or not head[0].out_fp32 or any(p is None for ps in structs for p in ps):
            return None
        max_rows = min(head[1], *(rows for ps in structs for _, rows in ps))  # type: ignore[misc]
        fp32 = dtype == torch.float32
        c_layers = (_Layer * len(layers))()
        for i, ps in enumerate(structs):
            c_layers[i] = _Layer(
                norm_weights[2 * i].data_ptr(),
                norm_weights[2 * i + 1].data_ptr(),
                *(p for p, _ in ps),  # type: ignore[misc]
            )
        keys = (_ptr * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches))
        values = (_ptr * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches))
        final = final_norm.contiguous()
        embed = embed.contiguous()
        norm_fn = norms.address(torch.float32, dtype)  # the fp32 residual stream's rows
        act_fn = act.address(dtype)
        model = _Model(
            len(layers),
            embed.shape[1],
            heads,
            kv_heads,
            head_dim,
            layers[0].down.small.in_features,  # type: ignore[attr-defined]
            block_size,
            lm_head.small.out_features,  # type: ignore[attr-defined]
            eps,
            scale,
            int(fp32),
            embed.data_ptr(),
            final.data_ptr(),
            tables[0].data_ptr(),
            tables[1].data_ptr(),
            ctypes.addressof(c_layers),
            head[0],
            ctypes.addressof(keys),
            ctypes.addressof(values),
            norm_fn,
            act_fn,
            attention.address,
        )
        keep = [embed, final, tables, norm_weights, c_layers, keys, values, kv_caches]
        keep += [layers, lm_head]
        return cls(
            lib,
            model,
            keep,
            max_rows=max_rows,
            vocab=embed.shape[0],
            num_blocks=num_blocks,
            block_size=block_size,
            max_positions=cos.shape[0],
        )

    def __call__(
        self,
        feeds: Sequence[tuple[int, int, Sequence[int]]],
        lora: StepLora | None = None,
        *,
        interrupt: int | None = None,
    ) -> torch.Tensor | None:
        """``feeds``: per sequence, (the token it feeds, its position, its block table); the
        token's K/V written where the table puts that position. ``lora``: the sequences'
        adapters, its mapping's rows in the feeds' order. Returns the logits after each,
        [sequences, the output layer's width] fp32; or None if the int32 at address
        ``interrupt`` was nonzero before a layer (the step stopped there)."""
        bs, rows = self.block_size, len(feeds)
        if not 0 < rows <= self.max_rows:
            raise ValueError(f"native decode step: {rows} rows, at most {self.max_rows}")
        tokens, positions, slots, starts, flat = [], [], [], [], []
        for token, position, table in feeds:
            if not (0 <= token < self.vocab and 0 <= position < self.max_positions):
                raise ValueError("native decode step: a token or position out of range")
            if len(table) * bs <= position:
                raise ValueError("native decode step: a block table short of its position")
            tokens.append(token)
            positions.append(position)
            slots.append(table[position // bs] * bs + position % bs)
            starts.append(len(flat))
            flat.extend(table)
        if min(flat) < 0 or max(flat) >= self.num_blocks:
            raise ValueError("native decode step: a block outside the cache")
        ints = torch.tensor([*tokens, *positions, *slots, *starts, *flat], dtype=torch.int64)
        base = ints.data_ptr()
        logits = torch.empty(rows, self.logits_width, dtype=torch.float32)
        lora_struct = None if lora is None else self._lora(lora, rows)
        status = self._call(
            self._address,
            rows,
            base,
            base + 8 * rows,
            base + 16 * rows,
            base + 24 * rows,
            base + 32 * rows,
            None if lora_struct is None else ctypes.addressof(lora_struct[0]),
            logits.data_ptr(),
            interrupt,
        )
        if status == INTERRUPTED:
            return None
        if status:
            raise MemoryError(f"native decode step: a kernel failed ({status})")
        return logits

    def _lora(self, lora: StepLora, rows: int) -> tuple[_Lora, object]:
        """The struct for this step's adapters, and what it points at (held by the caller
        until the call returns)."""
        groups = lora.mapping.cpu.native  # type: ignore[attr-defined]
        library = native_lora()
        if groups is None or library is None or groups.end > rows:
            raise ValueError("native decode step: LoRA rows not laid out for the native kernel")
        pointers = []
        for stacks in lora.stacks:
            for name in LORA_GROUPS:
                stack = stacks[name]
                used = stack.used
                if used and (
                    stack.native is None
                    or stack.native.dtype != self.dtype
                    or groups.max_slot >= stack.native.table.shape[0]
                ):
                    raise ValueError(f"native decode step: {name} LoRA slots it cannot read")
                table = stack.native.table.data_ptr() if used else None
                pointers.append(_LoraGroup(table, stack.scales.data_ptr() if used else None))
        array = (_LoraGroup * len(pointers))(*pointers)
        struct = _Lora(
            groups.num_groups,
            groups.slots.data_ptr(),
            groups.starts.data_ptr(),
            groups.rows.data_ptr(),
            ctypes.addressof(array),
            library.bgmv_address,
        )
        return struct, (array, groups)


class NativeStepKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.step = lib.sb_decode_step
        self.step.restype = _int
        self.step.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr]


@functools.cache
def native_step() -> NativeStepKernel | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("decode_step_cpu.c")
    return None if lib is None else NativeStepKernel(lib)
