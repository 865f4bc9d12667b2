"""The console's pages: sign-in, sign-out, and one page per side (tenant, admin).

A page is a shell rendered with the signed-in tenant's name and the session's CSRF token; its
script fills it through the bridge (`gateway.console.bridge`). Signing in checks the
credential with the API's own check; a page whose credential no longer passes (a revoked key)
signs out and sends the browser back to sign in.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from gateway.console.session import (
    ADMIN,
    CSRF_FIELD,
    TENANT,
    Side,
    credential,
    csrf_matches,
    csrf_token,
    same_origin,
    sign_in,
    sign_out,
)
from gateway.deps import State, check_admin_token
from gateway.errors import GatewayError
from gateway.state import GatewayState

HERE = Path(__file__).parent
STATIC_PATH = "/console/static"
templates = Jinja2Templates(directory=HERE / "templates")


def static_files() -> StaticFiles:
    return StaticFiles(directory=HERE / "static")


async def signed_in_as(side: Side, state: GatewayState, token: str) -> str:
    """Who the credential signs in (a tenant's name, or "admin"); the API's own errors else."""
    if side is ADMIN:
        check_admin_token(state, token)
        return "admin"
    return (await state.tenants.authenticate(token)).tenant


def router(side: Side) -> APIRouter:
    pages = APIRouter(prefix=side.home, include_in_schema=False)

    @pages.get("")
    async def page(request: Request, state: State) -> Response:
        token = credential(request.headers, side)
        if token is None:
            return RedirectResponse(side.login, status_code=303)
        try:
            who = await signed_in_as(side, state, token)
        except GatewayError:
            response = RedirectResponse(side.login + "?expired=1", status_code=303)
            sign_out(response, side)
            return response
        context = {
            "side": side,
            "who": who,
            "csrf": csrf_token(token),
            "base_model": state.settings.served_model_name,
            "static": STATIC_PATH,
        }
        return templates.TemplateResponse(request, f"{side.role}.html", context)

    @pages.get("/login")
    async def login_form(request: Request, expired: bool = False) -> Response:
        message = "Your session ended: sign in again." if expired else None
        response = _login(request, side, message, status=200)
        if expired:
            sign_out(response, side)
        return response

    @pages.post("/login")
    async def login(request: Request, state: State) -> Response:
        if not same_origin(request.headers):
            return _login(request, side, "Sign in from this console's own page.", status=403)
        form = await request.form()
        token = str(form.get("credential") or "").strip()
        try:
            await signed_in_as(side, state, token)
        except GatewayError as exc:
            return _login(request, side, exc.message, status=exc.status)
        response = RedirectResponse(side.home, status_code=303)
        sign_in(response, side, token, https=request.url.scheme == "https")
        return response

    @pages.post("/logout")
    async def logout(request: Request) -> Response:
        form = await request.form()
        token = credential(request.headers, side)
        if token is not None and not csrf_matches(token, str(form.get(CSRF_FIELD) or "")):
            return Response("a sign-out needs its page's CSRF token", status_code=403)
        response = RedirectResponse(side.login, status_code=303)
        sign_out(response, side)
        return response

    return pages


def _login(request: Request, side: Side, message: str | None, *, status: int) -> Response:
    context = {"side": side, "message": message, "static": STATIC_PATH}
    return templates.TemplateResponse(request, "login.html", context, status_code=status)


SIDES = (TENANT, ADMIN)
