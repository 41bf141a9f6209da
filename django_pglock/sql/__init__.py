"""Every statement the lock engine sends, named and parameterised.

All statements run on the dedicated autocommit connection (see :mod:`.connection`),
except :data:`GUARD`, which runs inside the caller's own transaction. Time is always
the database's ``now()``; values are always parameters. Row locks are chosen so that
a guard (``FOR KEY SHARE``) lets heartbeats (``FOR NO KEY UPDATE``) through while it
holds off reclaims (``FOR UPDATE``) and deletes.

The statements live in :mod:`.acquire`, :mod:`.holder` (the holder's own),
:mod:`.operator` (forced release, run history, pruning, schedules), :mod:`.status`
(state and abandoned grants), :mod:`.semaphore` (a semaphore's acquire), :mod:`.health`
(job health), :mod:`.history` (the admin's recent runs per job) and :mod:`.isolation`
(what tests leave); this package exports them all.
"""

from __future__ import annotations

from .acquire import *  # noqa: F403
from .health import *  # noqa: F403
from .history import *  # noqa: F403
from .holder import *  # noqa: F403
from .isolation import *  # noqa: F403
from .names import CHANNEL as CHANNEL
from .names import LISTEN as LISTEN
from .names import SEQUENCE as SEQUENCE
from .names import SLOT_SEPARATOR as SLOT_SEPARATOR
from .names import TABLE as TABLE
from .names import UNLISTEN as UNLISTEN
from .names import advisory_key as advisory_key
from .names import base_name_sql as base_name_sql
from .names import quote_name as quote_name
from .names import slot_of as slot_of
from .names import slot_row as slot_row
from .names import wake_key as wake_key
from .operator import *  # noqa: F403
from .semaphore import *  # noqa: F403
from .status import *  # noqa: F403
