"""A base of another family served end to end (`switchboard up`'s processes): a tiny Phi-3,
whose projections are stored fused, through the openai client; a tenant's adapter on the fused
targets uploaded over HTTP and served; one naming a module Phi-3 lacks refused by name."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
from family_factories import make_family_checkpoint

from archive_factories import adapter_members, tar_bytes
from factories import add_byte_level_tokenizer, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack
from worker import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = make_family_checkpoint(tmp_path_factory.mktemp("phi3"), "phi3", vocab_size=512, seed=4)
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def stack(phi3, redis_url, tmp_path_factory):
    with Stack(
        model=phi3,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=f"sbfam:{os.getpid()}:",
        home=tmp_path_factory.mktemp("home"),
    ) as running:
        yield running


def upload(stack, api_key: str, name: str, adapter_dir) -> httpx.Response:
    archive = tar_bytes(adapter_members(adapter_dir, folder=name))
    return httpx.post(
        f"{stack.base_url}/v1/adapters",
        headers={"Authorization": f"Bearer {api_key}"},
        data={"name": name},
        files={"file": (f"{name}.tar.gz", archive)},
        timeout=30,
    )


def test_phi3_and_its_fused_adapter_serve_through_the_openai_api(stack, phi3, tmp_path):
    api_key = stack.create_tenant_key("acme")
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=api_key, max_retries=0)
    adapter = make_peft_adapter(phi3, tmp_path / "fused", rank=4, targets=["qkv_proj"], seed=2)
    offline = LLM(phi3, dtype="float32")
    offline.load_adapter("fused", adapter)
    params = SamplingParams(temperature=0, max_tokens=10)
    base, tuned = offline.generate(["the quick brown fox"] * 2, params, adapters=[None, "fused"])
    assert base.token_ids != tuned.token_ids

    out = client.completions.create(
        model=phi3.name, prompt="the quick brown fox", max_tokens=10, temperature=0
    )
    assert out.choices[0].text == base.text
    assert upload(stack, api_key, "fused", adapter).status_code == 201
    out = client.completions.create(
        model="fused", prompt="the quick brown fox", max_tokens=10, temperature=0
    )
    assert out.choices[0].text == tuned.text


def test_an_adapter_for_a_module_phi3_lacks_is_refused_at_upload(stack, tmp_path):
    """A LoRA on q_proj (a Llama's name): Phi-3 has only the fused qkv_proj."""
    from safetensors.torch import load_file, save_file

    api_key = stack.create_tenant_key("bolt")
    llama_names = tmp_path / "q"
    fused = make_peft_adapter(stack.model, tmp_path / "fused", rank=4, targets=["qkv_proj"], seed=3)
    llama_names.mkdir()
    tensors = load_file(fused / "adapter_model.safetensors")
    save_file(
        {k.replace("qkv_proj", "q_proj"): v for k, v in tensors.items()},
        llama_names / "adapter_model.safetensors",
    )
    config = (fused / "adapter_config.json").read_text().replace("qkv_proj", "q_proj")
    (llama_names / "adapter_config.json").write_text(config)
    refused = upload(stack, api_key, "q", llama_names)
    assert refused.status_code == 400, refused.text
    assert "'q_proj'" in refused.json()["error"]["message"]
