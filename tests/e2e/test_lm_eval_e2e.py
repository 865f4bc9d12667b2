"""lm-evaluation-harness (the `lm_eval` package from PyPI, its own command line) evaluates the
real stack through its `local-completions` model: a loglikelihood task and a generate-until
task (tests/e2e/lm_eval_tasks: YAML over a JSON file, no hub downloads), for the base model
and for a tenant's adapter. Each loglikelihood lm_eval reports equals transformers + peft in
fp32 within 1e-4 a token, with its greedy flag; each generation equals transformers' greedy
one cut at the task's stop string. The same generate-until task also runs through
`local-chat-completions` (lm_eval's messages, the checkpoint's template in the gateway)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel

from factories import add_byte_level_tokenizer, load_hf_model, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack

pytestmark = pytest.mark.slow

TASKS = Path(__file__).parent / "lm_eval_tasks"
CHOICE, COMPLETE = "switchboard_tiny_choice", "switchboard_tiny_complete"
TOL = 1e-4
MAX_GEN_TOKS, UNTIL = 8, "\n"  # tiny_complete.yaml's generation_kwargs

try:
    import lm_eval  # noqa: F401

    MISSING = None
except ImportError as exc:  # the dev extras declare it
    MISSING = f"lm_eval cannot be imported ({exc}); pip install -e '.[dev]'"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("lm-eval-model"),
        vocab_size=512,
        max_position_embeddings=2048,  # lm_eval's default max_length
        eos_token_id=0,
        seed=29,
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("lm-eval-adapter") / "tuned"
    return make_peft_adapter(tiny_model, out, rank=4, targets=["q_proj", "v_proj", "down_proj"])


@pytest.fixture(scope="module")
def stack(tiny_model, adapter_dir, redis_url, tmp_path_factory):
    with Stack(
        model=tiny_model,
        num_workers=1,
        redis_url=redis_url,
        gateway_port=free_port(),
        dtype="float32",
        key_prefix=f"sblmeval:{os.getpid()}:",
        home=tmp_path_factory.mktemp("lm-eval-home"),
    ) as running:
        running.create_tenant_key("acme")
        body = {"name": "tuned", "path": str(adapter_dir)}
        running.admin("POST", "/tenants/acme/adapters", json=body)
        yield running


@pytest.fixture(scope="module")
def reference(tiny_model, adapter_dir):
    """transformers + peft in fp32: the model for base rows (adapter disabled) and adapter rows."""
    return PeftModel.from_pretrained(load_hf_model(tiny_model), adapter_dir).eval()


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def run_lm_eval(
    stack, tiny_model: Path, model: str, out: Path, *, chat: bool = False
) -> dict[str, list[dict]]:
    """`lm_eval run` as a user types it, offline; its logged samples by task. ``chat``:
    `local-chat-completions` with lm_eval's `--apply_chat_template` (generate-until only: lm_eval
    scores no loglikelihood through chat), else `local-completions` on token ids."""
    key = stack.create_tenant_key("acme")
    if chat:
        lm, route, tasks = "local-chat-completions", "chat/completions", [COMPLETE]
        arguments = []  # messages go as JSON; the gateway renders the template
    else:
        lm, route, tasks = "local-completions", "completions", [CHOICE, COMPLETE]
        arguments = [
            f"tokenizer={tiny_model}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
        ]
    arguments += ["max_retries=1", "timeout=120"]
    model_args = ",".join([f"model={model}", f"base_url={stack.base_url}/v1/{route}", *arguments])
    command = [sys.executable, "-m", "lm_eval", "run", "--model", lm]
    command += ["--model_args", model_args, "--tasks", ",".join(tasks)]
    command += ["--include_path", str(TASKS), "--output_path", str(out), "--log_samples"]
    if chat:
        command.append("--apply_chat_template")
    env = {
        **os.environ,
        "OPENAI_API_KEY": key,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(out / "hf-home"),
        "HF_DATASETS_CACHE": str(out / "datasets"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    # The task's data_files are relative to the task folder.
    done = subprocess.run(
        command, cwd=TASKS, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    samples = {}
    for task in tasks:
        files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
        assert files, f"no samples for {task} under {out}: {done.stderr[-2000:]}"
        samples[task] = [json.loads(line) for line in files[-1].read_text().splitlines()]
    return samples


def pair(sample: dict, index: int) -> tuple[str, str]:
    """The (context, continuation) of a sample's index-th request, as lm_eval logged it."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):  # {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        args = arguments[f"gen_args_{index}"]
        return args["arg_0"], args["arg_1"]
    return arguments[index][0], arguments[index][1]


