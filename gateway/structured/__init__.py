"""Structured outputs and tools: the fields that constrain an answer, each constraint checked
in a child process before any worker sees it, tools shown in the prompt and parsed back."""
