"""Speculative decoding: a proposer guesses k tokens, the target verifies them in one pass.

Leviathan et al. (2023), "Fast Inference from Transformers via Speculative Decoding", and
Chen et al. (2023), "Accelerating Large Language Model Decoding with Speculative Sampling":
accepting draft token d with probability min(1, p(d) / q(d)) and, on rejection, sampling
from norm(max(0, p - q)) yields exactly the target distribution p.
"""
