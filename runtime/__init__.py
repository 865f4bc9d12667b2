"""Pieces every process shares: the worker registry, home directories, logging, TLS
certificates, the embedded Redis, and starting a local stack.

It sits below the CLI (``switchboard/``) and beside ``rpc/``: worker, gateway and bench
import it, and it imports none of them nor the CLI.
"""
