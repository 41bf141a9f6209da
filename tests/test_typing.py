"""``@singleton_job``'s types, as mypy sees them: ``R | None`` where a call may be skipped,
``R`` where every call runs the body (tests/typing_sample.py holds the expectations)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SAMPLE = Path(__file__).with_name("typing_sample.py")
ROOT = SAMPLE.parent.parent
CONFIG = "[mypy]\nstrict = True\nfollow_imports = silent\nshow_error_codes = True\n"


def normalize(text: str) -> str:
    """One spelling of a type across mypy versions: ``Union[builtins.int, None]`` and
    ``builtins.int | None`` both become ``int | None``."""
    text = text.replace("builtins.", "")
    return re.sub(r"Union\[([^\[\],]+), None\]", r"\1 | None", text)


def expected() -> set[tuple[int, str, str]]:
    found = set()
    for number, line in enumerate(SAMPLE.read_text().splitlines(), start=1):
        match = re.search(r"#\s*([EN]):\s*(.+)$", line)
        if match:
            found.add((number, match.group(1), match.group(2).strip()))
    return found


def reported(output: str) -> set[tuple[int, str, str]]:
    found = set()
    for line in output.splitlines():
        match = re.match(r".*typing_sample\.py:(\d+): (error|note): (.*)$", line)
        if not match:
            continue
        number, kind, message = int(match.group(1)), match.group(2), match.group(3)
        if kind == "error":
            code = re.search(r"\[([a-z-]+)\]\s*$", message)
            found.add((number, "E", code.group(1) if code else message))
        else:
            found.add((number, "N", normalize(message)))
    return found


def test_the_decorated_type_says_when_a_call_may_return_none(tmp_path):
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG)
    result = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--config-file", str(config),
            "--cache-dir", str(tmp_path / "cache"), str(SAMPLE.relative_to(ROOT)),
        ],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert "typing_sample.py" in result.stdout, (result.stdout, result.stderr)
    want = expected()
    assert len(want) == 14  # the sample's expectations were all read
    assert reported(result.stdout) == want, result.stdout
