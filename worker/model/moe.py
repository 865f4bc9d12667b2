"""Sparse mixture-of-experts MLPs (Mixtral, Qwen3-MoE): the router's top-k, experts grouped.

Shazeer et al. (ICLR 2017), Mixtral (Jiang et al., 2024): a token's MLP output is
``sum_j w_j * E_j(x)`` over the ``top_k`` experts its router ranks highest, ``w`` being their
softmax probabilities (renormalized to sum 1 where the architecture says so). A step's
(token, expert) pairs are sorted by expert (MegaBlocks' grouping, Gale et al., MLSys 2023,
without its block-sparse kernels): each expert multiplies all its rows at once, so its weights
are read once per step for the tokens routed to it, through the same projection kernels as a
dense layer (``switchboard_kernels.linear``: the native bf16 panels on CPU). Python loops over
the experts that received rows, never over tokens.

Checkpoints store the experts in one of three layouts, all loaded into per-expert projections:
transformers 5's fused ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], and
the per-expert tensors ``save_pretrained`` writes and the hub holds (Mixtral's
``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE's ``mlp.experts.{e}.gate/up/down_proj``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from switchboard_kernels.linear import Linear, bf16_panels_preferred
from switchboard_kernels.linear_choice import PANELS, LinearPlan
from switchboard_kernels.moe_native import GroupedExperts
from switchboard_kernels.quantized_weight import QuantizedWeight, cat_rows
from worker.errors import ModelLoadError
from worker.model.architectures import Experts
from worker.model.quantize_on_load import OnLoad, quantized

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from worker.model.expert_lora import ExpertLora


Weight = torch.Tensor | QuantizedWeight  # one expert's projection


@dataclass(slots=True)
class MoeWeights:
    """One sparse layer's router and experts."""

    router: torch.Tensor  # [num_experts, hidden]
    gate_up: list[Linear]  # per expert: hidden -> 2 * intermediate (gate, then up)
    down: list[Linear]  # per expert: intermediate -> hidden
    routing: Experts
    # bf16 on CPU, or batch-invariant: the router in the native panels (~5 us a decode row on
    # an AMX Xeon, where F.linear's bf16 path took ~35); else None, and F.linear multiplies
    router_panels: Linear | None = None
    # The native grouped kernel over the experts' panels, where it can serve them
    native: GroupedExperts | None = field(init=False)

    def __post_init__(self) -> None:
        self.native = GroupedExperts.of(self.gate_up, self.down)

    @property
    def expert_bytes(self) -> int:
        """Bytes one expert's projections read for one row."""
        return self.gate_up[0].decode_bytes + self.down[0].decode_bytes


def load_experts(
    w: dict[str, torch.Tensor],
    i: int,
    routing: Experts,
    *,
    quantization: str | None,
    plan: LinearPlan | None,
    on_load: OnLoad | None = None,
) -> MoeWeights:
    """Layer ``i``'s router and experts from whichever layout the checkpoint uses; ``on_load``:
    each expert's projections quantized as they load (the router stays as it is)."""
    p = f"model.layers.{i}."
    router, gate_up, down = _expert_tensors(w, p, routing.num_experts)
    if gate_up[0].shape[0] != 2 * routing.intermediate_size:
        raise ModelLoadError(
            f"{p}mlp experts have {gate_up[0].shape[0] // 2} intermediate features, the config "
            f"says {routing.intermediate_size}"
        )

    def linear(name: str, weight: torch.Tensor | QuantizedWeight) -> Linear:
        if isinstance(weight, QuantizedWeight):  # a published quantized checkpoint's expert
            return Linear(weight)
        weight = quantized(on_load, name, weight.contiguous())
        return Linear(weight, quantization=quantization, plan=plan)

    # bf16: the panels' sums in fp32, one rounding, as F.linear's. ``batch_invariant``
    # (fixed_order) in any dtype: a row's logits then never depend on the step's other rows.
    router_panels = None
    fixed_order = plan is not None and plan.fixed_order
    if bf16_panels_preferred(router) or fixed_order:
        router_panels = Linear(router, plan=LinearPlan(PANELS, PANELS, fixed_order=fixed_order))
    return MoeWeights(
        router=router,
        gate_up=[linear(f"{p}mlp.experts.{e}.gate_up", g) for e, g in enumerate(gate_up)],
        down=[linear(f"{p}mlp.experts.{e}.down", d) for e, d in enumerate(down)],
        routing=routing,
        router_panels=router_panels,
    )


