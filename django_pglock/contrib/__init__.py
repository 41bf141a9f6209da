"""Optional integrations: :mod:`.prometheus` (``prometheus_client``) and
:mod:`.health_check` (``django-health-check``). Each needs its extra installed."""
