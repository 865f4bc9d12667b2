"""What a structured output's grammar may cost, agreed between the gateway (which checks a
grammar before any worker sees it) and the worker (which compiles it): the same llguidance
parser limits and the same JSON style on both sides, so a grammar the gateway accepts is one
the worker can run. No imports: both processes read it without loading llguidance's users."""

# llguidance's parser limits (`LLParserLimits`): Earley items per row and per token, lexer
# work per token and at the start, lexer states, grammar size. Past them a grammar fails
# (at the gateway's check, or for its own request at the worker) instead of stalling a step.
PARSER_LIMITS = {
    "max_items_in_row": 2_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 100_000,
    "max_grammar_size": 2_000_000,
    # Errors name the rule, not the whole grammar (which may be 256 KiB).
    "verbose_errors": False,
}

# JSON as Python's json.dumps writes it, which models have seen most: one space after ","
# and ":", no other whitespace (free whitespace lets a model pad forever). A schema's own
# "x-guidance" options override these.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Grammar text a worker compiles at most; the gateway's max_grammar_bytes is at most this.
MAX_GRAMMAR_BYTES = 1 << 20
