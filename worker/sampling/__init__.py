"""Choosing the next token: sampling parameters, penalties, filters and the draw."""
