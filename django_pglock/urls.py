"""``path("health/", include("django_pglock.urls"))``: the health endpoint at its root,
URL name ``django_pglock:health``."""

from __future__ import annotations

from django.urls import path

from . import views

app_name = "django_pglock"

urlpatterns = [
    path("", views.health, name="health"),
]
