"""Keep secrets out of what sgpu_magic prints and records.

sgpu_magic passes the kernel's environment to the ranks (in a private run directory) but never
writes it to MLflow, and every warning or message it prints about a URI or an exception goes
through :func:`redact` first: the password in a URL's user info (``https://user:pw@host``,
``postgresql://user:pw@db``) and the value of every environment variable whose name looks like a
secret (:data:`SECRET_NAME`) become ``***``; paths and ordinary words do not (``PWD``, the desktop's
session variables: see :data:`NOT_SECRET_NAME`).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

SECRET_NAME = re.compile(
    r"TOKEN(?!IZER)|SECRET|PASSW(OR)?D|PASSPHRASE|API_?KEY|ACCESS_?KEY|PRIVATE_?KEY|CREDENTIAL|"
    r"(^|_)AUTH(ORIZATION)?($|_)|COOKIE|(^|_)KEY$|_PWD$",
    re.IGNORECASE,
)
"""Environment variable names treated as secrets (``HF_TOKEN``, ``AWS_SECRET_ACCESS_KEY``,
``DATABRICKS_TOKEN``, ``OPENAI_API_KEY``, ``PGPASSWORD``, ``MYSQL_PWD``, ``NPM_AUTH_TOKEN`` ...).
Not ``PWD`` / ``OLDPWD`` (directories), ``TOKENIZERS_PARALLELISM``, ``GIT_AUTHOR_NAME``, nor the
desktop's and Jupyter's ``*SESSION*`` variables (``XDG_SESSION_CLASS=user``, ``JPY_SESSION_NAME``):
their values are words and paths that would be blanked out of every message."""

NOT_SECRET_NAME = re.compile(r"_(FILE|PATH|DIR|SOCK|SOCKET)$|^GOOGLE_APPLICATION_CREDENTIALS$", re.IGNORECASE)
"""Names that match :data:`SECRET_NAME` but hold where a secret is, not the secret: a path
(``AWS_SHARED_CREDENTIALS_FILE``, ``SSH_AUTH_SOCK``, ``GOOGLE_APPLICATION_CREDENTIALS``)."""

MIN_SECRET_CHARS = 4
"""Shorter values (``1``, ``yes``) are not searched for: they would blank out ordinary words."""

_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^:/?#@\s]*):(?P<password>[^/?#@\s]+)@")


def is_secret_name(name: str) -> bool:
    """Whether an environment variable called ``name`` is treated as a secret."""
    return bool(SECRET_NAME.search(name)) and not NOT_SECRET_NAME.search(name)


def secret_values(env: Mapping[str, str] | None = None) -> list[str]:
    """Values of the secret-looking variables of ``env`` (default ``os.environ``), longest first."""
    env = os.environ if env is None else env
    found = {v for k, v in env.items() if is_secret_name(k) and len(v) >= MIN_SECRET_CHARS}
    return sorted(found, key=len, reverse=True)


def redact(text: str, env: Mapping[str, str] | None = None) -> str:
    """``text`` with URL passwords and secret environment values replaced by ``***``.

    Args:
        text: any message.
        env: environment whose secret-looking values are removed; default ``os.environ``.
    """
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:***@", text)
    for value in secret_values(env):
        text = text.replace(value, "***")
    return text


class RedactingFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose lines go through :func:`redact` (exceptions included).

    Example:
        ``handler.setFormatter(RedactingFormatter("%(message)s"))``
    """

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))
