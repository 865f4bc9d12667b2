"""The web console in a real headless Chromium against the real stack (`switchboard up`'s
processes: Redis, a worker on a tiny model, the gateway).

A tenant signs in, uploads an adapter, sees it listed, chats with it and sees the answer
stream, sees its usage grow; another tenant's console sees none of it; hostile input (a
script in a name, an upload over the limit, a cross-site form post) gets the API's answers
and is shown as text; a revoked key is signed out; the admin creates a tenant, sets a quota
and sees the worker holding a tenant's adapter.

Chromium is Debian's (`apt-get install chromium`, which .ci/run does) driven by Playwright from
PyPI; without either, these tests skip and say which is missing. With
SWITCHBOARD_CONSOLE_SCREENSHOTS=DIR they save the main pages as PNGs there (docs/img/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest

from archive_factories import adapter_members, tar_bytes
from factories import add_byte_level_tokenizer, make_checkpoint, make_peft_adapter
from runtime.embedded_redis import free_port
from runtime.stack import Stack

pytestmark = pytest.mark.slow

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install playwright)"
)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    pytest.skip(
        "no Chromium on this machine (apt-get install chromium; .ci/run installs it)",
        allow_module_level=True,
    )
expect = sync_api.expect
# A worker on a loaded 2-core machine can take seconds for a first answer.
expect.set_options(timeout=30_000)
MAX_UPLOAD = 1 << 20
SCREENSHOTS = os.environ.get("SWITCHBOARD_CONSOLE_SCREENSHOTS")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_checkpoint(
        tmp_path_factory.mktemp("console-model"),
        vocab_size=512,
        max_position_embeddings=2048,  # the playground's tools prompt is ~1 token a byte here
        eos_token_id=0,  # the tokenizer's <|endoftext|>, as the grammars' matchers know it
    )
    return add_byte_level_tokenizer(path)


@pytest.fixture(scope="module")
def stack(tiny_model, redis_url, tmp_path_factory):
    limits = {"SWITCHBOARD_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    with (
        mock.patch.dict(os.environ, limits),
        Stack(
            model=tiny_model,
            redis_url=redis_url,
            gateway_port=free_port(),
            dtype="float32",
            key_prefix=f"sbconsole:{os.getpid()}:",
            home=tmp_path_factory.mktemp("home"),
        ) as running,
    ):
        yield running


@pytest.fixture(scope="module")
def adapter_dir(tiny_model, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("adapter")
    return make_peft_adapter(tiny_model, folder / "sql", rank=4, targets=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def adapter_archive(adapter_dir) -> Path:
    archive = adapter_dir.parent / "sql.tar.gz"
    archive.write_bytes(tar_bytes(adapter_members(adapter_dir, folder="sql")))
    return archive


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        # --no-sandbox: the tests may run as root (CI), where Chromium's sandbox refuses.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def new_page(browser):
    """A page in a fresh browser context (its own cookies), dialogs accepted; every script
    error on it fails the test."""
    contexts, errors = [], []

    def make():
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(20_000)
        page.on("dialog", lambda dialog: dialog.accept())
        page.on("pageerror", lambda error: errors.append(str(error)))
        return page

    yield make
    for context in contexts:
        context.close()
    assert errors == []


def sign_in(page, stack: Stack, credential: str, *, side: str = "/console") -> None:
    page.goto(stack.base_url + side)
    expect(page).to_have_url(stack.base_url + side + "/login")
    page.fill("#credential", credential)
    page.click("button[type=submit]")
    expect(page.locator("#who")).to_be_visible()
    expect(page.locator("body[data-ready]")).to_have_count(1)  # the page's scripts bound


def screenshot(page, name: str, part=None) -> None:
    """With SWITCHBOARD_CONSOLE_SCREENSHOTS=DIR: the whole page (or the locator `part`) as
    DIR/console-NAME.png."""
    if SCREENSHOTS:
        path = Path(SCREENSHOTS).resolve() / f"console-{name}.png"
        if part is None:
            page.screenshot(path=path, full_page=True)
        else:
            part.screenshot(path=path)


def upload(page, name: str, archive: Path) -> None:
    page.fill("#upload-name", name)
    page.set_input_files("#upload-file", str(archive))
    page.click("#upload-button")


def test_a_tenant_uploads_chats_and_sees_its_usage_and_another_tenant_sees_none(
    stack, new_page, adapter_archive
):
    acme_key, bolt_key = stack.create_tenant_key("acme"), stack.create_tenant_key("bolt")
    stack.admin("PUT", "/tenants/acme/quotas", json={"requests_per_minute": 100})
    page = new_page()
    sign_in(page, stack, acme_key)
    expect(page.locator("#who")).to_have_text("acme")
    expect(page.locator("#adapter-empty")).to_be_visible()

    upload(page, "sql", adapter_archive)
    expect(page.locator("#upload-status")).to_have_text("Uploaded sql (rank 4).")
    row = page.locator("#adapter-table tbody tr")
    expect(row).to_have_count(1)
    expect(row.locator("td").nth(0)).to_have_text("sql")
    expect(row.locator("td").nth(2)).to_have_text("q_proj, v_proj")

    # Chat with the adapter; record every change of the answer's text as it streams.
    page.select_option("#chat-model", "sql")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-input", "the quick brown fox")
    page.evaluate(
        """() => {
        window.__seen = [];
        new MutationObserver(() => {
          const out = document.querySelector('.turn.assistant .text');
          if (out) window.__seen.push(out.textContent);
        }).observe(document.getElementById('transcript'),
                   {subtree: true, childList: true, characterData: true});
    }"""
    )
    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s")
    answer = page.locator(".turn.assistant .text").text_content()
    seen = [text for text in page.evaluate("window.__seen") if text]
    assert len(set(seen)) > 1 and seen[-1] == answer  # grew piece by piece
    expect(page.locator("#chat-stats")).to_contain_text("12 tokens · TTFT")
    expect(page.locator("#chat-stats")).to_contain_text("99 requests left this minute")
    # Its limits: the request it just made is in the minute's window; its key is listed.
    limit = page.locator("#limit-table tbody tr", has_text="Requests per minute")
    expect(limit.locator("td")).to_have_text(["Requests per minute", "100", "1", "99"])
    expect(page.locator("#key-table tbody tr")).to_have_count(1)
    expect(page.locator("#key-table tbody tr td").nth(2)).to_have_text("this session")
    # Usage: the page's table and chart show the adapter's tokens.
    usage_row = page.locator("#usage-table tbody tr", has_text="sql")
    expect(usage_row).to_have_count(1)
    expect(usage_row.locator("td").nth(2)).to_have_text("1")  # requests: settled, then shown
    total = usage_row.locator("td").nth(5).text_content()
    today = usage_row.locator("td").nth(0).text_content()
    expect(page.locator("#usage-chart rect title")).to_have_text([f"sql {today}: {total}"])
    # The same request through the OpenAI client: the same (greedy) answer.
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=acme_key, max_retries=0)
    same = client.chat.completions.create(
        model="sql",
        messages=[{"role": "user", "content": "the quick brown fox"}],
        temperature=0,
        max_tokens=12,
    )
    assert same.choices[0].message.content == answer

    screenshot(page, "tenant")

    # Another tenant's console: no adapter, no usage, and acme's name is unknown to it.
    other = new_page()
    sign_in(other, stack, bolt_key)
    expect(other.locator("#adapter-empty")).to_be_visible()
    expect(other.locator("#chat-model option")).to_have_count(1)  # the base model only
    expect(other.locator("#usage-table tbody tr")).to_have_count(0)
    expect(other.locator("#key-table tbody tr")).to_have_count(1)  # its own key only
    # acme's adapter by name through bolt's console: the API's 404, word for word a missing
    # one's, to read, replace or delete it.
    foreign = other.evaluate(
        """async () => {
        const answers = [];
        for (const [path, options] of [["adapters/sql", {}], ["adapters/nope", {}],
                                       ["adapters/sql", {method: "DELETE"}]]) {
          const response = await Console.call(path, options);
          answers.push([response.status, (await response.json()).error.message]);
        }
        return answers;
    }"""
    )
    assert foreign == [
        [404, "The adapter `sql` does not exist."],
        [404, "The adapter `nope` does not exist."],
        [404, "The adapter `sql` does not exist."],
    ]
    # Chatting with acme's adapter by name: the API's answer for a model that does not exist.
    other.evaluate(
        "document.getElementById('chat-model').add(new Option('sql', 'sql', true, true))"
    )
    other.fill("#chat-input", "hi")
    other.click("#chat-send")
    expect(other.locator("#chat-error")).to_have_text("The model `sql` does not exist.")


def record_texts(page, selector: str) -> None:
    """Keep every text the element at `selector` shows, in `window.__texts`."""
    page.evaluate(
        """selector => {
        const node = document.querySelector(selector);
        window.__texts = [];
        new MutationObserver(() => window.__texts.push(node.textContent))
          .observe(node, {subtree: true, childList: true, characterData: true});
    }""",
        selector,
    )


def test_a_tenant_replaces_an_adapters_content_and_sees_its_version(
    stack, new_page, adapter_archive, tiny_model, tmp_path
):
    key = stack.create_tenant_key("versioned")
    api = {"Authorization": f"Bearer {key}"}
    page = new_page()
    sign_in(page, stack, key)
    upload(page, "policy", adapter_archive)
    expect(page.locator("#upload-status")).to_have_text("Uploaded policy (rank 4).")
    row = page.locator("#adapter-table tbody tr", has_text="policy")
    first = httpx.get(f"{stack.base_url}/v1/adapters/policy", headers=api).json()
    expect(row.locator("td").nth(4).locator("code")).to_have_attribute("title", first["adapter_id"])
    expect(row.locator("td").nth(5)).to_contain_text("v1 · ")

    # Other content under the taken name, without asking to replace: the API's 409, its words.
    v2 = make_peft_adapter(tiny_model, tmp_path / "v2", rank=8, targets=["q_proj"], seed=7)
    archive = tmp_path / "v2.tar.gz"
    archive.write_bytes(tar_bytes(adapter_members(v2, folder="v2")))
    upload(page, "policy", archive)
    expect(page.locator("#upload-status")).to_have_text(
        "Upload refused (409): an adapter named 'policy' already exists with other content; "
        "upload with replace=true to make this its new version, delete it first, or pick "
        "another name"
    )

    # The row's Replace: the form set to replace that name; the upload's progress shown.
    row.locator("button", has_text="Replace").click()
    expect(page.locator("#upload-name")).to_have_value("policy")
    expect(page.locator("#upload-replace")).to_be_checked()
    record_texts(page, "#upload-status")
    page.set_input_files("#upload-file", str(archive))
    page.click("#upload-button")
    expect(page.locator("#upload-status")).to_have_text("Uploaded policy version 2 (rank 8).")
    assert any(t.startswith("Uploading… 100 % of ") for t in page.evaluate("window.__texts"))
    second = httpx.get(f"{stack.base_url}/v1/adapters/policy", headers=api).json()
    assert second["adapter_id"] != first["adapter_id"] and second["version"] == 2
    expect(row.locator("td").nth(4).locator("code")).to_have_attribute(
        "title", second["adapter_id"]
    )
    expect(row.locator("td").nth(5)).to_contain_text("v2 · ")
    expect(row.locator("td").nth(1)).to_have_text("8")
    expect(row.locator("td").nth(2)).to_have_text("q_proj")
    expect(page.locator("#upload-replace")).not_to_be_checked()  # the form is reset


def send(page, text: str, *, timeout_s: float = 30) -> str:
    """Send `text` in the playground; the answer's text once its stats are shown."""
    page.evaluate("document.getElementById('chat-stats').textContent = ''")
    page.fill("#chat-input", text)
    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("tokens/s", timeout=timeout_s * 1000)
    return page.locator(".turn.assistant .text").last.text_content()


