"""The admin (holders page, forced release, run history) and the run history itself.

Everything goes through the Django test client against the real PostgreSQL server, with
locks held by real leases of this process. The lock engine writes on its own dedicated
connection, so every test here runs with ``transaction=True``: its rows are committed
and visible to the admin's queries on Django's connection.
"""

from __future__ import annotations

import io
import uuid
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission, User
from django.contrib.messages import constants as message_levels
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import override_settings
from django.urls import reverse
from django.utils import timezone

from django_pglock import Lock, LockNotHeld, signals
from django_pglock.models import JobLock, JobRun, ScheduleClaim
from tests.adminforms import confirmation_form
from tests.subprocs import Received, open_db
from tests.testapp import jobs

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("clean_locks")]

# Thresholds for a held lock whose row a test ages by SQL: the holder never heartbeats
# during the test, so the aged row keeps the age the test gave it.
QUIET = {"heartbeat_interval": 100.0, "alert_after": 200.0, "stale_after": 3000.0}
ALERT_AGE = 300.0  # between alert_after and stale_after
STALE_AGE = 4000.0  # beyond stale_after

HOLDERS = reverse("admin:django_pglock_joblock_changelist")
RUNS = reverse("admin:django_pglock_jobrun_changelist")
ACTION = "force_release"


@pytest.fixture
def sql_db(pg_url, test_db_name):
    """A separate autocommit session on the test database (another process's view)."""
    with open_db(pg_url, test_db_name) as conn:
        yield conn


@pytest.fixture
def no_runs(sql_db):
    """Start from an empty run history (child processes of other tests may leave rows)."""
    sql_db.execute("DELETE FROM django_pglock_jobrun")
    sql_db.execute("DELETE FROM django_pglock_scheduleclaim")


def unique(label):
    return f"adm-{label}-{uuid.uuid4().hex[:8]}"


def hold(name, **options):
    lease = Lock(name, **{**QUIET, **options}).try_acquire()
    assert lease is not None, f"could not take {name!r}"
    return lease


def age_row(sql_db, name, seconds):
    """Pretend the holder of ``name`` last heartbeat ``seconds`` ago (database clock)."""
    updated = sql_db.execute(
        "UPDATE django_pglock_joblock SET last_heartbeat = now() - %s * interval '1 second'"
        " WHERE name = %s",
        [seconds, name],
    ).rowcount
    assert updated == 1


def staff_user(*codenames, username=None):
    user = User.objects.create_user(
        username=username or unique("user"), password="pw-not-secret", is_staff=True
    )
    for codename in codenames:
        user.user_permissions.add(
            Permission.objects.get(content_type__app_label="django_pglock", codename=codename)
        )
    return user


def shown_names(response):
    return {obj.pk for obj in response.context["cl"].result_list}


def action_choices(response):
    form = response.context["action_form"]
    if form is None:  # no action at all is available to this user
        return []
    return [value for value, _label in form.fields["action"].choices if value]


def messages_of(response):
    return [(message.level, message.message) for message in response.context["messages"]]


def ask_to_release(client, *names, holders=HOLDERS):
    """Select ``names`` on the holders page and choose the action (first step)."""
    return client.post(holders, {"action": ACTION, "_selected_action": list(names), "index": "0"})


# -- holders page ----------------------------------------------------------------------------


def test_holders_page_shows_each_lock_with_its_state(admin_client, sql_db):
    ok, alert, stale = unique("ok"), unique("alert"), unique("stale")
    leases = [hold(ok), hold(alert), hold(stale)]
    age_row(sql_db, alert, ALERT_AGE)
    age_row(sql_db, stale, STALE_AGE)

    response = admin_client.get(HOLDERS)
    assert response.status_code == 200
    states = {obj.pk: obj.state for obj in response.context["cl"].result_list}
    assert states == {ok: "ok", alert: "alert", stale: "stale"}
    html = response.content.decode()
    rows = {name: row for row in html.split("<tr")[1:] for name in states if name in row}
    for name, state in states.items():
        assert f">{state}</span>" in rows[name], rows[name]
    lease = leases[0]
    assert f"{lease.token}" in rows[ok]
    assert f"{JobLock.objects.get(pk=ok).host}:{JobLock.objects.get(pk=ok).pid}" in rows[ok]
    for lease in leases:
        lease.release()


