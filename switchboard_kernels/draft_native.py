"""A draft model's decode pass, a few tokens per sequence, in one native call (``draft_cpu.c``).

Built and loaded by ``switchboard_kernels/native.py``; ``native_draft()`` is None where it cannot
be, and the model runner then runs the draft's passes through its torch path.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Protocol

import torch

from switchboard_kernels import native
from switchboard_kernels.attention_native import DTYPES, MAX_HEAD_DIM, native_attention
from switchboard_kernels.linear import Linear
from switchboard_kernels.q4_native import Q4Linear

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


class DecoderLayer(Protocol):
    """What a pass needs of each layer (``worker.model.layers.LayerWeights``)."""

    input_norm: torch.Tensor
    qkv: Linear
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class _Layer(ctypes.Structure):
    """``struct sb_draft_layer`` in draft_cpu.c."""

    _fields_ = [(name, _ptr) for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down")]


class _Draft(ctypes.Structure):
    """``struct sb_draft`` in draft_cpu.c."""

    _fields_ = [
        *[(n, _i64) for n in ("num_layers", "hidden", "heads", "kv_heads", "head_dim")],
        ("intermediate", _i64),
        ("block_size", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("fp32", _int),
        *[(n, _ptr) for n in ("embed", "final_norm", "cos", "signed_sin", "layers", "lm_head")],
        ("key_caches", _ptr),
        ("value_caches", _ptr),
        ("attention", _ptr),
    ]


def q4_weights(linears: Sequence[Linear]) -> list[Q4Linear] | None:
    """The native 4-bit copies of these projections, or None if any has none."""
    copies = [lin.int4 for lin in linears]
    return copies if all(isinstance(c, Q4Linear) for c in copies) else None  # type: ignore[return-value]


class NativeDecodePass:
    """The model's forward pass for a few sequences feeding a few tokens each, through its
    4-bit weights (approximate: for a draft model), into the given KV caches. ``max_rows``:
    the most tokens a call takes in all (the 4-bit copies' own limit)."""

    def __init__(
        self,
        *,
        embed: torch.Tensor,  # [vocab, hidden], the caches' dtype
        layers: Sequence[DecoderLayer],
        final_norm: torch.Tensor,  # [hidden]
        lm_head: Linear,
        cos: torch.Tensor,  # [max_positions, head_dim] fp32, rotate-half
        signed_sin: torch.Tensor,  # [max_positions, head_dim] fp32
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],  # per layer
        heads: int,
        eps: float,
        max_rows: int,
    ) -> None:
        kernel, attention = native_draft(), native_attention()
        projections = [q4_weights((y.qkv, y.o, y.gate_up, y.down)) for y in layers]
        head = q4_weights([lm_head])
        if kernel is None or attention is None or head is None or None in projections:
            raise RuntimeError("the native draft pass needs its kernels and 4-bit weights")
        num_blocks, block_size, kv_heads, head_dim = kv_caches[0][0].shape
        dtype = kv_caches[0][0].dtype
        if dtype not in DTYPES or embed.dtype != dtype or head_dim > MAX_HEAD_DIM or head_dim % 2:
            raise ValueError(f"native draft pass: {dtype} caches of head_dim {head_dim}")
        self.max_rows = max_rows
        self.out_features = lm_head.out_features
        self.vocab = embed.shape[0]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_positions = cos.shape[0]
        # Everything the kernel reads, held here for as long as the pass lives.
        f32 = [t.float().contiguous() for y in layers for t in (y.input_norm, y.post_norm)]
        self._keep: list[object] = [embed, cos, signed_sin, kv_caches, projections, head, f32]
        self._final_norm = final_norm.float().contiguous()
        self._layers = (_Layer * len(layers))()
        for i, q4 in enumerate(projections):
            assert q4 is not None
            self._layers[i] = _Layer(
                f32[2 * i].data_ptr(), f32[2 * i + 1].data_ptr(), *(w.desc_address for w in q4)
            )
        keys = (_ptr * len(kv_caches))(*(k.data_ptr() for k, _ in kv_caches))
        values = (_ptr * len(kv_caches))(*(v.data_ptr() for _, v in kv_caches))
        self._keep += [keys, values]
        self._desc = _Draft(
            len(layers),
            embed.shape[1],
            heads,
            kv_heads,
            head_dim,
            projections[0][2].out_features // 2,
            block_size,
            eps,
            head_dim**-0.5,
            int(dtype == torch.float32),
            embed.data_ptr(),
            self._final_norm.data_ptr(),
            cos.data_ptr(),
            signed_sin.data_ptr(),
            ctypes.addressof(self._layers),
            head[0].desc_address,
            ctypes.addressof(keys),
            ctypes.addressof(values),
            attention.address,
        )
        self._desc_address = ctypes.addressof(self._desc)
        self._call = kernel.decode

    def __call__(self, feeds: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> torch.Tensor:
        """``feeds``: per sequence, (tokens it feeds, the position of the first, its block
        table), the tokens at consecutive positions, their K/V written into the cache where
        the table puts them, each attending the keys up to its own position. Returns each
        sequence's logits after its last token, [sequences, lm_head out] fp32."""
        bs = self.block_size
        tokens, positions, slots, flat = [], [], [], []
        seq_rows, seq_queries, seq_starts, table_starts, logit_rows = [], [], [], [], []
        for fed, start, table in feeds:
            seq_rows.append(len(tokens))
            seq_queries.append(len(fed))
            seq_starts.append(start)
            table_starts.append(len(flat))
            end = start + len(fed)
            if not fed or start < 0 or len(table) * bs < end or end > self.max_positions:
                raise ValueError("native draft pass: a sequence its table or positions do not fit")
            tokens.extend(fed)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            flat.extend(table)
            logit_rows.append(len(tokens) - 1)
        rows = len(tokens)
        if (
            not 0 < rows <= self.max_rows
            or max(tokens) >= self.vocab
            or min(tokens) < 0
            or max(flat) >= self.num_blocks
            or min(flat) < 0
        ):
            raise ValueError("native draft pass: rows that do not fit its caches or vocabulary")
        n = len(feeds)
        fields = [tokens, positions, slots, seq_rows, seq_queries, seq_starts, table_starts]
        fields += [logit_rows, flat]
        ints = torch.tensor([v for f in fields for v in f], dtype=torch.int64)
        pointers, at = [], ints.data_ptr()
        for f in fields:  # each field's address in the one tensor
            pointers.append(at)
            at += 8 * len(f)
        tok, pos, slot, row, query, first, table_start, logit_row, table = pointers
        logits = torch.empty(n, self.out_features, dtype=torch.float32)
        status = self._call(
            self._desc_address,
            rows,
            tok,
            pos,
            slot,
            n,
            row,
            query,
            first,
            table_start,
            table,
            n,
            logit_row,
            logits.data_ptr(),
        )
        if status:
            raise MemoryError("native draft pass: scratch allocation failed")
        return logits


class NativeDraft:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.decode = lib.sb_draft_decode
        self.decode.restype = _int
        self.decode.argtypes = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr]
        self.decode.argtypes += [_ptr, _i64, _ptr, _ptr]


@functools.cache
def native_draft() -> NativeDraft | None:
    """The kernel, built on first use; None where it cannot be (reason logged once)."""
    lib = native.load("draft_cpu.c")
    return None if lib is None else NativeDraft(lib)
