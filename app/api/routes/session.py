"""/v1/session: the web app's sign-in, which puts the API key in a cookie.

The page's scripts cannot read the cookie (HttpOnly), no other site can make the browser send it
(SameSite=Strict), and it lasts for the browser session only (no expiry); requests then
authenticate with it as with a Bearer header.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from app.api.deps import SESSION_COOKIE, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services.auth import tenant_name

router = APIRouter(prefix="/v1/session", tags=["session"])


@router.post("", response_model=schemas.Session, responses=ERRORS)
async def sign_in(body: schemas.SignIn, work: Work, request: Request, response: Response) -> schemas.Session:
    """Check an API key and keep it in the session cookie; 401 for an unknown or revoked key."""
    name = await work.with_key(body.api_key)(tenant_name)
    secure = request.url.scheme == "https"
    response.set_cookie(SESSION_COOKIE, body.api_key, httponly=True, samesite="strict", secure=secure, path="/")
    return schemas.Session(tenant=name)


@router.get("", response_model=schemas.Session, responses=ERRORS)
async def current(work: Work) -> schemas.Session:
    """The tenant of the request's key (header or session cookie)."""
    return schemas.Session(tenant=await work(tenant_name))


@router.delete("", status_code=204)
async def sign_out(response: Response) -> Response:
    """Forget the session cookie."""
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    response.status_code = 204
    return response
