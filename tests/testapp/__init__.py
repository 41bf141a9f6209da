class RecordingMetrics:
    """A metrics hook for ``DJANGO_PGLOCK["METRICS"]``: records the calls it receives."""

    calls: list[tuple[str, str]] = []

    def acquired(self, name, seconds):
        self.calls.append(("acquired", name))

    def released(self, name, seconds):
        self.calls.append(("released", name))

    def contended(self, name):
        self.calls.append(("contended", name))
