"""vLLM's `chat_template_kwargs` on /v1/chat/completions: Qwen3's `enable_thinking` (and the
`thinking` switch of Granite 3.2+ / DeepSeek V3.1) reach the chat template exactly as
transformers' `apply_chat_template(..., enable_thinking=...)` passes them; any other key, or a
value that is not a JSON boolean, is a 400 naming `chat_template_kwargs`.

The checkpoint is a tiny random Qwen3 (`family_factories`) with a byte-level tokenizer, Qwen3's
special tokens and a template of Qwen3's shape written here (ChatML turns; `enable_thinking`
false closes an empty `<think>` block after the generation prompt, Qwen3's own test of the
variable): Qwen3's published template is not on these machines (no hub access)."""

from __future__ import annotations

import httpx
import openai
import pytest
from family_factories import make_family_checkpoint

from factories import add_byte_level_tokenizer
from gateway.tokenizer import ChatTokenizer
from gateway_support import MODEL_NAME, gateway_settings, gateway_with_worker

QWEN3_STYLE_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- if thinking is defined and thinking %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)
EMPTY_THINK = "<think>\n\n</think>\n\n"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "the quick brown fox?"},
]
SWITCHES = [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"thinking": True}]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_family_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=512)
    add_byte_level_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<|im_start|>", "<|im_end|>", "<think>", "</think>"], special_tokens=True)
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(qwen3_dir):
    from transformers import AutoTokenizer  # the reference (imports torch; fine in tests)

    return AutoTokenizer.from_pretrained(qwen3_dir)


def reference_ids(reference, switches: dict) -> list[int]:
    ids = reference.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=True, **switches
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize(
    "switches", SWITCHES, ids=["none", "thinking-off", "thinking-on", "granite"]
)
def test_switches_render_as_transformers_passes_them(qwen3_dir, reference, switches):
    ours = ChatTokenizer.from_dir(qwen3_dir)
    try:
        text = ours.render_chat(CONVERSATION, switches=switches)
    finally:
        ours.close()
    assert text == reference.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True, **switches
    )
    assert text.endswith(EMPTY_THINK) == (switches == {"enable_thinking": False})


@pytest.fixture
async def live(qwen3_dir, redis_url, redis_prefix, tmp_path):
    settings = gateway_settings(
        redis_url=redis_url, prefix=redis_prefix, model_dir=qwen3_dir, store=tmp_path / "store"
    )
    async with gateway_with_worker(settings) as running:
        yield running


async def test_enable_thinking_reaches_the_template_through_the_openai_client(live, reference):
    client = openai.AsyncOpenAI(
        base_url=f"{live.gw.url}/v1", api_key=live.keys["acme"], max_retries=0
    )
    async with client:
        for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, None):
            await client.chat.completions.create(
                model=MODEL_NAME,
                messages=CONVERSATION,
                max_tokens=2,
                extra_body={"chat_template_kwargs": kwargs},
            )
            sent = list(live.worker.requests[-1].prompt_token_ids)
            assert sent == reference_ids(reference, kwargs or {}), kwargs
    thinking_off, thinking_on = (list(r.prompt_token_ids) for r in live.worker.requests[:2])
    assert thinking_off != thinking_on  # the switch bites


REFUSED = [
    ({"messages": [{"role": "system", "content": "injected"}]}, "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "chat_template_kwargs"),
    ({"eos_token": "</s>"}, "chat_template_kwargs"),
    ({"tools": [{"type": "function"}]}, "chat_template_kwargs"),
    ({"enable_thinking": False, "custom": "{{ 7 * 7 }}"}, "chat_template_kwargs"),
    ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": 0}, "chat_template_kwargs.enable_thinking"),
    ({"thinking": {"effort": "high"}}, "chat_template_kwargs.thinking"),
    ("enable_thinking", "chat_template_kwargs"),
    ([{"enable_thinking": False}], "chat_template_kwargs"),
]


async def test_other_keys_values_and_templates_are_refused_by_name(live):
    cases = [({"chat_template_kwargs": kwargs}, param) for kwargs, param in REFUSED]
    cases.append(({"chat_template": "{{ messages }}"}, "chat_template"))  # vLLM's own template
    headers = {"Authorization": f"Bearer {live.keys['acme']}"}
    async with httpx.AsyncClient(base_url=live.gw.url, headers=headers, timeout=10) as http:
        for extra, param in cases:
            body = {"model": MODEL_NAME, "messages": CONVERSATION, **extra}
            response = await http.post("/v1/chat/completions", json=body)
            assert response.status_code == 400, (extra, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error", (extra, error)
            assert error["param"] == param, (extra, error)
    assert not live.worker.requests  # refused before any work
