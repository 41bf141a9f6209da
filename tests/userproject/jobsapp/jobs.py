"""The user project's jobs."""

from django_pglock import current_lease, singleton_job


@singleton_job("userproject-report", record=True)
def report():
    """Return the fencing token of the lease the body runs under."""
    return current_lease().token


@singleton_job("userproject-yearly", schedule="0 0 1 1 *", record=True)
def yearly():
    """At most once per year's slot, however often it is called."""
    return "ran"