def expected_loglikelihood(reference, hf_tokenizer, context, continuation, adapter):
    """Sum of the continuation's token logprobs given the context, and whether each is the
    argmax, by transformers + peft in fp32."""
    ctx = hf_tokenizer(context, add_special_tokens=False).input_ids
    whole = hf_tokenizer(context + continuation, add_special_tokens=False).input_ids
    assert whole[: len(ctx)] == ctx  # the data splits on a token boundary
    with torch.no_grad():
        if adapter:
            logits = reference(input_ids=torch.tensor([whole])).logits[0]
        else:
            with reference.disable_adapter():
                logits = reference(input_ids=torch.tensor([whole])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    positions = range(len(ctx), len(whole))
    total = sum(logprobs[p - 1, whole[p]].item() for p in positions)
    greedy = all(logprobs[p - 1].argmax().item() == whole[p] for p in positions)
    return total, greedy, len(whole) - len(ctx)


def chat_messages(context) -> list[dict]:
    """lm_eval's chat context as it logs it: its `JsonChatStr` (a one-field tuple holding the
    messages as JSON) comes back as a one-item list."""
    if isinstance(context, list) and len(context) == 1 and isinstance(context[0], str):
        context = context[0]
    return json.loads(context) if isinstance(context, str) else context


def expected_generation(reference, hf_tokenizer, context, adapter, *, chat=False):
    """transformers' greedy continuation, cut at the end-of-sequence token and the stop string;
    ``chat``: ``context`` is lm_eval's messages, rendered by the checkpoint's template."""
    if chat:
        messages = chat_messages(context)
        prompt = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = context
    ids = torch.tensor([hf_tokenizer(prompt, add_special_tokens=False).input_ids])
    with torch.no_grad():
        if adapter:
            out = reference.generate(input_ids=ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False)
        else:
            with reference.disable_adapter():
                out = reference.generate(
                    input_ids=ids, max_new_tokens=MAX_GEN_TOKS, do_sample=False
                )
    new = out[0, ids.shape[1] :].tolist()
    if hf_tokenizer.eos_token_id in new:
        new = new[: new.index(hf_tokenizer.eos_token_id)]
    return hf_tokenizer.decode(new, skip_special_tokens=True).split(UNTIL)[0]


def as_float(value) -> float:
    return float(value)


def as_bool(value) -> bool:
    return value in (True, "True", "true")


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
@pytest.mark.parametrize("which", ["base", "adapter"])
def test_lm_eval_local_completions_scores_and_generates_as_transformers(
    stack, tiny_model, reference, hf_tokenizer, tmp_path, which
):
    adapter = which == "adapter"
    samples = run_lm_eval(stack, tiny_model, "tuned" if adapter else tiny_model.name, tmp_path)
    docs = json.loads((TASKS / "tiny_docs.json").read_text())
    assert len(samples[CHOICE]) == len(samples[COMPLETE]) == len(docs)
    for sample in samples[CHOICE]:
        choices = sample["doc"]["choices"]
        for index, response in enumerate(sample["filtered_resps"]):
            context, continuation = pair(sample, index)
            assert continuation == " " + choices[index]
            want, want_greedy, n_tokens = expected_loglikelihood(
                reference, hf_tokenizer, context, continuation, adapter
            )
            got, got_greedy = as_float(response[0]), as_bool(response[1])
            assert abs(got - want) <= TOL * n_tokens, (context, continuation, got, want)
            assert got_greedy == want_greedy, (context, continuation)
    check_generations(samples[COMPLETE], reference, hf_tokenizer, adapter=adapter)


def check_generations(samples, reference, hf_tokenizer, *, adapter, chat=False):
    generated = []
    for sample in samples:
        context = pair(sample, 0)[0]
        want = expected_generation(reference, hf_tokenizer, context, adapter, chat=chat)
        assert sample["filtered_resps"][0] == want, (context, sample["filtered_resps"])
        generated.append(want)
    assert any(generated), generated  # the comparison is not between empty strings


@pytest.mark.skipif(MISSING is not None, reason=MISSING or "")
def test_lm_eval_local_chat_completions_generates_as_transformers(
    stack, tiny_model, reference, hf_tokenizer, tmp_path
):
    """lm_eval's `local-chat-completions` (`--apply_chat_template`: the task's text as a user
    message) on the tenant's adapter: each answer is transformers' greedy one on the
    checkpoint's own template, cut at the task's stop string (sent as `stop`)."""
    samples = run_lm_eval(stack, tiny_model, "tuned", tmp_path, chat=True)
    docs = json.loads((TASKS / "tiny_docs.json").read_text())
    assert len(samples[COMPLETE]) == len(docs)
    assert chat_messages(pair(samples[COMPLETE][0], 0)[0])[-1]["role"] == "user"
    check_generations(samples[COMPLETE], reference, hf_tokenizer, adapter=True, chat=True)