def api_error(stack: Stack, key: str, body: dict) -> dict:
    """The API's own error for `body` (what the playground must show, word for word)."""
    reply = httpx.post(
        f"{stack.base_url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body},
        timeout=30,
    )
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_the_playground_constrains_the_output_and_calls_tools(stack, new_page):
    key = stack.create_tenant_key("shaper")
    page = new_page()
    sign_in(page, stack, key)
    base_model = page.locator("#chat-model option").first.get_attribute("value")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "40")

    # Each output constraint the API has: the answer follows it.
    page.select_option("#chat-format", "json_schema")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    page.fill("#chat-constraint", json.dumps(schema))
    assert isinstance(json.loads(send(page, "answer in JSON"))["ok"], bool)
    expect(page.locator("#chat-stats")).to_contain_text(" · stop")
    page.select_option("#chat-format", "json_object")
    expect(page.locator("#chat-constraint-label")).to_be_hidden()
    assert isinstance(json.loads(send(page, "any object")), dict)
    page.select_option("#chat-format", "regex")
    page.fill("#chat-constraint", "(yes|no)")
    assert send(page, "yes or no?") in {"yes", "no"}
    page.select_option("#chat-format", "choice")
    page.fill("#chat-constraint", "red\ngreen")
    assert send(page, "a colour") in {"red", "green"}
    page.select_option("#chat-format", "grammar")
    page.fill("#chat-constraint", 'start: "ab" | "cd"')
    assert send(page, "ab or cd") in {"ab", "cd"}
    expect(page.locator("#chat-stats")).to_contain_text("tokens · TTFT")

    # What the API refuses, in its words, and the field it names.
    page.select_option("#chat-format", "json_schema")
    page.fill("#chat-constraint", '{"type": "nonsense"}')
    page.fill("#chat-input", "hi")
    page.click("#chat-send")
    refused = api_error(
        stack,
        key,
        {
            "model": base_model,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": {"type": "nonsense"}},
            },
        },
    )
    expect(page.locator("#chat-error")).to_have_text(refused["message"])
    expect(page.locator("#chat-error-param")).to_have_text(f"(field: {refused['param']})")
    page.fill("#chat-constraint", "{not json")
    page.click("#chat-send")
    expect(page.locator("#chat-error")).to_contain_text("The schema is not JSON: ")
    page.select_option("#chat-format", "text")

    # Tools: a bad one refused as the API words it, then a forced call shown, answered, and
    # the chat going on with the tool's result.
    page.click("#chat-tools-box summary")
    bad = {**WEATHER, "function": {**WEATHER["function"], "name": "get weather"}}
    page.fill("#chat-tools", json.dumps([bad]))
    page.fill("#chat-input", "hi")
    page.click("#chat-send")
    refused = api_error(stack, key, {"model": base_model, "tools": [bad]})
    expect(page.locator("#chat-error")).to_have_text(refused["message"])
    expect(page.locator("#chat-error-param")).to_have_text("(field: tools.0.function.name)")

    page.fill("#chat-tools", json.dumps([WEATHER]))
    page.fill("#chat-max-tokens", "120")  # room for the call's block
    page.select_option("#chat-tool-choice", "function:get_weather")
    # The tools' system prompt is ~750 tokens of this byte-level tokenizer: seconds to prefill,
    # 20 s seen on a 2-core machine under load.
    send(page, "the weather in Paris?", timeout_s=120)
    call = page.locator(".turn.assistant .tool-call").last
    expect(call.locator("code")).to_have_text(
        re.compile(r'^get_weather\(\{"city": ?"(Paris|Oslo)"\}\)$')
    )
    expect(page.locator("#chat-stats")).to_contain_text(" · tool_calls")
    call_id = call.get_attribute("data-call")
    assert call_id.startswith("call_")
    expect(page.locator("#chat-role")).to_have_value(call_id)
    page.select_option("#chat-tool-choice", "none")  # the tools not shown: a short prompt
    page.fill("#chat-max-tokens", "8")
    send(page, "18 C", timeout_s=120)
    expect(page.locator(".turn.tool .text")).to_have_text(f"{call_id}: 18 C")
    expect(page.locator("#chat-role")).to_have_value("user")
    expect(page.locator("#chat-error")).to_have_text("")
    screenshot(page, "playground", page.locator("#playground"))