def _expert_tensors(
    w: dict[str, torch.Tensor], p: str, num_experts: int
) -> tuple[torch.Tensor, Sequence[Weight], Sequence[Weight]]:
    """(router [E, H], gate_up [E, 2I, H], down [E, H, I]) of the layer with prefix ``p``; a
    quantized checkpoint's experts as lists of ``QuantizedWeight``s."""
    experts = range(num_experts)
    if p + "mlp.experts.gate_up_proj" in w:  # transformers 5, in memory
        return (
            w[p + "mlp.gate.weight"],
            w[p + "mlp.experts.gate_up_proj"],
            w[p + "mlp.experts.down_proj"],
        )
    if p + "block_sparse_moe.gate.weight" in w:  # Mixtral as published: w1 gate, w3 up, w2 down
        e = p + "block_sparse_moe.experts."
        names = ("w1", "w3", "w2")
        router = w[p + "block_sparse_moe.gate.weight"]
    else:  # Qwen3-MoE as published
        e = p + "mlp.experts."
        names = ("gate_proj", "up_proj", "down_proj")
        router = w.get(p + "mlp.gate.weight")
        if router is None:
            raise ModelLoadError(f"the checkpoint has no router for layer {p[:-1]} (mlp.gate)")
    if isinstance(w.get(f"{e}0.{names[2]}.weight"), QuantizedWeight):
        return router, *_quantized_experts(w, e, names, num_experts)
    try:
        gate_up = torch.stack(
            [
                torch.cat([w[f"{e}{x}.{names[0]}.weight"], w[f"{e}{x}.{names[1]}.weight"]])
                for x in experts
            ]
        )
        down = torch.stack([w[f"{e}{x}.{names[2]}.weight"] for x in experts])
    except KeyError as missing:
        raise ModelLoadError(f"the checkpoint has no expert tensor {missing.args[0]}") from None
    return router, gate_up, down


def _quantized_experts(
    w: dict, e: str, names: tuple[str, str, str], num_experts: int
) -> tuple[list[QuantizedWeight], list[QuantizedWeight]]:
    """Each expert's gate and up fused (``cat_rows``), and its down, as published quantized."""
    gate_up, down = [], []
    for x in range(num_experts):
        parts = [w.get(f"{e}{x}.{n}.weight") for n in names]
        if not all(isinstance(q, QuantizedWeight) for q in parts):
            raise ModelLoadError(f"expert {e}{x} is not quantized throughout: not served")
        try:
            gate_up.append(cat_rows(parts[:2]))
        except ValueError as error:
            raise ModelLoadError(f"expert {e}{x}: {error}") from None
        down.append(parts[2])
    return gate_up, down


@dataclass(slots=True)
class Routing:
    """A step's (token, expert) pairs sorted by expert."""

    token: torch.Tensor  # [pairs] int64: the token of each pair, pairs grouped by expert
    weight: torch.Tensor  # [pairs]: the pair's routing weight (fp32 or the model's dtype)
    counts: list[int]  # [num_experts]: pairs per expert, in order