def test_state_filter_and_search(admin_client, sql_db):
    ok, alert, stale = unique("ok"), unique("alert"), unique("stale")
    for name in (ok, alert, stale):
        hold(name)
    age_row(sql_db, alert, ALERT_AGE)
    age_row(sql_db, stale, STALE_AGE)
    # Another host's holder, as far as the page can tell.
    sql_db.execute(
        "UPDATE django_pglock_joblock SET host = 'worker-7.example' WHERE name = %s", [stale]
    )

    assert shown_names(admin_client.get(HOLDERS, {"state": "ok"})) == {ok}
    assert shown_names(admin_client.get(HOLDERS, {"state": "alert"})) == {alert}
    assert shown_names(admin_client.get(HOLDERS, {"state": "stale"})) == {stale}
    assert shown_names(admin_client.get(HOLDERS)) == {ok, alert, stale}
    assert shown_names(admin_client.get(HOLDERS, {"q": alert})) == {alert}
    assert shown_names(admin_client.get(HOLDERS, {"q": "worker-7"})) == {stale}
    assert shown_names(admin_client.get(HOLDERS, {"q": "no-such-lock"})) == set()


def test_holders_cannot_be_added_or_edited(admin_client):
    name = unique("ro")
    lease = hold(name)
    changelist = admin_client.get(HOLDERS)
    assert changelist.context["has_add_permission"] is False
    assert reverse("admin:django_pglock_joblock_add") not in changelist.content.decode()
    assert admin_client.get(reverse("admin:django_pglock_joblock_add")).status_code == 403

    change_url = reverse("admin:django_pglock_joblock_change", args=[quote(name)])
    page = admin_client.get(change_url)
    assert page.status_code == 200
    assert page.context["has_change_permission"] is False
    assert 'name="_save"' not in page.content.decode()
    assert str(lease.token) in page.content.decode()
    posted = admin_client.post(change_url, {"name": "x", "token": "1", "holder": "me"})
    assert posted.status_code == 403
    assert JobLock.objects.get(pk=name).token == lease.token
    # No delete either: releasing goes through the force-release action only.
    assert "delete_selected" not in action_choices(changelist)
    delete_url = reverse("admin:django_pglock_joblock_delete", args=[quote(name)])
    assert admin_client.post(delete_url, {"post": "yes"}).status_code == 403
    lease.check()


# -- forced release ----------------------------------------------------------------------


def test_action_is_hidden_and_refused_without_the_permission(client):
    name = unique("noperm")
    lease = hold(name)
    client.force_login(staff_user("view_joblock"))

    changelist = client.get(HOLDERS)
    assert changelist.status_code == 200
    assert shown_names(changelist) == {name}
    assert ACTION not in action_choices(changelist)

    with Received(signals.lock_force_released) as released:
        # Both steps forged: the first (confirmation) and the final one.
        first = ask_to_release(client, name)
        forged = client.post(
            HOLDERS,
            {
                "action": ACTION,
                "_selected_action": [name],
                "lock_name": [name],
                "lock_token": [str(lease.token)],
                "post": "yes",
            },
            follow=True,
        )
    for response in (first, forged):
        assert response.status_code in (200, 302)
        assert b"Force release: are you sure?" not in response.content
    assert released.calls == []
    assert JobLock.objects.get(pk=name).token == lease.token
    assert not LogEntry.objects.exists()
    lease.check()
    lease.release()


def test_the_action_is_offered_to_a_permitted_user(client):
    hold(unique("perm"))
    client.force_login(staff_user("view_joblock", "force_release_joblock"))
    assert ACTION in action_choices(client.get(HOLDERS))


