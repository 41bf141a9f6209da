"""Django 6 tasks composed with @singleton_job (imported only where django.tasks exists)."""

from django.tasks import task

from django_pglock import singleton_job


@task
@singleton_job("task-job")
def task_job(path: str) -> str:
    with open(path, "a") as log:
        log.write("RAN\n")
    return "ran"
