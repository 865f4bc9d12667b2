"""An adapter's own embedding and output-layer weights, applied per row of a mixed step: PEFT's
modules_to_save copies of ``embed_tokens`` / ``lm_head`` and its trainable token rows.

A slot whose adapter has any holds them on the device in the model's dtype (``SlotModules``); a
step's rows of such slots take their embeddings and logits from them, every other row from the
base, as PEFT's ``ModulesToSaveWrapper`` and ``TrainableTokensWrapper`` do for a batch of one
adapter. A full copy is a [vocab, hidden] table: a step pays one extra gather (embedding) or one
extra output-layer product over its own rows (logits) per slot that has one. Token rows are a
few rows: a compare and a copy per token, and on a tied base a few columns of the logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adapters.lora import LoraAdapter
from switchboard_kernels.linear import fp32_product


@dataclass(slots=True)
class Tokens:
    """Trainable token rows on the device: ``rows[i]`` replaces the embedding of ``ids[i]``."""

    ids: torch.Tensor  # [n] int64, ascending
    rows: torch.Tensor  # [n, hidden], the model's dtype
    in_head: bool  # a tied base: the output layer's columns of ``ids`` use the rows too


@dataclass(slots=True)
class HeadPatch:
    """One slot's logits rows (indices into the step's logits) and what replaces them there."""

    rows: torch.Tensor  # [m] int64
    head: torch.Tensor | None  # [vocab, hidden]: a whole copy of lm_head
    tokens: Tokens | None  # columns ``tokens.ids`` from ``tokens.rows``


@dataclass(slots=True)
class SlotModules:
    """One slot's embedding and output weights, None where the base's serve."""

    embed: torch.Tensor | None  # [vocab, hidden] copy of embed_tokens
    head: torch.Tensor | None  # [vocab, hidden] copy of lm_head (``embed`` itself when tied)
    tokens: Tokens | None

    @classmethod
    def of(
        cls, adapter: LoraAdapter, dtype: torch.dtype, device: torch.device, *, tied_base: bool
    ) -> SlotModules:
        def on_device(array) -> torch.Tensor:
            return torch.tensor(array, dtype=dtype, device=device)

        saved = adapter.saved
        embed = on_device(saved["embed_tokens"]) if "embed_tokens" in saved else None
        head = None
        if "lm_head" in saved:
            same = embed is not None and saved["lm_head"] is saved["embed_tokens"]
            head = embed if same else on_device(saved["lm_head"])
        tokens = None
        if adapter.tokens is not None:
            ids = torch.tensor(adapter.tokens.ids, dtype=torch.int64, device=device)
            tokens = Tokens(ids, on_device(adapter.tokens.rows), in_head=tied_base and head is None)
        return cls(embed=embed, head=head, tokens=tokens)

    @property
    def num_bytes(self) -> int:
        held = [self.embed, self.head] + ([] if self.tokens is None else [self.tokens.rows])
        tables = {id(t): t for t in held if t is not None}
        return sum(t.numel() * t.element_size() for t in tables.values())


@dataclass(slots=True)
class SavedRows:
    """A step's slots with their own embedding or output weights, and each token's slot."""

    token_slots: torch.Tensor  # [T] int64 on the device, -1: no adapter
    slots: dict[int, SlotModules]

    def embed(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Semantics: for each token t of a slot s, ``hidden[t] = E_s[input_ids[t]]`` where the
        adapter saved embed_tokens (E_s its copy), else ``hidden[t] = R_s[i]`` where
        ``input_ids[t] == ids_s[i]`` for its trainable tokens; other rows untouched.
        hidden: [T, hidden]."""
        for slot, modules in self.slots.items():
            if modules.embed is None and modules.tokens is None:
                continue
            rows = (self.token_slots == slot).nonzero().squeeze(1)
            ids = input_ids.index_select(0, rows)
            if modules.embed is not None:
                hidden.index_copy_(0, rows, F.embedding(ids, modules.embed).to(hidden.dtype))
            else:
                tokens = modules.tokens
                assert tokens is not None
                match = ids[:, None] == tokens.ids[None, :]  # [m, n]: at most one per row
                hit, which = match.nonzero(as_tuple=True)
                hidden.index_copy_(0, rows[hit], tokens.rows[which].to(hidden.dtype))

    def heads(self, logit_rows: torch.Tensor) -> list[HeadPatch]:
        """For the rows ``logit_rows`` picks out of the step's tokens: each slot's rows (indices
        into those rows) whose logits its adapter changes, with what changes them."""
        slots = self.token_slots.index_select(0, logit_rows)
        patches = []
        for slot, modules in self.slots.items():
            tokens = (
                modules.tokens if modules.tokens is not None and modules.tokens.in_head else None
            )
            if modules.head is None and tokens is None:
                continue
            rows = (slots == slot).nonzero().squeeze(1)
            if rows.numel():
                patches.append(HeadPatch(rows, modules.head, tokens))
        return patches


def apply_heads(logits: torch.Tensor, x: torch.Tensor, patches: list[HeadPatch]) -> None:
    """Semantics: for the rows r of each patch, ``logits[r] = x[r] @ H.T`` with its copy H of
    lm_head, or ``logits[r, ids] = x[r] @ R.T`` with its token rows R (fp32 out).
    logits: [rows, vocab] fp32, x: [rows, hidden] (the final norm's output)."""
    for patch in patches:
        xs = x.index_select(0, patch.rows)
        if patch.head is not None:
            logits.index_copy_(0, patch.rows, fp32_product(xs, patch.head))
        elif patch.tokens is not None:
            columns = fp32_product(xs, patch.tokens.rows)  # [m, n]
            logits[patch.rows[:, None], patch.tokens.ids[None, :]] = columns