def test_hostile_input_gets_the_apis_answers_shown_as_text(stack, new_page, tmp_path):
    key = stack.create_tenant_key("mallory")
    page = new_page()
    sign_in(page, stack, key)
    hostile = "<img src=x onerror=window.__xss=1>"

    # A script in an adapter name: refused by the API, its words shown as they are.
    (tmp_path / "config.json").write_text("{}")
    page.fill("#upload-name", hostile)
    page.set_input_files("#upload-config", str(tmp_path / "config.json"))
    page.click("#upload-button")
    expect(page.locator("#upload-status")).to_contain_text("Upload refused (400)")
    # An upload over the gateway's limit: the API's 413.
    big = tmp_path / "big.tar.gz"
    big.write_bytes(os.urandom(MAX_UPLOAD + 1024))
    upload(page, "big", big)
    expect(page.locator("#upload-status")).to_contain_text("Upload refused (413)")

    # A model name with markup: the API's 404 names it, and the page shows it as text.
    page.evaluate(
        "name => document.getElementById('chat-model').add(new Option(name, name, true, true))",
        hostile,
    )
    page.fill("#chat-input", "hi")
    page.click("#chat-send")
    expect(page.locator("#chat-error")).to_have_text(f"The model `{hostile}` does not exist.")
    assert page.locator("img").count() == 0
    assert page.evaluate("window.__xss") is None

    # Another site's form posting to the console's API with the tenant's cookie in the jar.
    evil = "http://evil.test/"
    page.route(
        evil,
        lambda route: route.fulfill(
            content_type="text/html",
            body=f"""<form id=f method=post enctype=multipart/form-data
                      action="{stack.base_url}/console/api/adapters">
                      <input name=name value=forged></form>
                    <script>document.getElementById('f').submit()</script>""",
        ),
    )
    with page.expect_response(f"{stack.base_url}/console/api/adapters") as posted:
        page.goto(evil)
    assert posted.value.status in {401, 403}  # no cookie (SameSite) or no token: refused
    listed = httpx.get(
        f"{stack.base_url}/v1/adapters", headers={"Authorization": f"Bearer {key}"}
    ).json()
    assert listed["data"] == []


