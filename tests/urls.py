from django.contrib import admin
from django.urls import include, path

from django_pglock.contrib.prometheus import metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("health/", include("django_pglock.urls")),
    path("metrics/", metrics_view, name="metrics"),
]

try:  # django-health-check 4 (Django 5.2+): its view takes the checks
    from health_check.base import HealthCheck  # noqa: F401
    from health_check.views import HealthCheckView

    urlpatterns.append(
        path(
            "ht/",
            HealthCheckView.as_view(checks=["django_pglock.contrib.health_check.JobHealthCheck"]),
        )
    )
except ImportError:  # django-health-check 3: tests call the backend directly
    pass
