"""Each family served end to end by ``switchboard up``'s processes (what ``make run
MODEL=DIR`` starts), from the tiny checkpoint ``switchboard model tiny`` writes (no real one can
be downloaded here): a completion through the openai client gives the offline engine's text, and
a chat completion renders the checkpoint's template and answers. Each family's math is held against
transformers offline (tests/worker/test_engine_families.py, test_engine_moe.py); here four that
differ most in what the worker reads (windows and soft-caps, q/k norms, LongRoPE, experts) keep the
suite short, and ``SB_E2E_ALL_FAMILIES=1`` runs every family, dense and mixture-of-experts."""

from __future__ import annotations

import os

import openai
import pytest
from family_factories import FAMILIES
from moe_factories import MOE_FAMILIES

from runtime.embedded_redis import free_port
from runtime.stack import Stack
from switchboard.cli import main as switchboard
from worker import LLM, SamplingParams

pytestmark = pytest.mark.slow
IGNORE_EOS = {"ignore_eos": True}
SERVED = (
    sorted(FAMILIES) + sorted(MOE_FAMILIES)
    if os.environ.get("SB_E2E_ALL_FAMILIES")
    else ["gemma2", "phi3-longrope", "qwen3", "qwen3_moe"]
)


@pytest.mark.parametrize("family", SERVED)
def test_switchboard_up_serves_the_family(family, redis_url, tmp_path):
    model = tmp_path / family
    assert switchboard(["model", "tiny", family, str(model)]) == 0
    prompt = "the quick brown fox"
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(model, dtype="float32").generate([prompt], params)[0]
    with Stack(
        model=model,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=f"sbup:{os.getpid()}:{family}:",
        home=tmp_path / "home",
    ) as stack:
        key = stack.create_tenant_key("demo")
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
        out = client.completions.create(
            model=family,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == expected.text
        chat = client.chat.completions.create(
            model=family,
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=4,
            temperature=0,
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.prompt_tokens > 2