def test_a_revoked_key_is_signed_out(stack, new_page):
    key = stack.create_tenant_key("leaver")
    page = new_page()
    sign_in(page, stack, key)
    for key_id in stack.admin("GET", "/tenants/leaver/keys")["data"]:
        stack.admin("DELETE", f"/keys/{key_id['key_id']}")
    page.select_option("#usage-days", "30")  # the page's next call answers 401
    expect(page).to_have_url(stack.base_url + "/console/login?expired=1")
    expect(page.locator("#login-error")).to_have_text("Your session ended: sign in again.")
    page.goto(stack.base_url + "/console")
    expect(page).to_have_url(stack.base_url + "/console/login")


def test_a_tenant_uploads_a_directory_and_manages_its_keys_where_allowed(
    stack, new_page, adapter_dir
):
    key = stack.create_tenant_key("keyring")
    page = new_page()
    sign_in(page, stack, key)
    expect(page.locator("#admin-keys")).to_be_visible()  # the admin's, until it allows
    expect(page.locator("#new-key")).to_be_hidden()

    page.fill("#upload-name", "from-dir")
    page.set_input_files("#upload-dir", str(adapter_dir))
    page.click("#upload-button")
    expect(page.locator("#upload-status")).to_have_text("Uploaded from-dir (rank 4).")

    stack.admin("PUT", "/tenants/keyring/self-service", json={"keys": True})
    page.reload()
    expect(page.locator("body[data-ready]")).to_have_count(1)
    page.click("#new-key")
    expect(page.locator("#new-key-value")).to_contain_text("New key (shown once): sk-")
    rows = page.locator("#key-table tbody tr")
    expect(rows).to_have_count(2)
    rows.filter(has_not_text="this session").locator("button").click()
    expect(rows).to_have_count(1)
    rows.locator("button").click()  # its own key: signed out
    expect(page).to_have_url(stack.base_url + "/console/login?expired=1")


