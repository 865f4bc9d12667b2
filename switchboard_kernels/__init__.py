"""The engine's compute kernels: Triton on CUDA, C on CPU, each beside a torch reference.

Not called ``kernels``: transformers requires Hugging Face's ``kernels`` distribution,
whose top-level package of that name would shadow ours (tests/test_package_names.py).
"""
