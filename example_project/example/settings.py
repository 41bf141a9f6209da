"""Settings of the django_pglock example project (not for production)."""

from pathlib import Path

from example.database import default_database

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "example-project-not-secret"
DEBUG = True
ALLOWED_HOSTS = ["localhost", "127.0.0.1"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_pglock",
    "shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "example.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
DATABASES = {"default": default_database()}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Shorter thresholds than the defaults, so the demo shows alerts and reclaims quickly.
DJANGO_PGLOCK = {
    "HEARTBEAT_INTERVAL": 2.0,
    "ALERT_AFTER": 6.0,
    "STALE_AFTER": 60.0,
    # Job health: what each job promises. "export-orders" must succeed every few seconds,
    # so that the demo can show it overdue; a real one would say "every": "15m".
    "JOBS": {
        "nightly_report": {"max_duration": "1m"},
        "export-orders": {"every": "3s", "grace": "1s"},
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"django_pglock": {"handlers": ["console"], "level": "INFO"}},
}