def test_forced_release_confirms_then_releases_logs_and_the_holder_loses(client):
    name, other = unique("victim"), unique("bystander")
    lease, bystander = hold(name), hold(other)
    user = staff_user("view_joblock", "force_release_joblock")
    client.force_login(user)
    row = JobLock.objects.get(pk=name)

    confirm = ask_to_release(client, name)
    assert confirm.status_code == 200
    assert "admin/django_pglock/joblock/force_release_confirmation.html" in [
        t.name for t in confirm.templates
    ]
    page = confirm.content.decode()
    for shown in (name, f"{row.host}:{row.pid}", row.holder, str(lease.token)):
        assert shown in page
    assert other not in page
    # Nothing happened yet.
    assert JobLock.objects.get(pk=name).token == lease.token
    lease.check()

    form = confirmation_form(confirm)
    assert form["post"] == ["yes"]
    assert form["lock_token"] == [str(lease.token)]
    with Received(signals.lock_force_released) as released:
        done = client.post(HOLDERS, form, follow=True)
    assert done.status_code == 200
    assert done.redirect_chain and done.redirect_chain[-1][0].endswith(HOLDERS)

    assert not JobLock.objects.filter(pk=name).exists()
    assert JobLock.objects.get(pk=other).token == bystander.token  # only the selected one
    assert len(released.calls) == 1
    call = released.calls[0]
    assert call["name"] == name
    assert call["token"] == lease.token
    assert call["holder"]["holder"] == lease.holder

    entry = LogEntry.objects.get()
    assert entry.user_id == user.pk
    assert entry.object_id == name
    assert entry.is_change()
    for part in (name, lease.holder, f"{row.host}:{row.pid}", str(lease.token)):
        assert part in entry.change_message, entry.change_message

    successes = [text for level, text in messages_of(done) if level == message_levels.SUCCESS]
    assert len(successes) == 1 and name in successes[0] and str(lease.token) in successes[0]
    assert name not in {obj.pk for obj in done.context["cl"].result_list}

    with pytest.raises(LockNotHeld):
        lease.check()
    assert lease.lost
    bystander.check()
    bystander.release()


def test_confirming_after_the_lock_changed_hands_releases_nothing(client):
    name = unique("race")
    first = hold(name)
    client.force_login(staff_user("view_joblock", "force_release_joblock"))
    confirm = ask_to_release(client, name)
    assert str(first.token) in confirm.content.decode()
    form = confirmation_form(confirm)

    # Meanwhile the job ends and starts again: a new grant with a new token.
    first.release()
    second = hold(name)
    assert second.token > first.token

    with Received(signals.lock_force_released) as released:
        done = client.post(HOLDERS, form, follow=True)
    assert done.status_code == 200
    assert JobLock.objects.get(pk=name).token == second.token
    assert released.calls == []
    assert not LogEntry.objects.exists()
    warnings = [text for level, text in messages_of(done) if level == message_levels.WARNING]
    assert len(warnings) == 1, messages_of(done)
    assert "changed hands" in warnings[0] and name in warnings[0]
    assert not [level for level, _ in messages_of(done) if level == message_levels.SUCCESS]
    second.check()
    second.release()


@pytest.mark.urls("tests.tenant_admin")
def test_forced_release_releases_only_rows_of_the_actions_queryset(client):
    """An admin that lists one tenant's locks: crafted POSTs cannot release another's."""
    from tests.tenant_admin import TENANT_PREFIX

    mine = hold(f"{TENANT_PREFIX}{unique('mine')}")
    theirs = hold(unique("tenant-b"))
    user = staff_user("view_joblock", "force_release_joblock")
    client.force_login(user)
    holders = reverse("tenant_admin:django_pglock_joblock_changelist")
    assert shown_names(client.get(holders)) == {mine.name}

    theirs_named = {"lock_name": [theirs.name], "lock_token": [str(theirs.token)]}
    forged = {
        # The other tenant's lock, selected and named, as the confirmation form would.
        "selected": {"_selected_action": [theirs.name], **theirs_named},
        # "Select all" of this page, and the other tenant's lock named.
        "across": {"select_across": "1", "_selected_action": [mine.name], **theirs_named},
        # Its own lock selected, the other tenant's named.
        "mixed": {"_selected_action": [mine.name], **theirs_named},
    }
    with Received(signals.lock_force_released) as released:
        for label, data in forged.items():
            response = client.post(holders, {"action": ACTION, "post": "yes", **data}, follow=True)
            assert response.status_code == 200, label
            assert not [m for m in messages_of(response) if m[0] == message_levels.SUCCESS], label
    assert released.calls == []
    assert JobLock.objects.get(pk=theirs.name).token == theirs.token
    assert not LogEntry.objects.exists()
    theirs.check()

    # The tenant's own lock still goes, through its confirmation page.
    confirm = ask_to_release(client, mine.name, holders=holders)
    with Received(signals.lock_force_released) as released:
        client.post(holders, confirmation_form(confirm))
    assert [call["name"] for call in released.calls] == [mine.name]
    with pytest.raises(LockNotHeld):
        mine.check()
    theirs.check()
    theirs.release()


