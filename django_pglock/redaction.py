"""Secrets out of what is stored and shown: command lines and free text.

``redact_argv(argv)`` reads a command line word by word, as the program receives it, so
that a secret is masked whole even when it holds a space (``--password 'correct horse'``)
and an option's value is known to be the next word. ``redact(text)`` applies the same
rules to free text (a ``description=``), where a value ends at whitespace unless quoted.

Masked (each value becomes ``***``):

* options whose name says secret (password, passwd, pass, pwd, passphrase, secret,
  token, api key, private key, access key, auth, dsn, credentials, cookie, signature):
  ``--password x``, ``--password=x``, ``-token x`` (Go style), and ``NAME=x``,
  ``name: x``, ``?name=x`` / ``&name=x`` with such a name (``PGPASSWORD=x``,
  ``aws_secret_access_key=x``, ``password=x`` in a conninfo string, an ``X-Api-Key:``
  header); ``aws_secret_access_key x`` (an identifier with such a name, then its value);
* ``Authorization:`` headers (the scheme, such as ``Bearer``, is kept);
* ``scheme://user:password@host``, ``-u``/``--user user:password`` (curl; a user name
  alone is kept), ``-a x`` (redis-cli; ``-a`` followed by an option is a flag and kept),
  ``-px`` written together (MySQL; ``-p 5432``, a port, is kept).

Kept: names that only contain such a word (``--tokenizer``, ``--passes``, ``--bypass``),
negated and stdin flags (``--no-password``, ``--password-stdin``), ``PWD=``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MASK", "MAX_DESCRIPTION_LENGTH", "describe", "displayable", "redact", "redact_argv"]

MASK = "***"
#: What runs under a lock (``description=``, a command line) is cut to this many characters.
MAX_DESCRIPTION_LENGTH = 2000
# How much of a text or an argument is read: nothing beyond it could be shown, and the
# rules run in time linear in this.
_SCAN = 4 * MAX_DESCRIPTION_LENGTH

# A name is secret when one of its parts (split at - _ . and spaces) is, or ends with, one
# of these; _TRAILING ones only as the name's last part (--pass, but not --pass-through).
_ANYWHERE = frozenset({"password", "passwd", "passphrase", "secret", "token", "apikey", "dsn"})
_ANYWHERE |= {"credential", "credentials", "authorization"}
_ENDINGS = ("password", "passwd", "passphrase", "secret", "token", "apikey", "authorization")
_TRAILING = frozenset({"pass", "pwd", "pw", "auth", "cookie", "signature", "sig"})
# ... and "key" after one of these (--api-key, --private-key, --secret-access-key).
_KEY_KINDS = frozenset({"api", "private", "access", "signing", "encryption", "master", "shared"})
# find(1) predicates that start with -p: not a MySQL password.
_FIND_PREDICATES = frozenset({"-path", "-perm", "-print", "-print0", "-printf", "-prune"})

_SECRET, _SECRET_UNLESS_OPTION, _USER_PASS = "secret", "secret-unless-option", "user:pass"

_IDENTIFIER = re.compile(r"[A-Za-z][\w.]*")
# A value in free text: quoted, else up to whitespace.
_VALUE = r"""(?:'[^']*'|"[^"]*"|\S+)"""
_SCHEME = r"(?:(?:bearer|basic|token|digest|negotiate|bot)[ \t]+)?"


def _is_secret_name(name: str) -> bool:
    """Whether an option, variable or header called ``name`` holds a secret."""
    parts = [part for part in re.split(r"[-_.\s]+", name.lower()) if part]
    if not parts or parts[0] == "no" or parts[-1] == "stdin" or parts == ["pwd"]:
        return False  # --no-password, --password-stdin take no value; PWD is a directory
    if parts[-1] in _TRAILING:
        return True
    for index, part in enumerate(parts):
        if part in _ANYWHERE or part.endswith(_ENDINGS):
            return True
        if part == "key" and index and parts[index - 1] in _KEY_KINDS:
            return True
    return False


def _is_identifier(text: str) -> bool:
    """An identifier of two parts or more: ``aws_secret_access_key``, ``db.password``."""
    return _IDENTIFIER.fullmatch(text) is not None and ("_" in text or "." in text)


def _masked(match: re.Match[str]) -> str:
    """``pre`` kept, ``secret`` masked, if the match's ``name`` (when it has one) is secret;
    an ``ident`` must also have two parts or more (``db_password``, not ``password``)."""
    found = match.groupdict()
    name = found.get("name") or found.get("ident")
    if name is not None and not _is_secret_name(name):
        return match.group(0)
    if found.get("ident") is not None and not _is_identifier(found["ident"]):
        return match.group(0)
    return match.group("pre") + MASK


