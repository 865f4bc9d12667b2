"""One sequence's sampled token: appended and checked for the ends that need no text (a stop
token, the length, the grammar), then turned into text (detokenized, stop strings) and into
the sequence's `RequestOutput`. `OutputStage` calls it for each sequence of a step."""

from __future__ import annotations

from collections.abc import Callable

from worker.core.outputs import RequestOutput
from worker.core.sequence import FinishReason, Sequence
from worker.sampling.rows import SampledToken
from worker.text.detokenizer import make_detokenizer
from worker.text.stop_checker import StopChecker


class TokenProcessor:
    def __init__(
        self,
        *,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        first_token: Callable[[Sequence], None] | None = None,
    ) -> None:
        """``first_token``: called with a sequence as its first token is appended."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.first_token = first_token

    def attach(self, seq: Sequence, tokenizer) -> None:
        """Give a new sequence its detokenizer and stop-string checker."""
        params = seq.params
        if tokenizer is not None:
            seq.detokenizer = make_detokenizer(
                tokenizer, seq.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
        if params.stop:
            seq.stop_checker = StopChecker(params.stop)
        if params.logprobs is not None:
            seq.logprobs = []
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = [None] * (len(seq.prompt_token_ids) - 1)

    def append_with_text(self, seq: Sequence, token: SampledToken, now: float) -> str:
        """Append ``token`` to ``seq``, set its finish reason if it ends here; the new text."""
        return self.add_text(seq, token.token_id, self.append(seq, token, now))

    def append(self, seq: Sequence, token: SampledToken, now: float) -> bool:
        """What the next step needs of ``token`` at once: append it, and end ``seq`` if a stop
        token, its length or its grammar says so. Returns whether the token shows in the text
        (a stop token, EOS or one of stop_token_ids, ends the request but not the text)."""
        if seq.params.max_tokens == 0:  # the prompt scored, nothing generated (not kept)
            seq.finish_reason = FinishReason.LENGTH
            return False
        token_id = token.token_id
        seq.append_token(token_id)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
            if self.first_token is not None:
                self.first_token(seq)
        seq.metrics.last_token_time = now
        seq.token_times.append(now)
        if seq.logprobs is not None:
            seq.logprobs.append(token)
        if seq.grammar is not None:
            seq.grammar.consume(token_id)
        params = seq.params
        shows = True
        if token_id in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = FinishReason.STOP
            shows = False
        elif token_id in params.stop_token_ids:
            seq.finish_reason = FinishReason.STOP
            seq.stop_reason = token_id
            shows = False
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        self._end_with_grammar(seq)
        return shows

    def add_text(self, seq: Sequence, token_id: int, shows: bool) -> str:
        """The text an appended token adds (``shows``: as ``append`` said), after any stop
        string it completes, which ends ``seq`` ("stop")."""
        if seq.detokenizer is None or not shows:
            return ""
        delta = seq.detokenizer.add(token_id)
        if seq.stop_checker is not None:
            checked = seq.stop_checker.feed(delta)
            delta = checked.text
            if checked.stopped:
                seq.finish_reason = FinishReason.STOP
                seq.stop_reason = checked.matched
        if delta:
            seq.text_pieces.append(delta)
        return delta

    @staticmethod
    def _end_with_grammar(seq: Sequence) -> None:
        """A structured output whose grammar allows nothing more is done ("stop")."""
        if seq.finish_reason is None and seq.grammar is not None and seq.grammar.is_complete:
            seq.finish_reason = FinishReason.STOP

    def flush(self, seq: Sequence) -> str:
        """Text held back until the end (an incomplete character, a possible stop string)."""
        if seq.detokenizer is None or isinstance(seq.stop_reason, str):
            return ""  # after a stop string, nothing more is released
        tail = seq.detokenizer.finish()
        if seq.stop_checker is not None:
            checked = seq.stop_checker.feed(tail)
            tail = checked.text + seq.stop_checker.flush()
            if checked.stopped:
                seq.finish_reason = FinishReason.STOP
                seq.stop_reason = checked.matched
        if tail:
            seq.text_pieces.append(tail)
        return tail

    def output(self, seq: Sequence, *, new_tokens: int, new_text: str) -> RequestOutput:
        """The request's state now (its lists read up to its current length)."""
        finished = seq.finish_reason is not None
        token_ids = seq.output_token_ids
        num_tokens = len(token_ids)
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            new_token_ids=token_ids[num_tokens - new_tokens :],
            new_text=new_text,
            finished=finished,
            num_tokens=num_tokens,
            finish_reason=seq.finish_reason.value if finished else None,
            stop_reason=seq.stop_reason,
            metrics=seq.metrics,
            num_cached_tokens=seq.num_cached_tokens,
            prompt_logprobs=seq.prompt_logprobs,
            _token_ids=token_ids,
            _logprobs=seq.logprobs,
            _token_times=seq.token_times,
            _text_pieces=seq.text_pieces,
            _num_text_pieces=len(seq.text_pieces),
        )