def test_a_selection_or_object_id_with_a_nul_byte_changes_nothing(admin_client):
    name = unique("nul")
    lease = hold(name)
    with Received(signals.lock_force_released) as released:
        response = admin_client.post(
            HOLDERS,
            {"action": ACTION, "post": "yes", "_selected_action": [f"{name}\x00"]},
            follow=True,
        )
    assert response.status_code == 200
    warnings = [text for level, text in messages_of(response) if level == message_levels.WARNING]
    assert len(warnings) == 1 and "NUL" in warnings[0], messages_of(response)
    assert released.calls == []
    change = reverse("admin:django_pglock_joblock_change", args=[quote(f"{name}\x00")])
    assert admin_client.get(change).status_code == 302  # "does not exist", back to the index
    lease.check()
    lease.release()


# -- run history ----------------------------------------------------------------------------


def runs(name=None):
    queryset = JobRun.objects.order_by("started_at", "pk")
    if name is not None:
        queryset = queryset.filter(name=name)
    return list(queryset)


@pytest.mark.usefixtures("no_runs")
def test_recorded_job_succeeds_fails_and_is_skipped():
    assert jobs.recorded_job(seconds=0.05) == "recorded"
    with pytest.raises(RuntimeError, match="on purpose"):
        jobs.recorded_job(fail=True)
    lease = hold("recorded-job")  # held elsewhere: the next call is skipped
    try:
        assert jobs.recorded_job() is None
    finally:
        lease.release()

    succeeded, failed, skipped = runs("recorded-job")
    assert succeeded.outcome == JobRun.Outcome.SUCCEEDED
    assert succeeded.finished_at is not None and succeeded.finished_at > succeeded.started_at
    assert succeeded.duration is not None and succeeded.duration >= 0.05
    assert succeeded.token is not None and succeeded.exit_code is None
    assert failed.outcome == JobRun.Outcome.FAILED
    assert failed.finished_at is not None and failed.duration > 0
    assert failed.token > succeeded.token
    assert skipped.outcome == JobRun.Outcome.SKIPPED
    assert skipped.reason == JobRun.Reason.HELD
    assert succeeded.reason is None and failed.reason is None
    assert skipped.token is None and skipped.finished_at is not None
    assert {run.holder for run in (succeeded, failed, skipped)} == {lease.holder}
    assert not JobLock.objects.filter(pk="recorded-job").exists()


@pytest.mark.usefixtures("no_runs")
def test_recorded_job_whose_lock_is_force_released_mid_run_is_lost():
    with pytest.raises(LockNotHeld, match="recorded-lost"):
        jobs.recorded_lost_job()
    (run,) = runs("recorded-lost")
    assert run.outcome == JobRun.Outcome.LOST
    assert run.finished_at is not None and run.duration is not None


@pytest.mark.usefixtures("no_runs")
def test_runs_follow_the_record_runs_setting():
    jobs.settings_recorded_job()
    assert [run.outcome for run in runs()] == [JobRun.Outcome.SUCCEEDED]  # default: on
    JobRun.objects.all().delete()
    with override_settings(DJANGO_PGLOCK={"RECORD_RUNS": False}):
        assert jobs.settings_recorded_job() == "ran"
        assert runs() == []
        lease = hold("settings-recorded-job")
        try:
            assert jobs.settings_recorded_job() is None  # skipped, and not recorded either
        finally:
            lease.release()
        assert runs() == []
        jobs.recorded_job()  # record=True on the decorator wins over the setting
        assert [run.name for run in runs()] == ["recorded-job"]


