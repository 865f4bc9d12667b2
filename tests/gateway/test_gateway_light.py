"""The gateway stays light (no torch, no triton), tokenizes like transformers, and refuses
weak admin tokens."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.settings import GatewaySettings
from gateway.tokenizer import ChatTokenizer
from runtime.home import default_model_dir

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_app_and_serving_requests_never_imports_torch(model_dir, tmp_path):
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        import httpx
        from gateway.app import create_app
        from gateway.settings import GatewaySettings

        async def main():
            settings = GatewaySettings(
                dev_mode=True, model={str(model_dir)!r}, adapter_store={str(tmp_path / "s")!r},
                redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2,
            )
            app = create_app(settings)
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    r = await c.post("/v1/chat/completions", json={{"model": "x"}})
                    assert r.status_code in (400, 401), r.text
                    r = await c.get("/v1/models", headers={{"Authorization": "Bearer sk-x"}})
                    assert r.status_code == 503, r.text  # Redis is unreachable: fail closed
                    state = app.state.gateway
                    ids = state.tokenizer.encode_chat([{{"role": "user", "content": "hi"}}])
                    assert ids
            heavy = [m for m in ("torch", "triton", "transformers") if m in sys.modules]
            print("HEAVY", heavy)

        asyncio.run(main())
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


def chat_dirs(model_dir: Path) -> list[Path]:
    dirs = [model_dir]
    if (default_model_dir() / "tokenizer.json").is_file():
        dirs.append(default_model_dir())
    return dirs


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a joke\nin two lines."},
    ],
]


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one-turn", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(model_dir, conversation, add_generation_prompt):
    from transformers import AutoTokenizer  # the reference (imports torch; fine in tests)

    for path in chat_dirs(model_dir):
        reference = AutoTokenizer.from_pretrained(str(path))
        ours = ChatTokenizer.from_dir(path)
        kwargs = {"add_generation_prompt": add_generation_prompt}
        expected_text = reference.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert ours.render_chat(conversation, **kwargs) == expected_text
        expected_ids = reference.apply_chat_template(conversation, tokenize=True, **kwargs)
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
            expected_ids = expected_ids["input_ids"]
        assert ours.encode_chat(conversation, **kwargs) == list(expected_ids)
        text = "Plain text, with punctuation!"
        assert ours.encode(text) == reference(text)["input_ids"]


@pytest.mark.parametrize("token", ["", "changeme", "admin", "short-token"])
def test_settings_refuse_weak_admin_tokens_outside_dev_mode(token, monkeypatch):
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", token)
    with pytest.raises(ValidationError, match="ADMIN_TOKEN"):
        GatewaySettings()
    assert GatewaySettings(dev_mode=True).admin_token.get_secret_value() == token


def test_settings_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SWITCHBOARD_ADMIN_TOKEN", "x" * 32)
    monkeypatch.setenv("SWITCHBOARD_MODEL", str(tmp_path / "My-Model"))
    monkeypatch.setenv("SWITCHBOARD_PORT", "9000")
    settings = GatewaySettings()
    assert settings.served_model_name == "My-Model"
    assert (settings.port, settings.host, settings.key_prefix) == (9000, "127.0.0.1", "sb:")
