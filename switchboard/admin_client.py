"""`switchboard admin …`: the admin API over HTTP (httpx), one function per subcommand."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx


def _call(
    args: argparse.Namespace, method: str, path: str, body: Any = None, params: Any = None
) -> int:
    headers = {"Authorization": f"Bearer {args.admin_token}"}
    try:
        response = httpx.request(
            method,
            args.url.rstrip("/") + path,
            json=body,
            params=params,
            headers=headers,
            timeout=60.0,
        )
    except httpx.HTTPError as exc:
        print(f"switchboard: cannot reach the gateway at {args.url}: {exc}", file=sys.stderr)
        return 1
    try:
        payload = response.json()
    except ValueError:
        payload = {"error": {"message": response.text}}
    if response.is_error:
        message = payload.get("error", {}).get("message", response.text)
        print(f"switchboard: error {response.status_code}: {message}", file=sys.stderr)
        return 1
    print(json.dumps(payload, indent=2))
    return 0


def tenants_create(args: argparse.Namespace) -> int:
    return _call(args, "POST", "/admin/tenants", {"name": args.name})


def tenants_list(args: argparse.Namespace) -> int:
    return _call(args, "GET", "/admin/tenants")


def keys_create(args: argparse.Namespace) -> int:
    """Prints the new key: it is shown this once."""
    return _call(args, "POST", f"/admin/tenants/{args.tenant}/keys")


def keys_revoke(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/admin/keys/{args.key_id}")


def adapters_register(args: argparse.Namespace) -> int:
    body = {"name": args.name, "path": os.path.abspath(args.path)}
    return _call(args, "POST", f"/admin/tenants/{args.tenant}/adapters", body)


def adapters_list(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/tenants/{args.tenant}/adapters")


def adapters_remove(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/admin/tenants/{args.tenant}/adapters/{args.name}")


QUOTA_OPTIONS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "daily_tokens",
    "max_adapters",
    "max_adapter_bytes",
)


def quotas_set(args: argparse.Namespace) -> int:
    body = {name: getattr(args, name) for name in QUOTA_OPTIONS}
    return _call(args, "PUT", f"/admin/tenants/{args.tenant}/quotas", body)


def quotas_get(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/tenants/{args.tenant}/quotas")


def scheduling_set(args: argparse.Namespace) -> int:
    """Sends what was given; the gateway insists on exactly one of the two."""
    body = {k: v for k, v in (("tier", args.tier), ("weight", args.weight)) if v is not None}
    return _call(args, "PUT", f"/admin/tenants/{args.tenant}/scheduling", body)


def scheduling_get(args: argparse.Namespace) -> int:
    return _call(args, "GET", f"/admin/tenants/{args.tenant}/scheduling")


def scheduling_reset(args: argparse.Namespace) -> int:
    return _call(args, "DELETE", f"/admin/tenants/{args.tenant}/scheduling")


def usage(args: argparse.Namespace) -> int:
    params = {
        k: v
        for k, v in (
            ("tenant", args.tenant),
            ("start_date", args.start_date),
            ("end_date", args.end_date),
        )
        if v is not None
    }
    return _call(args, "GET", "/admin/usage", params=params)