@pytest.mark.usefixtures("no_runs")
def test_a_plain_lock_records_nothing_by_default():
    name = unique("plain")
    with Lock(name).acquire(blocking=False) as lease:
        assert lease is not None
    other = hold(name)
    with Lock(name).acquire(blocking=False) as refused:
        assert refused is None
    other.release()
    assert runs() == []
    with Lock(name, record=True).acquire(blocking=False) as lease:
        assert lease is not None
    assert [(run.name, run.outcome) for run in runs()] == [(name, JobRun.Outcome.SUCCEEDED)]


@pytest.mark.usefixtures("no_runs")
def test_locked_run_records_the_exit_code(procs):
    result = procs.run_django("locked_run", "exit_with", "3")
    assert result.returncode == 3, result.stderr
    (run,) = runs("exit_with")
    assert run.outcome == JobRun.Outcome.FAILED
    assert run.exit_code == 3
    assert run.finished_at is not None and run.token is not None

    result = procs.run_django("locked_run", "exit_with", "0")
    assert result.returncode == 0, result.stderr
    assert [(r.outcome, r.exit_code) for r in runs("exit_with")] == [
        (JobRun.Outcome.FAILED, 3),
        (JobRun.Outcome.SUCCEEDED, 0),
    ]

    result = procs.run_django("locked_run", "--no-record", "exit_with", "4")
    assert result.returncode == 4, result.stderr
    assert len(runs("exit_with")) == 2


@pytest.mark.usefixtures("no_runs")
def test_run_history_admin_lists_filters_and_shows_the_last_success(admin_client, sql_db):
    jobs.recorded_job()
    jobs.recorded_job()
    with pytest.raises(RuntimeError):
        jobs.recorded_job(fail=True)
    jobs.settings_recorded_job()
    lease = hold("settings-recorded-job")
    jobs.settings_recorded_job()  # skipped
    lease.release()
    # Spread the runs out in time, oldest first, so that "latest" is unambiguous.
    all_runs = runs()
    for age, run in zip(range(len(all_runs), 0, -1), all_runs, strict=True):
        sql_db.execute(
            "UPDATE django_pglock_jobrun SET started_at = now() - %s * interval '1 minute',"
            " finished_at = now() - %s * interval '1 minute' + interval '1 second'"
            " WHERE id = %s",
            [age, age, run.pk],
        )
    first_a, second_a, failed_a, success_b, skipped_b = all_runs

    page = admin_client.get(RUNS)
    assert page.status_code == 200
    assert shown_names(page) == {run.pk for run in all_runs}
    html = page.content.decode()
    for outcome in ("succeeded", "failed", "skipped"):
        assert f">{outcome}</span>" in html

    assert shown_names(admin_client.get(RUNS, {"outcome": "failed"})) == {failed_a.pk}
    assert shown_names(admin_client.get(RUNS, {"outcome": "skipped"})) == {skipped_b.pk}
    assert shown_names(admin_client.get(RUNS, {"name": "recorded-job"})) == {
        first_a.pk,
        second_a.pk,
        failed_a.pk,
    }
    assert shown_names(admin_client.get(RUNS, {"show": "last-success"})) == {
        second_a.pk,
        success_b.pk,
    }
    assert shown_names(
        admin_client.get(RUNS, {"show": "last-success", "name": "recorded-job"})
    ) == {second_a.pk}
    assert admin_client.get(reverse("admin:django_pglock_jobrun_add")).status_code == 403


