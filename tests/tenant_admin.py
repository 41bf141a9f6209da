"""A second admin site whose holders page lists one tenant's locks only.

The URLconf of the tests of the forced release's queryset (tests/test_admin.py): an admin
subclass that narrows ``get_queryset`` must narrow what its users can release, whatever
a crafted POST names.
"""

from __future__ import annotations

from django.contrib import admin
from django.urls import path

from django_pglock.admin import JobLockAdmin
from django_pglock.models import JobLock

TENANT_PREFIX = "tenant-a-"


class TenantJobLockAdmin(JobLockAdmin):
    """The holders page of tenant A: locks whose name starts with ``tenant-a-``."""

    def get_queryset(self, request):
        return super().get_queryset(request).filter(name__startswith=TENANT_PREFIX)


site = admin.AdminSite(name="tenant_admin")
site.register(JobLock, TenantJobLockAdmin)

urlpatterns = [
    path("admin/", admin.site.urls),
    path("tenant-admin/", site.urls),
]
