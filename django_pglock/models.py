"""The lock table: one row per held lock name."""

from __future__ import annotations

from django.db import models

from .runs import SkipReason
from .sql.names import slot_of

__all__ = ["JobLock"]


class JobLock(models.Model):
    """A held lock. The row is the source of truth; its absence means the lock is free.

    Rows are written only by the lock engine's statements (see :mod:`django_pglock.sql`);
    treat this model as read-only. Staleness is judged by the database clock against the
    thresholds the holder declared on its own row.
    """

    name = models.CharField(max_length=255, primary_key=True)
    token = models.BigIntegerField(help_text="Fencing token: strictly increasing per grant.")
    holder = models.CharField(max_length=255, help_text="Identifier of the holding process.")
    host = models.CharField(max_length=255)
    pid = models.IntegerField(help_text="Process id of the holder on its host.")
    backend_pid = models.IntegerField(help_text="Server process id of the holder's session.")
    description = models.TextField(blank=True, help_text="What runs under the lock.")
    acquired_at = models.DateTimeField()
    last_heartbeat = models.DateTimeField()
    heartbeat_interval = models.FloatField(help_text="Seconds between the holder's heartbeats.")
    alert_after = models.FloatField(help_text="Seconds without heartbeat before alert.")
    stale_after = models.FloatField(help_text="Seconds without heartbeat before reclaim.")
    advisory = models.BooleanField(
        help_text="The holder also holds a session advisory lock (crash-fast takeover)."
    )
    slot_limit = models.IntegerField(
        default=1,
        help_text="How many holders the holder's lock admits at once (1: a plain lock); "
        "a semaphore's slots above the first have rows named after it (see slot).",
    )

    class Meta:
        db_table = "django_pglock_joblock"
        verbose_name = "job lock"
        verbose_name_plural = "job locks"
        ordering = ["-acquired_at"]
        permissions = [("force_release_joblock", "Can force-release job locks")]

    def __str__(self) -> str:
        name, slot = self.lock_name_and_slot
        where = f"slot {slot} of {self.slot_limit}, " if self.slot_limit > 1 or slot > 1 else ""
        return f"{name} ({where}token {self.token}, held by {self.holder})"

    @property
    def label(self) -> str:
        """The lock's name, with the slot for a semaphore's holder: ``exports [slot 2]``."""
        name, slot = self.lock_name_and_slot
        return f"{name} [slot {slot}]" if self.slot_limit > 1 or slot > 1 else name

    @property
    def lock_name_and_slot(self) -> tuple[str, int]:
        """The lock's name and this row's slot (1 for a plain lock)."""
        return slot_of(self.name)


class ScheduleClaim(models.Model):
    """The start of one schedule slot of a job: at most one per (name, slot).

    Written by ``locked_run --schedule`` and ``@singleton_job(schedule=...)``, so that a
    cron tick fired on several hosts starts the job once, even when a run ends early or
    the hosts' clocks disagree (the slot is computed from the database clock).
    """

    name = models.CharField(max_length=255)
    slot = models.DateTimeField(help_text="Start of the schedule slot (database clock).")
    holder = models.CharField(max_length=255)
    claimed_at = models.DateTimeField()
    schedule = models.CharField(
        max_length=255,
        blank=True,
        default="",
        help_text="The job's cron expression, so that its next start is known to be due.",
    )

    class Meta:
        db_table = "django_pglock_scheduleclaim"
        verbose_name = "schedule claim"
        constraints = [
            models.UniqueConstraint(fields=["name", "slot"], name="django_pglock_claim_name_slot")
        ]

    def __str__(self) -> str:
        return f"{self.name} @ {self.slot.isoformat()}"


class JobRun(models.Model):
    """One run of a job under ``@singleton_job`` or ``locked_run``: the run history.

    Written by the lock engine in the same statements as acquire and release; a call that
    did not run its body is one row with outcome ``skipped`` and a ``reason`` (the lock was
    held, the schedule slot had already started, or the wait timed out). Prune old rows
    with ``manage.py pglock_prune``.
    """

    Reason = SkipReason

    class Outcome(models.TextChoices):
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"
        LOST = "lost", "lost"
        SKIPPED = "skipped", "skipped"

    name = models.CharField(max_length=255)
    token = models.BigIntegerField(null=True, blank=True, help_text="Fencing token of the run.")
    holder = models.CharField(max_length=255)
    host = models.CharField(max_length=255)
    pid = models.IntegerField()
    description = models.TextField(blank=True)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    duration = models.FloatField(null=True, blank=True, help_text="Seconds, by the database clock.")
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    exit_code = models.IntegerField(null=True, blank=True, help_text="For locked_run.")
    reason = models.CharField(
        max_length=16,
        choices=SkipReason.choices,
        null=True,
        blank=True,
        help_text="Why a skipped run did not run its body (empty for other outcomes).",
    )

    class Meta:
        db_table = "django_pglock_jobrun"
        verbose_name = "job run"
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["name", "-started_at"], name="django_pglock_run_name_idx"),
            # Job health: each job's last success and last failure without a scan.
            models.Index(
                fields=["name", "-started_at"],
                name="django_pglock_run_ok_idx",
                condition=models.Q(outcome="succeeded"),
            ),
            models.Index(
                fields=["name", "-started_at"],
                name="django_pglock_run_bad_idx",
                condition=models.Q(outcome__in=["failed", "lost"]),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.outcome} at {self.started_at.isoformat(timespec='seconds')}"


class JobEpisode(models.Model):
    """An open health episode of a job (``overdue`` or ``failing``): the first process
    that notices it inserts the row and sends the signal; the row goes when the job is
    healthy again, so each episode is announced once, whoever looks."""

    name = models.CharField(max_length=255)
    kind = models.CharField(max_length=16)
    since = models.DateTimeField()

    class Meta:
        db_table = "django_pglock_jobepisode"
        verbose_name = "job health episode"
        constraints = [
            models.UniqueConstraint(fields=["name", "kind"], name="django_pglock_episode_name_kind")
        ]

    def __str__(self) -> str:
        return f"{self.name} {self.kind} since {self.since.isoformat(timespec='seconds')}"