@pytest.mark.usefixtures("no_runs")
@pytest.mark.parametrize(
    ("page", "params"),
    [
        pytest.param(HOLDERS, {"state": "x\x00"}, id="state-nul"),
        pytest.param(HOLDERS, {"state": "dead"}, id="state-unknown"),
        pytest.param(HOLDERS, {"q": "x\x00"}, id="locks-search-nul"),
        pytest.param(HOLDERS, {"name": "x\x00"}, id="locks-name-nul"),
        pytest.param(HOLDERS, {"host__startswith": "x\x00"}, id="locks-lookup-nul"),
        pytest.param(HOLDERS, {"x\x00": "1"}, id="locks-key-nul"),
        pytest.param(RUNS, {"name": "x\x00"}, id="name-nul"),
        pytest.param(RUNS, {"name": "x" * 300}, id="name-too-long"),
        pytest.param(RUNS, {"outcome": "x\x00"}, id="outcome-nul"),
        pytest.param(RUNS, {"outcome": "exploded"}, id="outcome-unknown"),
        pytest.param(RUNS, {"outcome__exact": "x\x00"}, id="outcome-exact-nul"),
        pytest.param(RUNS, {"reason": "x\x00"}, id="reason-nul"),
        pytest.param(RUNS, {"reason": "bored"}, id="reason-unknown"),
        pytest.param(RUNS, {"show": "x\x00"}, id="show-nul"),
        pytest.param(RUNS, {"q": "x\x00"}, id="runs-search-nul"),
        pytest.param(RUNS, {"started_at__year": "2\x00"}, id="date-nul"),
    ],
)
def test_an_invalid_filter_value_is_ignored(admin_client, page, params):
    lease = hold(unique("listed"))
    jobs.recorded_job()
    with pytest.raises(RuntimeError):
        jobs.recorded_job(fail=True)
    everything = shown_names(admin_client.get(page))
    assert len(everything) == (1 if page == HOLDERS else 2)

    response = admin_client.get(page, params)
    assert response.status_code == 200
    assert shown_names(response) == everything
    cl = response.context["cl"]
    for spec in cl.filter_specs:
        if hasattr(spec, "value"):
            assert spec.value() is None, spec.title  # "All" is what is selected
    lease.release()


@pytest.mark.usefixtures("no_runs")
def test_the_run_history_does_not_list_every_job_name(admin_client, sql_db):
    names = [f"tenant-job-{number:04d}" for number in range(300)]
    sql_db.execute(
        "INSERT INTO django_pglock_jobrun"
        " (name, holder, host, pid, description, started_at, finished_at, duration, outcome)"
        " SELECT name, 'h', 'host', 1, '', now(), now(), 0, 'succeeded'"
        " FROM unnest(%s::text[]) AS name",
        [names],
    )
    page = admin_client.get(RUNS)
    assert page.status_code == 200
    html = page.content.decode()
    assert "name=tenant-job-" not in html  # no link per job name
    assert page.context["cl"].result_count == len(names)
    assert all(len(spec.lookup_choices) <= 6 for spec in page.context["cl"].filter_specs)

    # One job's runs: through ?name= (shown as the selected choice) or the search box.
    wanted = JobRun.objects.get(name=names[7]).pk
    filtered = admin_client.get(RUNS, {"name": names[7]})
    assert shown_names(filtered) == {wanted}
    (spec,) = [s for s in filtered.context["cl"].filter_specs if s.parameter_name == "name"]
    assert spec.lookup_choices == [(names[7], names[7])] and spec.value() == names[7]
    assert shown_names(admin_client.get(RUNS, {"q": names[7]})) == {wanted}


# -- pglock_prune ---------------------------------------------------------------------------


