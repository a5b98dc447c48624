"""Whose data a request may see. Each API key is a tenant: the stored responses and the conversation sessions it
creates are its own, and another key meets them as if they did not exist (the 404 of an unknown id, so ids cannot be
probed). A server without keys has one tenant. A tenant is named by a digest of its key; the key itself is never
kept. (Prefix-cache hits cross tenants: a hit reuses KV only for the very tokens the request sent, so it shares no
content.)"""

from __future__ import annotations

import hashlib

from fastapi import Request

NO_TENANT = ""  # a server without API keys: everyone is one tenant, and ids are used as given


def tenant_of(request: Request, api_keys: list[str]) -> str:
    """The request's tenant: a digest of its API key, which the front door has verified; NO_TENANT without keys."""
    if not api_keys:
        return NO_TENANT
    auth = request.headers.get("authorization", "")
    return hashlib.sha256(auth.removeprefix("Bearer ").strip().encode()).hexdigest()[:32]


def scoped(tenant: str, session_id: str) -> str:
    """The engine's name for a tenant's session: two keys' sessions of the same name are two sessions."""
    return f"{tenant}:{session_id}" if tenant else session_id


def unscoped(tenant: str, engine_session_id: str) -> str | None:
    """The tenant's own name for an engine session; None when the session is another tenant's."""
    if not tenant:
        return engine_session_id
    prefix = f"{tenant}:"
    return engine_session_id.removeprefix(prefix) if engine_session_id.startswith(prefix) else None
