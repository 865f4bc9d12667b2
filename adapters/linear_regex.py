"""Tenants' regular expressions (`target_modules`, `exclude_modules`, `layers_pattern`,
`rank_pattern` / `alpha_pattern` keys), compiled with RE2 so matching is linear in the name.

Python's `re` backtracks: `(a+)+$` against a long name takes exponential time, and one such
upload froze the gateway's event loop. RE2 has no backreferences or lookarounds; a pattern
that needs them is refused with the reason, which PEFT adapters never need (their patterns
are names, alternations and `.*`). The patterns we build around them (PEFT's own wrapping)
compile to the same RE2 semantics as Python's for names without newlines.
"""

from __future__ import annotations

import functools

import re2

MAX_PATTERN_CHARS = 4096
# RE2's memory budget for one compiled program (its default is 8 MiB): bounded, and ample
# for any alternation of module names.
MAX_PROGRAM_BYTES = 8 << 20

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # the reason travels in the exception, not to stderr
_OPTIONS.max_mem = MAX_PROGRAM_BYTES


class PatternError(ValueError):
    """A pattern RE2 cannot compile (unsupported syntax, too long, over its memory budget)."""


@functools.lru_cache(maxsize=1024)
def compile_linear(pattern: str) -> re2._Regexp:
    """`pattern` compiled by RE2; PatternError says why it cannot be."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise PatternError(f"longer than {MAX_PATTERN_CHARS} characters")
    try:
        return re2.compile(pattern, options=_OPTIONS)
    except re2.error as exc:
        reason = exc.args[0].decode() if exc.args and isinstance(exc.args[0], bytes) else exc
        raise PatternError(
            f"{reason}; patterns are matched with RE2 (linear time), which has no "
            "backreferences or lookarounds"
        ) from exc


def fullmatch(pattern: str, text: str) -> bool:
    return compile_linear(pattern).fullmatch(text) is not None


def match(pattern: str, text: str):
    """`re.match` semantics (anchored at the start), in linear time."""
    return compile_linear(pattern).match(text)
