from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("admin/", admin.site.urls),
    # Job health for probes: 200 when every job keeps its promises, else 503.
    path("health/", include("django_pglock.urls")),
]