@pytest.mark.usefixtures("no_runs")
def test_prune_deletes_old_runs_and_claims_and_keeps_recent_ones(sql_db):
    for _ in range(3):
        jobs.recorded_job()
    old_1, old_2, recent = runs()
    running = hold(unique("running"), record=True)  # a run still going on
    now = timezone.now()
    # Two slots of one job: the older claim goes, the latest is kept (see
    # tests/test_schedule_runs.py for the latest claim of a job, kept whatever its age).
    old_claim = ScheduleClaim.objects.create(
        name="claimed-job", slot=now - timedelta(days=2), holder="h", claimed_at=now
    )
    new_claim = ScheduleClaim.objects.create(
        name="claimed-job", slot=now, holder="h", claimed_at=now
    )
    sql_db.execute(
        "UPDATE django_pglock_jobrun SET started_at = now() - interval '2 hours',"
        " finished_at = now() - interval '2 hours' + interval '1 second' WHERE id = ANY(%s)",
        [[old_1.pk, old_2.pk]],
    )
    sql_db.execute(
        "UPDATE django_pglock_scheduleclaim SET claimed_at = now() - interval '2 days'"
        " WHERE id = %s",
        [old_claim.pk],
    )
    # The recent run and claim "just" happened, by the database clock.
    sql_db.execute("UPDATE django_pglock_jobrun SET finished_at = now() WHERE id = %s", [recent.pk])
    sql_db.execute(
        "UPDATE django_pglock_scheduleclaim SET claimed_at = now() WHERE id = %s", [new_claim.pk]
    )

    out = io.StringIO()
    call_command("pglock_prune", "--older-than", "1s", stdout=out)
    assert "Deleted 2 run(s) and 1 schedule claim(s)" in out.getvalue()
    remaining = {run.pk for run in runs()}
    assert recent.pk in remaining and old_1.pk not in remaining and old_2.pk not in remaining
    assert len(remaining) == 2  # plus the running one
    assert list(ScheduleClaim.objects.values_list("pk", flat=True)) == [new_claim.pk]
    running.release()


@pytest.mark.parametrize("bad", ["soon", "0s", "-5m", "3 parsecs", ""])
def test_prune_refuses_a_bad_age_and_names_it(bad, no_runs):
    jobs.recorded_job()
    with pytest.raises(CommandError) as raised:
        call_command("pglock_prune", f"--older-than={bad}")
    assert raised.value.returncode == 2
    assert repr(bad) in str(raised.value)
    assert len(runs()) == 1


def test_prune_exits_2_on_a_bad_age_from_the_command_line(procs):
    result = procs.run_django("pglock_prune", "--older-than", "soon")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "'soon'" in result.stderr
    assert "Traceback" not in result.stderr


# -- regressions found by these tests ------------------------------------------------------

DIE_HOLDING = """
import os, signal, sys
import django
django.setup()
from django_pglock import Lock
lease = Lock(sys.argv[1], record=True).try_acquire()
assert lease is not None
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.usefixtures("no_runs")
def test_prune_keeps_the_row_of_a_run_still_in_progress(sql_db):
    name = unique("long-job")
    lease = hold(name, record=True)  # a job running for hours
    sql_db.execute("UPDATE django_pglock_jobrun SET started_at = now() - interval '3 hours'")
    call_command("pglock_prune", "--older-than", "1h", stdout=io.StringIO())
    lease.release()
    assert [(run.name, run.outcome) for run in runs()] == [(name, JobRun.Outcome.SUCCEEDED)]


@pytest.mark.parametrize("how", ["takeover", "force-release"])
@pytest.mark.usefixtures("no_runs")
def test_the_run_of_a_holder_that_died_does_not_stay_running(procs, how):
    name = unique("crash")
    died = procs.finish(procs.python(DIE_HOLDING, name))
    assert died.returncode == -9, died.stderr
    (run,) = runs(name)
    assert run.outcome == JobRun.Outcome.RUNNING  # nobody can know yet
    if how == "takeover":
        successor = Lock(name).try_acquire()  # crash-fast: its session ended
        assert successor is not None
        successor.release()
    else:
        from django_pglock.operations import force_release

        assert force_release(name, token=run.token) is not None
    run.refresh_from_db()
    assert run.outcome != JobRun.Outcome.RUNNING
    assert run.finished_at is not None


def test_log_entry_of_a_forced_release_names_the_holder(client):
    name = unique("logged")
    lease = hold(name)
    client.force_login(staff_user("view_joblock", "force_release_joblock"))
    client.post(HOLDERS, confirmation_form(ask_to_release(client, name)))
    entry = LogEntry.objects.get()
    assert entry.object_repr == str(JobLock(name=name, token=lease.token, holder=lease.holder))
