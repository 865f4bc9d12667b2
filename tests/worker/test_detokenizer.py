"""Incremental detokenization: deltas add up to the full decode, whatever the token boundaries.

Byte-level tokenizers are streamed both ways: through the byte table the engine uses for them
(``make_detokenizer``) and through the decode window every other tokenizer gets."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.text.byte_level import ByteLevelDetokenizer, token_bytes
from worker.text.detokenizer import IncrementalDetokenizer, make_detokenizer

CORPUS = [
    "héllo 世界 🙂 hello world",
    "the quick brown fox jumps over the lazy dog",
    "naïve café über straße déjà vu",
    "日本語のテキスト 😀🎉 emoji",
    "hello hello world world, again and again.",
] * 20
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train(tokenizer: Tokenizer, *, vocab_size: int, alphabet: list[str]) -> PreTrainedTokenizerFast:
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=alphabet,
        special_tokens=SPECIAL,
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL[0],
        additional_special_tokens=SPECIAL[1:],
    )
    # Added tokens that are not special; a space is outside the byte-level alphabet.
    fast.add_tokens(["<tool>", "<tool call>"])
    return fast


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """A GPT-2 / Llama 3 style byte-level BPE (every byte is a token)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return train(tokenizer, vocab_size=400, alphabet=pre_tokenizers.ByteLevel.alphabet())


@pytest.fixture(scope="module")
def metaspace() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: '▁' marks a space, the first one is dropped on decode."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    alphabet = sorted(set("".join(CORPUS)) | {"▁"})
    return train(tokenizer, vocab_size=300, alphabet=alphabet)


def byte_token(tokenizer: PreTrainedTokenizerFast, value: int) -> int:
    """The id of the single-byte token for `value` in a byte-level vocabulary."""
    # GPT-2's table: printable bytes stand for themselves, the others for chr(256 + n) in order.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    char = chr(value) if value in printable else chr(256 + others.index(value))
    token_id = tokenizer.convert_tokens_to_ids(char)
    assert isinstance(token_id, int) and tokenizer.decode([token_id]).encode() in (
        bytes([value]),
        "\ufffd".encode(),
    )
    return token_id