def top_k(x: torch.Tensor, moe: MoeWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts), each [tokens, top_k]: the top-k of the router's softmax (in fp32,
    as transformers computes it), renormalized where the architecture says so, rounded to
    the model's dtype where it says so; ties break as ``torch.topk`` breaks them."""
    r = moe.routing
    if moe.router_panels is not None and x.dtype == moe.router.dtype:
        logits = moe.router_panels(x)  # [tokens, experts] in the model's dtype
    else:
        logits = F.linear(x, moe.router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # widened first, then softmax
    weight, expert = torch.topk(probs, r.top_k, dim=-1)
    if r.normalize:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    if r.weights_in_model_dtype:
        weight = weight.to(x.dtype)
    return weight, expert


def group(weight: torch.Tensor, expert: torch.Tensor, num_experts: int) -> Routing:
    """The pairs of ``top_k``'s result sorted by expert, tokens ascending within one."""
    k = expert.shape[1]
    flat = expert.flatten()  # pair p = token * top_k + j
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return Routing(token=order // k, weight=weight.flatten()[order], counts=counts)


def route(x: torch.Tensor, moe: MoeWeights) -> Routing:
    """The step's pairs grouped by expert (``top_k``, then ``group``)."""
    return group(*top_k(x, moe), moe.routing.num_experts)


def moe_mlp(
    x: torch.Tensor,  # [tokens, hidden]
    moe: MoeWeights,
    act: Callable[[torch.Tensor], torch.Tensor],
    lora: ExpertLora | None = None,
) -> torch.Tensor:  # [tokens, hidden]
    """``sum_j w_j * down_j(act(gate_j(x)) * up_j(x))`` over each token's routed experts, each
    expert's projections with the LoRA delta of each row's adapter where ``lora`` has one
    (``worker.model.expert_lora``). On CPU, with SiLU, the rows without an expert delta go
    through the native grouped kernel where it serves the step
    (``switchboard_kernels.moe_native``); the others through the per-expert path."""
    weight, expert = top_k(x, moe)
    native = moe.native if act is F.silu else None
    if native is None or not native.serves(x, expert):
        return _per_expert(x, moe, act, weight, expert, lora)
    adapted = None if lora is None else lora.rows_with_delta()
    if adapted is None:
        return native(x, expert, weight)
    # Rows are independent: the adapted ones through the torch path with their deltas, the
    # rest through the kernel (the experts' weights are read twice in such a step).
    rows = adapted.nonzero().flatten()
    rest = (~adapted).nonzero().flatten()
    out = torch.empty_like(x)
    out[rows] = _per_expert(x[rows], moe, act, weight[rows], expert[rows], lora.select(rows))
    if rest.numel():
        out[rest] = native(x[rest], expert[rest], weight[rest])
    return out


def _per_expert(
    x: torch.Tensor,  # [tokens, hidden]
    moe: MoeWeights,
    act: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,  # [tokens, top_k]
    expert: torch.Tensor,  # [tokens, top_k]
    lora: ExpertLora | None,
) -> torch.Tensor:  # [tokens, hidden]
    """``moe_mlp`` in torch: each expert with rows multiplies all of them at once through its
    projections (``switchboard_kernels.linear``)."""
    if x.shape[0] == 1 and lora is None:
        return _one_token(x, moe, act, weight[0], expert[0])
    routing = group(weight, expert, moe.routing.num_experts)
    step = None if lora is None else lora.for_pairs(routing.token)
    rows = x.index_select(0, routing.token)  # [pairs, hidden], grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for e, count in enumerate(routing.counts):
        if not count:
            continue
        seg = slice(start, start + count)
        start += count
        h = rows[seg]
        gate_up = moe.gate_up[e](h)
        if step is not None:
            step.add_gate_up(gate_up, h, e, seg)
        gate, up = gate_up.chunk(2, dim=-1)
        inner = act(gate) * up
        y = moe.down[e](inner)
        if step is not None:
            step.add_down(y, inner, e, seg)
        out[seg] = y
    # Mixtral scales by fp32 weights and rounds the product; Qwen3-MoE's weights are rounded
    # already. The pairs are added in expert order, as transformers adds them.
    scaled = (out * routing.weight[:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, routing.token, scaled)


def _one_token(
    x: torch.Tensor,
    moe: MoeWeights,
    act: Callable[[torch.Tensor], torch.Tensor],
    weight: torch.Tensor,  # [top_k]
    expert: torch.Tensor,  # [top_k]
) -> torch.Tensor:  # [1, hidden]
    """``_per_expert`` for a single row without the grouping's sort and scatter: its experts
    in ascending order, each product rounded as ``_per_expert`` rounds it."""
    out = torch.zeros_like(x)
    for e, w in sorted(zip(expert.tolist(), weight, strict=True)):
        gate, up = moe.gate_up[e](x).chunk(2, dim=-1)
        out += (moe.down[e](act(gate) * up) * w).to(x.dtype)
    return out