_RULES = [
    # scheme://user:password@host (a password holding "@" is masked up to the last one)
    re.compile(r"(?P<pre>(?<![\w+.-])[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<secret>[^\s/?#]*)(?=@)"),
    # ?password=x, &access_token=x, ?key=x in a URL or query string
    re.compile(r"(?P<pre>[?&;](?P<name>[\w.-]+)=)(?P<secret>[^&#\s]*)"),
    re.compile(r"(?P<pre>[?&]key=)(?P<secret>[^&#\s]*)"),
    # curl -u user:password, --user user:password, -uuser:password
    re.compile(r"(?P<pre>(?<![\w-])(?:-u[ \t]*|--user(?:=|[ \t]+))[^:\s]*:)(?!//)(?P<secret>\S+)"),
    # Authorization: Bearer x, X-Api-Key: x, "password": "x"
    re.compile(
        rf"""(?P<pre>(?<![\w.-])(?P<name>[\w.-]+)["']?[ \t]*:[ \t]*{_SCHEME})"""
        r"""(?P<secret>"[^"]*"|'[^']*'|[^\s,}]+)""",
        re.IGNORECASE,
    ),
    # --password x, --password=x, -token x
    re.compile(rf"(?P<pre>(?<![\w-])--?(?P<name>[\w.-]+)(?:=|[ \t]+))(?P<secret>{_VALUE})"),
    # redis-cli -a x (not -a followed by another option)
    re.compile(rf"(?P<pre>(?<![\w-])-a[ \t]+)(?!-)(?P<secret>{_VALUE})"),
    # mysql -px
    re.compile(
        r"(?P<pre>(?<![\w-])-p)(?!(?:ath|erm|rint|rint0|rintf|rune)(?!\S))(?P<secret>[^\s=]\S*)"
    ),
    # PGPASSWORD=x, password=x in a conninfo string, aws_secret_access_key = x
    re.compile(rf"(?P<pre>(?<![\w.?&;/-])(?P<name>[\w.-]+)[ \t]*=[ \t]*)(?P<secret>{_VALUE})"),
    # aws configure set aws_secret_access_key x: an identifier (two parts or more), its value
    re.compile(
        r"(?P<pre>(?<![\w.=-])(?P<ident>[A-Za-z][\w.]*)[ \t]+)"
        rf"(?![-=:])(?P<secret>{_VALUE})"
    ),
]

# A word that *is* a secret's name and value (PGPASSWORD=correct horse, a header given as
# one argument): everything after the name is the secret.
_WHOLE_WORD = re.compile(
    rf"(?P<pre>^(?P<name>[A-Za-z][\w.-]*)[ \t]*[:=][ \t]*{_SCHEME})(?P<secret>.+)$",
    re.IGNORECASE | re.DOTALL,
)


def redact(text: str) -> str:
    """Replace passwords, tokens and credentials in free ``text`` with ``***``."""
    for rule in _RULES:
        text = rule.sub(_masked, text)
    return text


def describe(text: str) -> str:
    """Free ``text`` as stored: redacted, at most ``MAX_DESCRIPTION_LENGTH`` characters."""
    return redact(text[:_SCAN])[:MAX_DESCRIPTION_LENGTH]


def displayable(text: str) -> str:
    """``text`` as storable, printable UTF-8: an undecodable byte (a surrogate escape, as
    ``os.fsdecode`` makes of a non-UTF-8 argument) shown as ``\\xff``, another lone
    surrogate as ``\\ud800``, NUL as ``\\x00``."""
    if "\x00" not in text:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            return text
    shown = []
    for char in text:
        code = ord(char)
        if 0xDC80 <= code <= 0xDCFF:
            shown.append(f"\\x{code - 0xDC00:02x}")
        elif 0xD800 <= code <= 0xDFFF:
            shown.append(f"\\u{code:04x}")
        elif code == 0:
            shown.append("\\x00")
        else:
            shown.append(char)
    return "".join(shown)


def _user_pass(value: str) -> str:
    if "://" in value:
        return redact(value)  # redis-cli -u redis://:password@host
    user, colon, _password = value.partition(":")
    return f"{user}:{MASK}" if colon else value


def _option(word: str) -> tuple[str, str | None] | None:
    """An option word, redacted, and what its next word is; ``None`` if not one of ours."""
    dashes = "--" if word.startswith("--") else "-"
    name, equals, value = word[len(dashes) :].partition("=")
    if dashes == "-" and name.startswith("p") and len(word) > 2:
        if word in _FIND_PREDICATES:
            return word, None
        # MySQL's password written together; a Go-style -password x also masks x.
        return "-p" + MASK, (_SECRET if not equals and _is_secret_name(name) else None)
    if dashes == "-" and name in ("a", "u"):
        return word, (_SECRET_UNLESS_OPTION if name == "a" else _USER_PASS)
    if dashes == "-" and name.startswith("u") and not equals:
        return "-u" + _user_pass(name[1:]), None
    if _is_secret_name(name):
        return (f"{dashes}{name}={MASK}", None) if equals else (word, _SECRET)
    if dashes == "--" and name == "user":
        return (f"--user={_user_pass(value)}", None) if equals else (word, _USER_PASS)
    return None


def _word(word: str) -> tuple[str, str | None]:
    """One word, redacted, and what its next word is (``None``: an ordinary word)."""
    if word.startswith("-") and word != "-" and word != "--":
        option = _option(word)
        if option is not None:
            return option
    whole = _WHOLE_WORD.match(word)
    if whole is not None and _is_secret_name(whole.group("name")):
        return whole.group("pre") + MASK, None
    if _is_identifier(word) and _is_secret_name(word):
        return word, _SECRET_UNLESS_OPTION  # aws configure set aws_secret_access_key x
    return redact(word), None


def redact_argv(argv: Iterable[str]) -> str:
    """A command line as one displayable string, its secrets replaced by ``***``.

    Word-aware: the value of ``--password`` is the whole next argument, spaces and all.
    Non-UTF-8 bytes are shown as ``\\xff`` (see :func:`displayable`). The result is at
    most ``MAX_DESCRIPTION_LENGTH`` characters, and left unchanged by :func:`redact`.
    """
    shown: list[str] = []
    expect: str | None = None
    length = 0
    for raw in argv:
        if length > MAX_DESCRIPTION_LENGTH:
            break
        word = displayable(raw[:_SCAN])
        if expect == _SECRET or (expect == _SECRET_UNLESS_OPTION and not word.startswith("-")):
            shown.append(MASK)
            expect = None
        elif expect == _USER_PASS:
            shown.append(_user_pass(word))
            expect = None
        else:
            word, expect = _word(word)
            shown.append(word)
        length += len(shown[-1]) + 1
    return " ".join(shown)[:MAX_DESCRIPTION_LENGTH]
