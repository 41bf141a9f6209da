"""Settings for the fault-injection workers: tests.settings plus overrides from the environment.

``PGLOCK_FAULT_SETTINGS`` (JSON) becomes ``DJANGO_PGLOCK``; ``PGLOCK_FAULT_NO_SSC=1`` sets
``DISABLE_SERVER_SIDE_CURSORS`` on the default alias (what Django advises behind a
transaction-mode pooler); ``PGLOCK_FAULT_NO_PREPARE=1`` sets ``OPTIONS["prepare_threshold"]
= None`` (no server-side prepared statements). ``DATABASE_URL`` names the server, as for
tests.settings.
"""

from __future__ import annotations

import json
import os

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

_overrides = os.environ.get("PGLOCK_FAULT_SETTINGS")
if _overrides:
    DJANGO_PGLOCK = json.loads(_overrides)

if os.environ.get("PGLOCK_FAULT_NO_SSC") == "1":
    DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = True

if os.environ.get("PGLOCK_FAULT_NO_PREPARE") == "1":
    DATABASES["default"]["OPTIONS"]["prepare_threshold"] = None
