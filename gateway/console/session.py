"""A console session: the credential in an HttpOnly cookie, and a CSRF token derived from it.

The cookie holds the tenant's API key (or the admin token) itself, so the API's own check of
that credential is the only one: a revoked key signs its console out on the next call. Scripts
never see it (HttpOnly, SameSite=Strict, Secure over HTTPS). Every call a page makes carries
the CSRF token, HMAC(credential, label), which a page of another site can neither read nor
compute, and which needs no server-side state (any gateway replica checks it).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from http.cookies import SimpleCookie
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import Response

CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
_CSRF_LABEL = b"switchboard-console-csrf-v1"


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the console: where its pages live and what its API calls reach."""

    role: str  # "tenant" or "admin"
    home: str  # the page, e.g. "/console"
    cookie: str
    api_prefix: str  # what pages call: e.g. "/console/api/"
    api_target: str  # what that reaches in the app: e.g. "/v1/"

    @property
    def login(self) -> str:
        return self.home + "/login"

    @property
    def logout(self) -> str:
        return self.home + "/logout"


TENANT = Side("tenant", "/console", "sb_console", "/console/api/", "/v1/")
ADMIN = Side("admin", "/console/admin", "sb_console_admin", "/console/admin/api/", "/admin/")


def csrf_token(credential: str) -> str:
    return hmac.new(credential.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


def csrf_matches(credential: str, given: str | None) -> bool:
    return bool(given) and hmac.compare_digest(csrf_token(credential), given or "")


def credential(headers: Headers, side: Side) -> str | None:
    """The side's credential from the request's cookies, if any."""
    raw = headers.get("cookie")
    if not raw:
        return None
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(raw)
    except Exception:  # a malformed Cookie header is no session
        return None
    morsel = jar.get(side.cookie)
    return morsel.value if morsel is not None and morsel.value else None


def same_origin(headers: Headers) -> bool:
    """A state-changing request must come from our own pages: its Origin (sent by browsers on
    every POST) names our host, and the browser does not call it cross-site."""
    site = headers.get("sec-fetch-site")
    if site is not None and site not in {"same-origin", "none"}:
        return False
    origin = headers.get("origin")
    if origin is None:
        return True  # not a browser (curl): no ambient cookie to abuse without a token
    return urlsplit(origin).netloc == headers.get("host", "")


def sign_in(response: Response, side: Side, value: str, *, https: bool) -> None:
    response.set_cookie(
        side.cookie,
        value,
        path=side.home,
        httponly=True,
        samesite="strict",
        secure=https,
    )


def sign_out(response: Response, side: Side) -> None:
    response.delete_cookie(side.cookie, path=side.home, httponly=True, samesite="strict")


# Every console response: no script, style or connection but our own, no framing, no caching.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # "no-referrer" would make the browser send `Origin: null`
    "cache-control": "no-store",
}