def settled_usage(stack: Stack, tenant: str, *, models: int) -> list[dict]:
    """The tenant's usage rows once the gateway has settled `models` models' requests (it
    settles just after each answer's last byte)."""
    deadline = time.monotonic() + 30  # as long as the page's waits (expect's timeout)
    while True:
        rows = stack.admin("GET", f"/usage?tenant={tenant}")["data"]
        if len(rows) == models or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if len(rows) == models:
        return rows
    raise AssertionError(f"{tenant}'s usage never showed {models} models: {rows}")


def test_the_admin_creates_a_tenant_sets_a_quota_and_sees_the_fleet(
    stack, new_page, adapter_archive
):
    # A tenant whose adapter a worker holds: uploaded (and preloaded) and used once.
    key = stack.create_tenant_key("dyn")
    uploaded = httpx.post(
        f"{stack.base_url}/v1/adapters",
        headers={"Authorization": f"Bearer {key}"},
        data={"name": "tuned"},
        files={"file": ("tuned.tar.gz", adapter_archive.read_bytes())},
        timeout=30,
    )
    assert uploaded.status_code == 201, uploaded.text
    client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key=key, max_retries=0)
    client.completions.create(model="tuned", prompt="hello", max_tokens=4)
    base_model = client.models.list().data[0].id
    client.completions.create(model=base_model, prompt="hello there", max_tokens=3)
    usage = settled_usage(stack, "dyn", models=2)

    page = new_page()
    sign_in(page, stack, stack.admin_token, side="/console/admin")
    page.fill("#new-tenant-name", "cobalt")
    page.click("#new-tenant button[type=submit]")
    row = page.locator("#tenant-table tbody tr", has_text="cobalt")
    expect(row).to_have_count(1)
    row.locator("button").click()
    expect(page.locator("#detail-name")).to_have_text("cobalt")
    page.fill("#q-requests_per_minute", "60")
    page.fill("#q-daily_tokens", "100000")
    page.click("#quota-save")
    expect(row.locator("td").nth(2)).to_have_text("60 (0 in use)")
    assert stack.admin("GET", "/tenants/cobalt/quotas")["requests_per_minute"] == 60
    page.check("#self-service-keys")
    page.click("#new-key")
    expect(page.locator("#new-key-value")).to_contain_text("sk-")
    assert stack.admin("GET", "/tenants/cobalt/self-service")["keys"] is True
    expect(page.locator("#key-table tbody tr")).to_have_count(1)
    assert "sk-" not in page.locator("#key-table").text_content()

    # The fleet: the worker, with dyn's adapter in a device slot and in its host cache (the
    # registry's next heartbeat; the page reads the fleet every 5 s).
    worker = page.locator("#worker-table tbody tr", has_text="worker-0")
    expect(worker.locator("td").nth(1)).to_have_text(stack.model.name)  # its base
    expect(worker.locator("td").nth(6)).to_contain_text("dyn/tuned")
    expect(worker.locator("td").nth(6)).to_contain_text(re.compile(r"^\d+ of \d+ slots"))
    expect(worker.locator("td").nth(7)).to_contain_text("dyn/tuned")
    # Its pool: one per base, with the worker in it.
    pool = page.locator("#pool-table tbody tr", has_text=stack.model.name)
    expect(pool.locator("td").nth(2)).to_have_text("worker-0")
    # The engine's service per tenant: dyn's request was computed there.
    service = page.locator("#service-table tbody tr", has_text="dyn")
    expect(service).to_have_count(1)
    assert int(service.locator("td").nth(3).text_content()) > 0  # prefill tokens

    # Every tenant's usage per day and model, as the admin API counts it: one tenant's rows,
    # then its bars per model.
    page.select_option("#usage-tenant", "dyn")
    rows = page.locator("#usage-table tbody tr")
    expect(rows).to_have_count(2)
    expected = [
        [r["date"], "dyn", r["model"], str(r["requests"]), str(r["prompt_tokens"]),
         str(r["completion_tokens"]), str(r["total_tokens"])]
        for r in sorted(usage, key=lambda r: r["model"])
    ]  # fmt: skip
    for row, cells in zip(rows.all(), expected, strict=True):
        expect(row.locator("td")).to_have_text(cells)
    page.select_option("#usage-by", "model")
    bars = page.locator("#usage-chart rect title")
    expect(bars).to_have_text(
        [
            f"{r['model']} {r['date']}: {r['total_tokens']}"
            for r in sorted(usage, key=lambda r: r["model"])
        ]
    )
    page.select_option("#usage-tenant", "")
    page.select_option("#usage-by", "tenant")
    expect(page.locator("#usage-chart rect title", has_text="dyn ")).to_have_text(
        [f"dyn {usage[0]['date']}: {sum(r['total_tokens'] for r in usage)}"]
    )
    screenshot(page, "admin")
