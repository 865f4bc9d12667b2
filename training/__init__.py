"""Offline training tools: distilling the speculative draft head from the target model.

Kept out of ``worker/`` so the serving process never loads them; the worker only reads the
files they write.
"""
