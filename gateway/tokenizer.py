"""The gateway's tokenizer and chat template, without transformers.

Why not `transformers.AutoTokenizer`: importing it pulls in torch (checked with transformers
5.24 on the default model: `'torch' in sys.modules` is True after `from_pretrained`), and the
gateway must stay light. So we load `tokenizer.json` with the `tokenizers` library (the same
Rust tokenizer transformers wraps) and render the chat template with a sandboxed jinja2
environment configured the way transformers configures it (`trim_blocks`, `lstrip_blocks`,
`loopcontrols`, `raise_exception`, `tojson`, the special tokens as variables). A test checks
the rendering against transformers' `apply_chat_template`.

Long texts are tokenized, and large conversations rendered, on a small thread pool of the
tokenizer's own, never on the event loop, shared by tenants in fair order
(`gateway.fair_slots`: a freed thread goes to the tenant that has held the threads least, and
a tenant waits with at most `QUEUE_PER_TENANT` jobs); `min_tokens` bounds a text's token count
from its byte length alone, so a prompt that cannot fit is refused without tokenizing it.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import jinja2
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, pre_tokenizers

from gateway.errors import InvalidRequestError
from gateway.fair_slots import FairSlots

T = TypeVar("T")

SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Texts up to this many characters are tokenized inline: the hand-off to a thread costs more.
INLINE_CHARS = 8192
INLINE_MESSAGES = 64
# A tenant's jobs waiting for the pool at most (the default concurrency quota); past it, 429.
QUEUE_PER_TENANT = 64
# Pre-tokenizers and normalizers that never drop or shrink text (see `_longest_token_bytes`).
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split"})


class TokenizerFilesError(RuntimeError):
    """The checkpoint directory lacks a usable tokenizer.json (the gateway cannot start)."""


@dataclass(frozen=True)
class ChatTokenizer:
    """Encode prompts, render chat templates, name tokens (for logprobs)."""

    tokenizer: Tokenizer
    chat_template: jinja2.Template | None
    special_tokens: Mapping[str, str]
    # Bytes of text one token can cover at most; None where the tokenizer can shrink text
    # (a normalizer, an unknown-token fallback) and no byte bound holds.
    longest_token_bytes: int | None = None
    threads: int = 2
    # The template reads `tools` (transformers' apply_chat_template(tools=...)): tools are
    # rendered its own way, else by gateway.structured.tool_rendering's fallback.
    renders_tools: bool = False
    pool: ThreadPoolExecutor = field(init=False, repr=False, compare=False)
    turns: FairSlots = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="tokenize")
        object.__setattr__(self, "pool", pool)
        # Jobs are bounded (a body's size, the context), so a tenant alone may use every
        # thread; beside others it waits its fair turn, at most one job long.
        turns = FairSlots(
            slots=self.threads,
            per_tenant=self.threads,
            queue_limit=QUEUE_PER_TENANT,
            name="tokenizing",
        )
        object.__setattr__(self, "turns", turns)

    @classmethod
    def from_dir(cls, path: str | Path, *, threads: int = 2) -> ChatTokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerFilesError(f"{file} is missing: the gateway needs the fast tokenizer")
        config = _read_json(path / "tokenizer_config.json")
        special = {
            field: _token_content(config[field])
            for field in SPECIAL_TOKEN_FIELDS
            if config.get(field) is not None
        }
        source = _chat_template_source(path, config)
        template = _compile(source) if source is not None else None
        tokenizer = Tokenizer.from_file(str(file))
        return cls(
            tokenizer,
            template,
            special,
            _longest_token_bytes(tokenizer),
            threads,
            renders_tools=source is not None and reads_tools(source),
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def min_tokens(self, text: str) -> int:
        """A lower bound on `encode(text)`'s length: every token covers at most
        `longest_token_bytes` bytes of the text (0 where no bound holds)."""
        if self.longest_token_bytes is None:
            return 0
        return math.ceil(len(text.encode("utf-8", "surrogatepass")) / self.longest_token_bytes)

    async def encode_async(
        self, text: str, *, add_special_tokens: bool = True, tenant: str = ""
    ) -> list[int]:
        """`encode`, on the pool (in ``tenant``'s turn) unless the text is short."""
        if len(text) <= INLINE_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await self._on_pool(
            tenant, lambda: self.encode(text, add_special_tokens=add_special_tokens)
        )

    async def render_chat_async(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        switches: Mapping[str, bool] | None = None,
        tenant: str = "",
    ) -> str:
        """`render_chat`, on the pool (in ``tenant``'s turn) unless the conversation is small
        (and has no tools)."""
        render = functools.partial(
            self.render_chat,
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            switches=switches,
        )
        size = sum(len(m.get("content") or "") for m in messages)
        if size <= INLINE_CHARS and len(messages) <= INLINE_MESSAGES and not tools:
            return render()
        return await self._on_pool(tenant, render)

    async def _on_pool(self, tenant: str, job: Callable[[], T]) -> T:
        async with self.turns.hold(tenant):
            return await asyncio.get_running_loop().run_in_executor(self.pool, job)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        # `encode_batch` releases the GIL while it tokenizes; `encode` holds it throughout, so
        # a long text on the pool stalled the event loop for as long (2 s for 1 MB).
        encoding = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return encoding.ids

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        switches: Mapping[str, bool] | None = None,
    ) -> str:
        """The prompt text of a conversation, as `apply_chat_template(tokenize=False)` gives
        (``tools``: its `tools=`, OpenAI's tool objects; ``switches``: its extra keyword
        arguments, `gateway.template_switches`' known booleans such as `enable_thinking`)."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template; use /v1/completions", param="messages"
            )
        try:
            return self.chat_template.render(
                messages=list(messages),
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **(switches or {}),
            )
        except jinja2.TemplateError as exc:
            # Templates reject conversations they cannot format (raise_exception).
            raise InvalidRequestError(f"chat template: {exc}", param="messages") from exc

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        # The template writes the special tokens itself, so none are added (like transformers).
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token as text, for logprobs (what vLLM shows: the token decoded on its own)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (OpenAI's logprob `bytes`): a token holding part of a
        multi-byte character gives that part, so a client joining them gets the text back.
        Byte-level BPE spells each byte as one character of GPT-2's alphabet; byte fallback
        spells a byte `<0xAB>`; anything else is the token's text in UTF-8."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel):
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        fallback = BYTE_FALLBACK.fullmatch(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        return self.token_text(token_id).encode()

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)


BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character → byte: the printable bytes stand for
    themselves, the others for chr(256 + n) in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in chars]
    chars |= {byte: chr(256 + n) for n, byte in enumerate(others)}
    return {char: byte for byte, char in chars.items()}


def _longest_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most bytes of input text one token can stand for, where that is bounded.

    A BPE token's vocabulary string is never shorter in UTF-8 than the input it matches:
    byte-level pieces spell each input byte as one character of 1-2 bytes, Metaspace spells a
    1-byte space as "▁" (3), byte fallback spells a byte as "<0xAB>". That holds only if
    nothing shrinks the text first, so any normalizer other than Prepend/expanding Replace,
    a pre-tokenizer that drops text (whitespace splitting), an added token that strips
    spaces, another model (WordPiece maps a whole unknown word to one token) or an unknown
    token that is reachable gives None.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _keeps_text(spec.get("normalizer"), "normalizer"):
        return None
    if not _keeps_text(spec.get("pre_tokenizer"), "pre_tokenizer"):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # such a token swallows any run of whitespace beside it
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    byte_level = set(pre_tokenizers.ByteLevel.alphabet()) <= vocab.keys() and "ByteLevel" in (
        json.dumps(spec.get("pre_tokenizer"))
    )
    if model.get("unk_token") is not None and not model.get("byte_fallback") and not byte_level:
        return None
    return max(len(token.encode("utf-8")) for token in vocab)


def _keeps_text(spec: Mapping[str, Any] | None, kind: str) -> bool:
    if spec is None:
        return True
    name = spec.get("type")
    if name == "Sequence":
        parts = spec.get("normalizers" if kind == "normalizer" else "pretokenizers") or []
        return all(_keeps_text(part, kind) for part in parts)
    if kind == "normalizer":
        if name == "Prepend":
            return True
        pattern = (spec.get("pattern") or {}).get("String")
        return (
            name == "Replace"
            and pattern is not None
            and len(spec.get("content", "").encode()) >= len(pattern.encode())
        )
    if name == "Split":
        return spec.get("behavior") != "Removed"
    return name in KEEPING_PRE_TOKENIZERS


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _token_content(value: Any) -> str:
    # tokenizer_config.json writes special tokens as strings or as AddedToken dicts.
    return value["content"] if isinstance(value, dict) else str(value)


def _chat_template_source(path: Path, config: Mapping[str, Any]) -> str | None:
    """transformers' lookup order: chat_template.jinja, then tokenizer_config's field."""
    file = path / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t["name"]: t["template"] for t in template}
        return named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile(source: str) -> jinja2.Template:
    return _environment().from_string(source)


def reads_tools(source: str) -> bool:
    """Whether a chat template reads the `tools` variable."""
    return "tools" in meta.find_undeclared_variables(_environment().parse(source))
