"""Settings of a small user project with django_pglock installed and nothing configured
for its tests: run by tests/test_user_tests.py with Django's test runner and with
pytest-django.

``DATABASE_URL`` names the server; ``USERPROJECT_DB`` the database the project uses (it
must exist, with the lock tables: a lock is taken there before the test database exists)
and ``USERPROJECT_TEST_DB`` the name of the test database.
"""

import os

from psycopg.conninfo import conninfo_to_dict

_server = conninfo_to_dict(os.environ["DATABASE_URL"])

SECRET_KEY = "userproject-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_pglock",
    "jobsapp",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["USERPROJECT_DB"],
        "USER": _server.get("user", ""),
        "PASSWORD": _server.get("password", ""),
        "HOST": _server.get("host", ""),
        "PORT": _server.get("port", ""),
        "TEST": {"NAME": os.environ["USERPROJECT_TEST_DB"]},
    }
}
