"""Drop the "_like" pattern index Django adds for the CharField primary key.

The lock statements only look names up by equality, and every index on the lock table
is paid on every acquire, so the primary key stays the table's one index. This is its
own migration because Django creates that index at the very end of the migration that
creates the table.
"""

from django_pglock.migrations._postgres import RunSQLOnPostgres

DROP_LIKE_INDEX = """
DO $$
DECLARE
    idx record;
BEGIN
    FOR idx IN
        SELECT i.indexname FROM pg_indexes i
        WHERE i.schemaname = current_schema()
          AND i.tablename = 'django_pglock_joblock'
          AND i.indexdef LIKE '%varchar_pattern_ops%'
    LOOP
        EXECUTE format('DROP INDEX %I', idx.indexname);
    END LOOP;
END
$$
"""


from django.db import migrations  # noqa: E402


class Migration(migrations.Migration):
    dependencies = [("django_pglock", "0001_initial")]

    operations = [
        RunSQLOnPostgres(
            sql=DROP_LIKE_INDEX,
            reverse_sql=(
                "CREATE INDEX django_pglock_joblock_name_like "
                "ON django_pglock_joblock (name varchar_pattern_ops)"
            ),
        ),
    ]
