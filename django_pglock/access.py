"""Who may see job names and details: staff, or a caller with ``HEALTH_TOKEN``.

Secure by default: without a configured token, only a logged-in staff user sees details.
The token is read from ``Authorization: Bearer <token>`` (never from the query string,
which ends up in access logs) and compared in constant time.
"""

from __future__ import annotations

import hmac

from django.http import HttpRequest

from .conf import get_setting

__all__ = ["MIN_TOKEN", "is_usable_token", "may_see_details"]


def may_see_details(request: HttpRequest) -> bool:
    """Whether ``request`` comes from staff or carries the configured token."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return True
    token = get_setting("HEALTH_TOKEN")
    if not is_usable_token(token):
        return False  # unset, or unusable (reported by manage.py check as E015)
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    # Header values arrive as latin-1 text (WSGI, ASGI): compare their bytes.
    return hmac.compare_digest(given.strip().encode("latin-1", "replace"), token.encode("ascii"))


#: The shortest token accepted.
MIN_TOKEN = 16


def is_usable_token(token: object) -> bool:
    """A string of at least 16 printable ASCII characters, no space at either end: one
    that an HTTP client can send in a header and that compares as sent."""
    return (
        isinstance(token, str)
        and len(token) >= MIN_TOKEN
        and token.isascii()
        and token.isprintable()
        and token == token.strip()
    )
