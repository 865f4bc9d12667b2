"""Constrained decoding: a request's output must match a grammar (a JSON schema, a regular
expression, a choice of strings, a Lark or GBNF grammar).

llguidance (Moskal et al., "Guidance", and its `llguidance` Rust core) turns the grammar into
a matcher that says, before each token, which tokens of the vocabulary may come next (a
bitmask); the engine masks those rows of the step's logits to -inf before sampling or
verifying drafts, and feeds each emitted token back. Why llguidance: it has no dependencies
(the gateway checks a grammar with the same library, before a request reaches a worker), it
computes each mask lazily from a lexer and an Earley parser instead of compiling every schema
to token tables up front, and ``LLParserLimits`` bounds the parser's work per token, so a
hostile grammar cannot stall the step for everyone else.

Compiling is cached by (tenant, format, text): a request's sequences each get a copy of the
cached matcher in its start state. The tenant is in the key because a cache hit is fast: shared
across tenants, a request's latency would tell one tenant which grammars another had sent. The
server compiles off the step loop (``prepare``) before it queues a request, so the loop itself
only copies.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import llguidance
import llguidance.numpy as llguidance_numpy  # not .torch: it runs torch.compile at import
import numpy as np
import torch

from runtime.grammar_bounds import PARSER_LIMITS
from switchboard_kernels.token_mask import apply_token_bitmask_
from worker.errors import InvalidRequestError, StructuredOutputError
from worker.sampling.structured_output import StructuredOutput

# Compiled grammars kept, by content.
CACHE_SIZE = 256
# The stack of the thread that compiles: llguidance recurses over a grammar's nesting (and
# overflows a thread's stack, killing the process, on thousands of chained $refs or rules).
# The gateway checks grammars on a 4 MiB stack in child processes and refuses what fails
# there; compiling on 16x that leaves a direct caller (or the offline API) a wide margin.
COMPILE_STACK_BYTES = 64 << 20
# An error's text kept for the caller.
MAX_ERROR_CHARS = 300


class GrammarCompiler:
    """Matchers for a model's vocabulary, compiled once per grammar; safe from any thread."""

    def __init__(self, tokenizer, *, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        """``tokenizer``: the model's Hugging Face tokenizer (its vocabulary and special
        tokens); ``vocab_size``: rows of the model's logits (may exceed the tokenizer's)."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[bytes, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self._compile_thread: ThreadPoolExecutor | None = None

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (about 0.3 s to build: built on first use)."""
        with self._lock:
            if self._tokenizer is None:
                if self._hf_tokenizer is None:
                    raise InvalidRequestError("this model has no tokenizer: no structured output")
                from llguidance.hf import from_tokenizer

                self._tokenizer = from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def prepare(self, spec: StructuredOutput, tenant: str = "") -> None:
        """Compile ``spec`` for ``tenant`` into the cache (the slow part, for a thread off the
        step loop)."""
        self._compiled(spec, tenant)

    def matcher(self, spec: StructuredOutput, tenant: str = "") -> GrammarState:
        """A fresh matcher in the grammar's start state; ``InvalidRequestError`` if the
        grammar is invalid or too complex."""
        return GrammarState(self._compiled(spec, tenant).deep_copy())

    def _compiled(self, spec: StructuredOutput, tenant: str) -> llguidance.LLMatcher:
        key = hashlib.sha256(f"{tenant}\0{spec.format}\0{spec.text}".encode()).digest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached
        tokenizer, grammar = self.tokenizer, spec.grammar()
        matcher = self._executor().submit(self._build, tokenizer, grammar).result()
        if matcher.is_error():
            error = matcher.get_error()[:MAX_ERROR_CHARS]
            raise InvalidRequestError(f"invalid {spec.format} structured output: {error}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def _build(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(tokenizer, grammar, limits=self.limits, log_level=0)

    def _executor(self) -> ThreadPoolExecutor:
        """One compiling thread with a deep stack (``COMPILE_STACK_BYTES``)."""
        with self._lock:
            if self._compile_thread is None:
                previous = threading.stack_size(COMPILE_STACK_BYTES)
                try:
                    self._compile_thread = ThreadPoolExecutor(1, "grammar-compile")
                    self._compile_thread.submit(lambda: None).result()  # start it now
                finally:
                    threading.stack_size(previous)
            return self._compile_thread


class GrammarState:
    """One sequence's matcher: which tokens may come next, fed every emitted token."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def fork(self) -> GrammarState:
        return GrammarState(self.matcher.deep_copy())

    def consume(self, token_id: int) -> None:
        """Advance past ``token_id``; an error if the grammar did not allow it (the mask
        forbids that, so it means the grammar ran out of its work bounds)."""
        if not self.matcher.consume_token(token_id):
            error = self.matcher.get_error()[:MAX_ERROR_CHARS]
            raise StructuredOutputError(f"the structured output failed: {error}")

    @property
    def is_complete(self) -> bool:
        """Nothing may follow but the end: the request is done. An error if the matcher
        failed (its work bounds ran out): the request cannot go on."""
        if self.matcher.is_error():
            error = self.matcher.get_error()[:MAX_ERROR_CHARS]
            raise StructuredOutputError(f"the structured output failed: {error}")
        return self.matcher.is_stopped()


class MaskBatch:
    """Fills a step's masks, one row of the logits each, and applies them in place."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()

    @torch.inference_mode()
    def apply_(self, logits: torch.Tensor, rows: list[tuple[GrammarState, int, list[int]]]) -> None:
        """For each (state, row, drafts): mask ``logits[row]`` for the state's next token,
        and ``logits[row + 1 + j]`` for the token after drafts[:j + 1] (speculation). Rows
        after a draft the grammar refuses stay unmasked: verification stops at that draft.

        logits: [num_rows, vocab] (modified: disallowed tokens become -inf)."""
        if not rows:
            return
        positions: list[int] = []  # the logits row of each bitmask row
        plain, with_drafts = [], []
        for state, row, drafts in rows:
            first = len(positions)
            positions += range(row, row + len(drafts) + 1)
            if drafts:
                with_drafts.append((state.matcher, first, drafts))
            else:
                plain.append((state.matcher, first))
        bitmask = np.full((len(positions), self.words), -1, dtype=np.int32)
        if with_drafts:
            llguidance_numpy.fill_next_token_bitmask_par_with_draft_tokens(
                self._executor, with_drafts, bitmask
            )
        if plain:
            llguidance_numpy.fill_next_token_bitmask_par(self._executor, plain, bitmask)
        apply_token_bitmask_(logits, positions, bitmask)
