"""The sparse MoE MLP (``worker.model.moe``) against a per-token float64 loop, over routings that
broke others (every token to one expert, experts with no tokens, one token); the registry's
reading of Mixtral and Qwen3-MoE configs; the three checkpoint layouts of the experts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from moe_factories import make_moe_checkpoint, write_fused_experts

from adapters.base_model import BaseModelSpec
from switchboard_kernels.linear import Linear
from switchboard_kernels.linear_choice import PANELS, LinearPlan
from switchboard_kernels.moe_native import grouped_kernel
from worker.model.architectures import Experts, QKNorm
from worker.model.llama import LlamaModel
from worker.model.model_config import ModelConfig
from worker.model.moe import MoeWeights, moe_mlp, route, top_k
from worker.model.sharding import check_divisible

HIDDEN, INTER, E = 32, 24, 6
# The experts in the native panels: moe_mlp takes the grouped kernel (else each expert's
# projections, through the plan this CPU would use).
NATIVE = LinearPlan(PANELS, PANELS)
PLANS = [
    None,
    pytest.param(NATIVE, marks=pytest.mark.skipif(grouped_kernel(torch.float32) is None,
                                                  reason="no native grouped-experts kernel")),
]  # fmt: skip


def make_moe(*, top_k=2, normalize=True, in_model_dtype=False, seed=0, router_bias=None, plan=None):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, HIDDEN, generator=g)
    if router_bias is not None:  # a router that sends every token to these experts
        router = router * 0.01
        router[router_bias] += 1.0
    gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(E, HIDDEN, INTER, generator=g) / INTER**0.5
    routing = Experts(E, top_k, INTER, normalize, in_model_dtype, (True,))
    moe = MoeWeights(
        router,
        [Linear(w, plan=plan) for w in gate_up],
        [Linear(w, plan=plan) for w in down],
        routing,
    )
    if plan is NATIVE:  # the step goes through the native grouped kernel
        assert moe.native is not None
    return moe, router, gate_up, down


def reference(x, router, gate_up, down, *, top_k, normalize):
    """Each token alone, in float64: softmax, top-k, renormalize, weighted experts."""
    x, router, gate_up, down = (t.double() for t in (x, router, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router @ x[t], dim=-1)
        weight, experts = torch.topk(probs, top_k)
        if normalize:
            weight = weight / weight.sum()
        for w, e in zip(weight, experts, strict=True):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    ("tokens", "top_k", "normalize", "skew"),
    [
        (17, 2, True, None),  # Mixtral-style
        (17, 3, False, None),  # Qwen3-MoE without norm_topk_prob
        (1, 2, True, None),  # one decode row
        (9, 1, True, [4]),  # every token to expert 4: the others get none
        (9, 2, True, [0, 5]),  # every token to the same two
    ],
)
@pytest.mark.parametrize("plan", PLANS)
def test_grouped_experts_match_a_per_token_loop(tokens, top_k, normalize, skew, plan):
    moe, router, gate_up, down = make_moe(
        top_k=top_k, normalize=normalize, router_bias=skew, plan=plan
    )
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    if skew is not None:  # positive features: the boosted router rows win every token
        x = x.abs() + 0.1
    got = moe_mlp(x, moe, F.silu)
    want = reference(x, router, gate_up, down, top_k=top_k, normalize=normalize)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    counts = route(x, moe).counts
    assert sum(counts) == tokens * top_k
    if skew is not None:
        assert sorted(e for e, c in enumerate(counts) if c) == skew


def test_qwen3_moe_rounds_the_routing_weights_to_the_model_dtype():
    moe, *_ = make_moe(in_model_dtype=True)
    x = torch.randn(5, HIDDEN).bfloat16()
    moe.router = moe.router.bfloat16()
    assert route(x, moe).weight.dtype == torch.bfloat16
    moe.routing = Experts(E, 2, INTER, True, False, (True,))
    assert route(x, moe).weight.dtype == torch.float32


def test_the_registry_reads_the_expert_fields(tmp_path):
    base = make_moe_checkpoint(tmp_path / "q", "qwen3_moe", decoder_sparse_step=1)
    config = ModelConfig.from_pretrained(base)
    experts = config.block.experts
    assert experts is not None and config.block.qk_norm is QKNorm.PER_HEAD
    assert (experts.num_experts, experts.top_k, experts.intermediate_size) == (8, 2, 32)
    assert experts.normalize and experts.weights_in_model_dtype
    assert experts.sparse_layers == (True, False, True)  # mlp_only_layers=[1]
    spec = BaseModelSpec.from_config_dict(json.loads((base / "config.json").read_text()))
    assert spec.sparse_layers == experts.sparse_layers and spec.num_experts == 8
    assert spec.has_module(1, "down_proj") and not spec.has_module(0, "down_proj")
    mixtral = make_moe_checkpoint(tmp_path / "m", "mixtral")
    block = ModelConfig.from_pretrained(mixtral).block
    assert block.experts is not None and block.experts.normalize and not block.is_llama
    assert not block.experts.weights_in_model_dtype and block.qk_norm is QKNorm.NONE
    spec = BaseModelSpec.from_config_dict(json.loads((mixtral / "config.json").read_text()))
    assert "gate_proj" not in spec.projections and "q_proj" in spec.projections
    check_divisible(ModelConfig.from_pretrained(mixtral), 2)  # its experts split (issue 45)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_the_fused_and_per_expert_layouts_load_alike(tmp_path, family):
    base = make_moe_checkpoint(tmp_path / "base", family)
    fused = write_fused_experts(base, tmp_path / "fused", family)
    ids = torch.tensor([3, 14, 15, 92, 65, 35])
    outs = []
    for path in (base, fused):
        model = LlamaModel.from_pretrained(path, dtype=torch.float32)
        x = model.embed[ids]
        layer = next(y for y in model.layers if y.moe is not None)
        outs.append(moe_mlp(x, layer.moe, F.silu))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("plan", PLANS)
def test_expert_lora_adds_each_rows_own_delta(plan):
    """Rows of two adapters and base rows through the grouped experts, against the per-token
    loop over each row's adapted expert weights W_e + B_e A_e (PEFT's merged form); skewed so
    one expert holds every row."""
    from adapters.lora import LoraWeights
    from worker.model.expert_lora import ExpertLora, ExpertSlots

    moe, router, gate_up, down = make_moe(router_bias=[2, 3], plan=plan)
    slots = ExpertSlots.allocate(
        experts=E, slots=3, max_rank=4, hidden=HIDDEN, intermediate=INTER,
        dtype=torch.float32, device=torch.device("cpu"),
    )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    deltas = {}
    for slot, rank in ((0, 2), (2, 4)):
        ws = []
        for in_f, out_f in ((HIDDEN, 2 * INTER), (INTER, HIDDEN)):
            a = torch.randn(E * rank, in_f, generator=g) * 0.3
            b = torch.randn(out_f, rank * E, generator=g) * 0.3
            ws.append(LoraWeights(a.numpy(), b.numpy(), scaling=0.5, alpha=rank * 0.5, experts=E))
        slots.fill(slot, *ws)
        # PEFT's ParamWrapper.get_delta_weight: B [out, r, E], A [E, r, in] -> [E, out, in]
        deltas[slot] = [
            0.5
            * torch.einsum(
                "ore,eri->eoi",
                torch.from_numpy(w.b).reshape(-1, rank, E),
                torch.from_numpy(w.a).reshape(E, rank, -1),
            )
            for w in ws
        ]
    token_slots = torch.tensor([0, -1, 2, 2, 0, -1, 1])  # slot 1 is empty: adds nothing
    x = torch.rand(7, HIDDEN, generator=g) + 0.1
    got = moe_mlp(x, moe, F.silu, ExpertLora(slots, token_slots))
    for t, slot in enumerate(token_slots.tolist()):
        gu, dn = gate_up, down
        if slot in deltas:
            gu, dn = gate_up + deltas[slot][0], down + deltas[slot][1]
        want = reference(x[t : t + 1], router, gu, dn, top_k=2, normalize=True)
        torch.testing.assert_close(got[t : t + 1].double(), want, rtol=1e-5, atol=1e-5)
    # A step without expert deltas (no adapter, or one without expert LoRA): the whole step
    # takes the grouped path as a step without LoRA does.
    plain = ExpertLora(slots, torch.tensor([-1, 1, 1, -1, -1, 1, -1]))
    assert plain.rows_with_delta() is None
    want = reference(x, router, gate_up, down, top_k=2, normalize=True)
    torch.testing.assert_close(moe_mlp(x, moe, F.silu, plain).double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    grouped_kernel(torch.bfloat16) is None, reason="no native bf16 panels on this CPU"
)
def test_a_bf16_router_in_the_panels_routes_as_f_linear(tmp_path):
    """bf16 on CPU: the router multiplies through the native panels (F.linear's bf16 path costs
    ~7x as much a decode row); its logits are F.linear's up to the fp32 summation order, so
    the experts and weights picked are the same here."""
    base = make_moe_checkpoint(tmp_path / "m", "mixtral")
    model = LlamaModel.from_pretrained(base, dtype=torch.bfloat16)
    layer = next(y.moe for y in model.layers if y.moe is not None)
    assert layer.router_panels is not None
    x = model.embed[torch.arange(40)]
    got = layer.router_panels(x)
    want = F.linear(x, layer.router)
    torch.testing.assert_close(got, want, rtol=2**-8, atol=1e-6)
    weight, expert = top_k(x, layer)
    layer.router_panels = None
    weight_f, expert_f = top_k(x, layer)
    assert torch.equal(expert, expert_f) and torch.equal(weight, weight_f)
