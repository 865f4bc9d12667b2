"""Grammar checks in a child process: `python -m gateway.structured.grammar_child TIMEOUT_S`
reads one check per line on stdin, `{"format", "text"}`, and answers each with one line on
stdout, `{"error", "outcome"}` (error "" when the grammar is valid; outcome "valid", "invalid",
"crashed" or "timeout").

Why a process: llguidance's compiler recurses on the grammar's rules, and a chain of a few thousand
`$ref`s or Lark rules (60 KB of text) overflows the stack and kills the process with SIGSEGV; no
parser limit bounds that. So this process is a zygote: it imports the checkers once and forks a
fresh grandchild for each check, which answers through a pipe and exits. A grammar that crashes
its grandchild, or runs past TIMEOUT_S (it is killed then), costs only its own check: the zygote
answers for it and the next check forks at once (a fork is about a millisecond; starting a new
Python process with these imports took seconds). Each check runs on a thread with half the stack
a Python thread normally gets (8 MiB), so what passes here compiles with room to spare in a
worker. JSON schemas go through `jsonschema`'s metaschema check first (its message names the bad
keyword), then llguidance's own (unsupported keywords by name); both with the worker's options
(`worker/sampling/structured_output.py`, `worker/sampling/grammar.py`).
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import sys
import threading
from typing import Any

import jsonschema
import llguidance

from runtime.grammar_bounds import JSON_STYLE, PARSER_LIMITS

# The stack of the thread a check runs on (see the module docstring).
CHECK_STACK_BYTES = 4 << 20
# The child's whole address space: llguidance's lexer states are bounded (~2 kB each).
MEMORY_BYTES = 2 << 30
# An answer's message is cut to this many characters (llguidance quotes the grammar); its
# UTF-8 then fits a pipe's buffer, so a grandchild never blocks writing it.
MAX_MESSAGE_CHARS = 1000
# Checks run at a lower CPU priority than the gateway and the workers beside them: a flood of
# slow grammars then takes only the CPU nobody else wants.
NICENESS = 10
CRASHED = (
    "the grammar could not be compiled (the checker ended on it: it is nested too deeply "
    "or too large)"
)


def check(fmt: str, text: str) -> str:
    """Why ``text`` is not a valid grammar of format ``fmt``; "" if it is."""
    try:
        if fmt == "json_schema":
            problem = _schema_problem(text)
            if problem:
                return problem
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_STYLE)
        elif fmt == "json_object":
            return ""
        else:
            grammar = llguidance.grammar_from(fmt, text)  # type: ignore[arg-type]
        limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        return llguidance.LLMatcher.validate_grammar(grammar, None, limits=limits)
    except RecursionError:
        return "the grammar is nested too deeply"
    except (ValueError, TypeError) as exc:
        return str(exc) or type(exc).__name__


def _schema_problem(text: str) -> str:
    """The metaschema's complaint about a JSON schema (Draft 2020-12), if any. `format`
    values are not checked here: a `pattern` is llguidance's regex dialect, not Python's."""
    try:
        schema: Any = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    if not isinstance(schema, dict):
        return "a JSON schema must be an object"
    try:
        jsonschema.Draft202012Validator.check_schema(schema, format_checker=None)
    except jsonschema.SchemaError as exc:
        return f"{exc.message} (at {exc.json_path})"
    return ""


def _answer(line: str) -> str:
    job = json.loads(line)
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(check(job["format"], job["text"])))
    thread.start()
    thread.join()
    return result[0][:MAX_MESSAGE_CHARS] if result else "the grammar could not be checked"


def isolated_answer(line: str, *, timeout_s: float) -> tuple[str, str]:
    """(error, outcome) of one check run in a forked grandchild (module docstring)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the grandchild: check, answer, exit without running the zygote's cleanup
        code = 1
        try:
            os.close(read)
            os.write(write, _answer(line).encode("utf-8", "surrogatepass"))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        if not _ended_within(pid, timeout_s):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"checking it took longer than {timeout_s:g} s", "timeout"
        _, status = os.waitpid(pid, 0)
        message = answer.read().decode("utf-8", "replace")
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return CRASHED, "crashed"
    return message, "invalid" if message else "valid"


def _ended_within(pid: int, timeout_s: float) -> bool:
    """Whether the process ``pid`` ends within ``timeout_s`` (it is not reaped here). Without
    pidfds (not Linux) it is waited for unbounded: the gateway's own deadline still holds."""
    if not hasattr(os, "pidfd_open"):
        return True
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    return bool(ready)


def main() -> int:
    timeout_s = float(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashed check dumps no core
    os.nice(NICENESS)
    threading.stack_size(CHECK_STACK_BYTES)  # this process's threads only run checks
    # Answers go to the original stdout; anything a library prints goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    for line in sys.stdin:
        error, outcome = isolated_answer(line, timeout_s=timeout_s)
        answers.write(json.dumps({"error": error, "outcome": outcome}) + "\n")
        answers.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