def stream(
    tokenizer: Any,
    output_ids: list[int],
    *,
    prompt_ids: list[int] | None = None,
    skip_special_tokens: bool = True,
    window: bool = False,
) -> list[str]:
    """Every delta, including the final flush: from the engine's detokenizer for this
    tokenizer, or (``window``) from the decode window's."""
    make = IncrementalDetokenizer if window else make_detokenizer
    detok = make(tokenizer, prompt_ids or [], skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(t) for t in output_ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize(
    "text",
    ["héllo 世界 🙂", "the quick brown fox", "naïve café", "😀🎉 emoji 日本語", " leading space"],
)
@pytest.mark.parametrize("window", [False, True])
def test_deltas_add_up_to_the_text(
    byte_level: PreTrainedTokenizerFast, text: str, window: bool
) -> None:
    ids = byte_level.encode(text)
    prompt = byte_level.encode("Say:")
    assert "".join(stream(byte_level, ids, prompt_ids=prompt, window=window)) == text
    assert "".join(stream(byte_level, ids, window=window)) == text


def test_a_character_split_across_tokens_is_held_back_until_complete(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    world = "世".encode()  # 3 bytes
    ids = [byte_token(byte_level, b) for b in b"a" + world + b"b"]
    for make in (IncrementalDetokenizer, make_detokenizer):
        detok = make(byte_level, byte_level.encode("x"))
        assert [detok.add(t) for t in ids] == ["a", "", "", "世", "b"]
        assert detok.finish() == ""


def test_a_trailing_partial_character_is_flushed_as_replacement(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    ids = [byte_token(byte_level, b) for b in b"ok" + "🙂".encode()[:2]]
    for make in (IncrementalDetokenizer, make_detokenizer):
        detok = make(byte_level, [])
        assert "".join(detok.add(t) for t in ids) == "ok"
        assert "ok" + detok.finish() == byte_level.decode(ids) == "ok\ufffd"


@pytest.mark.parametrize("window", [False, True])
def test_special_tokens_are_skipped_or_kept(
    byte_level: PreTrainedTokenizerFast, window: bool
) -> None:
    ids = [*byte_level.encode("hello"), byte_level.eos_token_id, *byte_level.encode(" world")]
    assert "".join(stream(byte_level, ids, window=window)) == "hello world"
    kept = "".join(stream(byte_level, ids, skip_special_tokens=False, window=window))
    assert kept == "hello<|endoftext|> world" == byte_level.decode(ids)


@pytest.mark.parametrize("window", [False, True])
def test_a_prompt_ending_inside_a_character_is_not_completed_by_the_output(
    byte_level: PreTrainedTokenizerFast, window: bool
) -> None:
    smile = "🙂".encode()
    prompt = byte_level.encode("hi ") + [byte_token(byte_level, b) for b in smile[:2]]
    output = [byte_token(byte_level, b) for b in smile[2:]] + byte_level.encode("ok")
    deltas = stream(byte_level, output, prompt_ids=prompt, window=window)
    assert "".join(deltas) == byte_level.decode(output)


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_decode_like_the_full_decode(
    byte_level: PreTrainedTokenizerFast, skip_special_tokens: bool, window: bool
) -> None:
    """Property: for random ids (special tokens, added tokens, stray bytes that make invalid
    UTF-8), the deltas concatenate to tokenizer.decode(output_ids)."""
    rng = random.Random(1234 + skip_special_tokens)
    vocab = len(byte_level)
    prompts = [[], byte_level.encode("Hello there,"), None]
    for case in range(400):
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        prompt = prompts[case % 3]
        if prompt is None:  # a random prompt, which may end inside a character
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        deltas = stream(
            byte_level,
            output,
            prompt_ids=prompt,
            skip_special_tokens=skip_special_tokens,
            window=window,
        )
        expected = byte_level.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(deltas) == expected, (prompt, output)


@pytest.mark.parametrize("window", [False, True])
def test_random_multibyte_text_split_anywhere(
    byte_level: PreTrainedTokenizerFast, window: bool
) -> None:
    """Property: valid text spelled with single-byte tokens streams out exactly."""
    rng = random.Random(99)
    alphabet = "aé世🙂 ü語😀"
    for _ in range(100):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        ids: list[int] = []
        for char in text:  # mix merged tokens and raw bytes
            if rng.random() < 0.5:
                ids += byte_level.encode(char)
            else:
                ids += [byte_token(byte_level, b) for b in char.encode()]
        deltas = stream(byte_level, ids, prompt_ids=byte_level.encode("x"), window=window)
        assert "".join(deltas) == text
        assert "\ufffd" not in "".join(deltas)


class CountingTokenizer:
    """Wraps a fast tokenizer and records the length of every window the detokenizer decodes."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.inner = tokenizer.backend_tokenizer
        self.backend_tokenizer = self
        self.window_lengths: list[int] = []

    def get_added_tokens_decoder(self) -> Any:
        return self.inner.get_added_tokens_decoder()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_windows_stay_small(byte_level: PreTrainedTokenizerFast) -> None:
    text = byte_level.encode("héllo 世界 🙂 the quick brown fox " * 20)
    counting = CountingTokenizer(byte_level)
    assert "".join(stream(counting, text, prompt_ids=text, window=True)) == byte_level.decode(text)
    assert max(counting.window_lengths) <= 8


def test_decode_windows_stay_small_on_endless_invalid_bytes(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    # A stream of lead bytes never completes a character: every step ends in U+FFFD.
    garbage = [byte_token(byte_level, 0xE4)] * 200 + byte_level.encode("end")
    counting = CountingTokenizer(byte_level)
    deltas = stream(counting, garbage, window=True)
    assert "".join(deltas) == byte_level.decode(garbage) == "\ufffd" * 200 + "end"
    assert max(counting.window_lengths) <= 20


def test_leading_space_continues_the_prompt(metaspace: PreTrainedTokenizerFast) -> None:
    prompt = metaspace.encode("the quick")
    output = metaspace.encode("the quick brown fox")[len(prompt) :]
    assert metaspace.convert_ids_to_tokens(output[0]).startswith("▁")
    deltas = stream(metaspace, output, prompt_ids=prompt)
    full = metaspace.decode(prompt + output)
    assert "".join(deltas) == full[len(metaspace.decode(prompt)) :] == " brown fox"
    # Without a prompt the output is decoded on its own, first space dropped, as decode does.
    assert "".join(stream(metaspace, output)) == metaspace.decode(output) == "brown fox"


def test_metaspace_random_ids_continue_the_prompt(metaspace: PreTrainedTokenizerFast) -> None:
    rng = random.Random(7)
    prompt = metaspace.encode("hello world")
    for _ in range(200):
        output = [rng.randrange(len(metaspace)) for _ in range(rng.randrange(0, 30))]
        full = metaspace.decode(prompt + output, skip_special_tokens=True)
        expected = full[len(metaspace.decode(prompt, skip_special_tokens=True)) :]
        assert "".join(stream(metaspace, output, prompt_ids=prompt)) == expected, output


def test_each_tokenizer_gets_its_detokenizer(
    byte_level: PreTrainedTokenizerFast, metaspace: PreTrainedTokenizerFast
) -> None:
    assert isinstance(make_detokenizer(byte_level, []), ByteLevelDetokenizer)
    assert isinstance(make_detokenizer(metaspace, []), IncrementalDetokenizer)
    assert token_bytes(metaspace.backend_tokenizer) is None


def test_the_byte_table_holds_each_id_as_the_tokenizer_decodes_it(
    byte_level: PreTrainedTokenizerFast, default_model_path
) -> None:
    """Every id of the default model's tokenizer (and of the test one, with added tokens
    inside and outside the byte alphabet) against the library's own decode; ids it does not
    know decode to nothing."""
    from transformers import AutoTokenizer

    for tokenizer in (byte_level, AutoTokenizer.from_pretrained(default_model_path)):
        backend = tokenizer.backend_tokenizer
        table = token_bytes(backend)
        assert table is not None and len(table) == len(tokenizer)
        for token_id, piece in enumerate(table):
            expected = backend.decode([token_id], skip_special_tokens=False)
            assert piece.decode("utf-8", "replace") == expected, token_id
        detok = make_detokenizer(tokenizer, [])
        assert detok.add(len(table)) == detok.add(-1) == "" == backend.decode([len(table)])
