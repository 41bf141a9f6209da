"""Who may see job names and details: staff, or a caller with ``HEALTH_TOKEN``.

Secure by default: without a configured token, only a logged-in staff user sees details.
The token is read from ``Authorization: Bearer <token>`` (never from the query string,
which ends up in access logs) and compared in constant time.
"""

from __future__ import annotations

import hmac

from django.http import HttpRequest

from .conf import get_setting

__all__ = ["may_see_details"]


def may_see_details(request: HttpRequest) -> bool:
    """Whether ``request`` comes from staff or carries the configured token."""
    user = getattr(request, "user", None)
    if user is not None and user.is_authenticated and user.is_active and user.is_staff:
        return True
    token = get_setting("HEALTH_TOKEN")
    if not isinstance(token, str) or len(token) < 16:
        return False  # unset, or unusable (reported by manage.py check as E015)
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
