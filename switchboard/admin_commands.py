"""`switchboard admin …`: the subcommands that wrap the gateway's admin API.

Their handlers live in ``switchboard.admin_client`` and are imported on use, so the CLI stays light.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from switchboard.commands import Command, Handler


def _admin(name: str) -> Handler:
    """The handler `switchboard.admin_client.<name>`, imported on use (httpx loads only then)."""

    def run(args: argparse.Namespace) -> int:
        from switchboard import admin_client

        return getattr(admin_client, name)(args)

    return run


def _admin_arguments(
    *positionals: str, options: tuple[tuple[str, type, str], ...] = ()
) -> Callable[[argparse.ArgumentParser], None]:
    """Positionals, optional `(flag, type, help)` options, and the gateway URL and token."""

    def add(parser: argparse.ArgumentParser) -> None:
        import os

        for positional in positionals:
            parser.add_argument(positional)
        for flag, kind, text in options:
            parser.add_argument(flag, type=kind, help=text)
        parser.add_argument(
            "--url",
            default=os.environ.get("SWITCHBOARD_GATEWAY_URL", "http://127.0.0.1:8000"),
            help="gateway base URL (default: $SWITCHBOARD_GATEWAY_URL or %(default)s)",
        )
        parser.add_argument(
            "--admin-token",
            default=os.environ.get("SWITCHBOARD_ADMIN_TOKEN", ""),
            help="admin bearer token (default: $SWITCHBOARD_ADMIN_TOKEN)",
        )

    return add


ADMIN_COMMANDS: tuple[Command, ...] = (
    Command(
        ("admin", "tenants", "create"),
        "create a tenant",
        _admin("tenants_create"),
        _admin_arguments("name"),
    ),
    Command(
        ("admin", "tenants", "list"), "list tenants", _admin("tenants_list"), _admin_arguments()
    ),
    Command(
        ("admin", "keys", "create"),
        "create an API key for a tenant (shown once)",
        _admin("keys_create"),
        _admin_arguments("tenant"),
    ),
    Command(
        ("admin", "keys", "revoke"),
        "revoke an API key by its key id",
        _admin("keys_revoke"),
        _admin_arguments("key_id"),
    ),
    Command(
        ("admin", "adapters", "register"),
        "validate, store and name a PEFT adapter directory for a tenant",
        _admin("adapters_register"),
        _admin_arguments("tenant", "name", "path"),
    ),
    Command(
        ("admin", "adapters", "list"),
        "list a tenant's adapters",
        _admin("adapters_list"),
        _admin_arguments("tenant"),
    ),
    Command(
        ("admin", "adapters", "remove"),
        "remove a tenant's adapter name",
        _admin("adapters_remove"),
        _admin_arguments("tenant", "name"),
    ),
    Command(
        ("admin", "quotas", "set"),
        "replace a tenant's limits (a limit left out is unlimited)",
        _admin("quotas_set"),
        _admin_arguments(
            "tenant",
            options=(
                ("--requests-per-minute", int, "requests per sliding minute"),
                ("--tokens-per-minute", int, "prompt + max_tokens per sliding minute"),
                ("--max-concurrent-requests", int, "requests running at once"),
                ("--daily-tokens", int, "tokens per UTC day"),
                ("--max-adapters", int, "adapter names (left out: the gateway's default)"),
                ("--max-adapter-bytes", int, "adapter storage (left out: the gateway's default)"),
            ),
        ),
    ),
    Command(
        ("admin", "quotas", "get"),
        "show a tenant's limits",
        _admin("quotas_get"),
        _admin_arguments("tenant"),
    ),
    Command(
        ("admin", "scheduling", "set"),
        "put a tenant on a scheduling tier or give it a weight (exactly one of the two)",
        _admin("scheduling_set"),
        _admin_arguments(
            "tenant",
            options=(
                ("--tier", str, "a tier named in the gateway's SWITCHBOARD_SCHEDULING_TIERS"),
                ("--weight", float, "a weight of its own, in [0.001, 1000]"),
            ),
        ),
    ),
    Command(
        ("admin", "scheduling", "get"),
        "show a tenant's scheduling tier and weight",
        _admin("scheduling_get"),
        _admin_arguments("tenant"),
    ),
    Command(
        ("admin", "scheduling", "reset"),
        "put a tenant back on the default tier",
        _admin("scheduling_reset"),
        _admin_arguments("tenant"),
    ),
    Command(
        ("admin", "usage"),
        "usage per tenant, day and model",
        _admin("usage"),
        _admin_arguments(
            options=(
                ("--tenant", str, "one tenant (default: all)"),
                ("--start-date", str, "YYYY-MM-DD (default: today, UTC)"),
                ("--end-date", str, "YYYY-MM-DD (default: today, UTC)"),
            )
        ),
    ),
)
