"""Jobs of the example shop."""

from __future__ import annotations

import time

from django_pglock import singleton_job


@singleton_job(key=lambda tenant_id, **kwargs: f"training:{tenant_id}")
def advance_pipeline(tenant_id: int, seconds: float = 1.0) -> str:
    """One step of a tenant's pipeline: replicas may call it at once, one runs per tenant."""
    time.sleep(seconds)
    return f"tenant {tenant_id} advanced"
