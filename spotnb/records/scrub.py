"""Credentials never appear in a record (DESIGN invariant 7), even when a cell prints one.

spotnb itself never puts a credential in a spec, an event or a record; but a record
keeps what the notebook printed, and a notebook may print ``os.environ`` or a
traceback that quotes a key. So every string of a record is scrubbed before it is
written: what :func:`find_credentials` finds is replaced by :data:`REDACTED`.

What counts as a credential:

* AWS access key ids (``AKIA…``/``ASIA…`` and the other key-id prefixes) and the
  value after an AWS secret key or session token name (``aws_secret_access_key = …``,
  ``"SecretAccessKey": "…"``);
* PEM private keys;
* webhook URLs (Slack's ``hooks.slack.com/...``, Discord's, Teams'), and the value of a
  ``%%spot_train --notify`` option, whatever its host;
* the password in a URL (``https://user:password@host``);
* the value after an environment-variable-style name that says it is secret
  (``GITHUB_TOKEN=…``, ``'DB_PASSWORD': '…'``);
* the value of every variable of this process's environment whose name says it is
  secret (``*KEY*``, ``*SECRET*``, ``*TOKEN*``, ``*PASSWORD*``, ``*CREDENTIAL*``,
  ``*AUTH*``), wherever it appears, once it is at least :data:`MIN_SECRET_CHARS` long.

Binary payloads (images, widget buffers) are left alone: they are not text.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["MIN_SECRET_CHARS", "REDACTED", "find_credentials", "scrub", "secret_env_values"]

REDACTED = "[redacted]"
#: Shorter environment values are not searched for: "1" or "true" are not secrets, and
#: replacing them everywhere would mangle the record.
MIN_SECRET_CHARS = 8
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|AUTH", re.I)
_BINARY_KEYS = frozenset({"image/png", "image/jpeg", "image/gif", "buffers"})

# (pattern, group holding the secret or 0 for the whole match)
_PATTERNS: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)"
                r"[A-Z0-9]{16}(?![A-Z0-9])"), 0),
    (re.compile(r"(?i)(?:aws_?secret_?access_?key|secret_?access_?key|aws_?session_?token|"
                r"session_?token)[\"']?\s*[:=]\s*[\"']?([A-Za-z0-9/+=]{16,})"), 1),
    (re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----",
                re.S), 0),
    (re.compile(r"https?://(?:hooks\.slack\.com/(?:services|workflows|triggers)|"
                r"(?:[a-z0-9-]+\.)?discord(?:app)?\.com/api/webhooks|"
                r"[a-z0-9-]+\.webhook\.office\.com)/[^\s\"'<>]+", re.I), 0),
    (re.compile(r"--notify[=\s]+([^\s\"'<>]+)"), 1),
    (re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^/\s:@'\"]+:([^/\s@'\"]+)@"), 1),
    (re.compile(r"\b[A-Z][A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|"
                r"PRIVATE_KEY|CREDENTIALS?)[A-Z0-9_]*[\"']?\s*[:=]\s*[\"']?"
                r"([^\s\"',}]{" + str(MIN_SECRET_CHARS) + ",})"), 1),
)


def secret_env_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of the environment's secret-looking variables, longest first."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if _SECRET_NAME.search(k) and len(v) >= MIN_SECRET_CHARS}
    return sorted(values, key=len, reverse=True)


def find_credentials(text: str, env_values: Iterable[str] | None = None) -> list[str]:
    """The credentials in ``text`` (see the module docstring), as found."""
    found = []
    for pattern, group in _PATTERNS:
        for match in pattern.finditer(text):
            value = match.group(group)
            if value != REDACTED:
                found.append(value)
    for value in secret_env_values() if env_values is None else env_values:
        if value in text:
            found.append(value)
    return found


def _scrub_text(text: str, env_values: list[str]) -> tuple[str, int]:
    count = 0
    for value in env_values:
        if value in text:
            count += text.count(value)
            text = text.replace(value, REDACTED)
    for pattern, group in _PATTERNS:
        def replace(match: re.Match[str], group: int = group) -> str:
            nonlocal count
            if match.group(group) == REDACTED:
                return match.group(0)
            count += 1
            if group == 0:
                return REDACTED
            start, end = match.span(group)
            offset = match.start(0)
            whole = match.group(0)
            return whole[:start - offset] + REDACTED + whole[end - offset:]

        text = pattern.sub(replace, text)
    return text, count


def scrub(obj: Any, env_values: list[str] | None = None) -> tuple[Any, int]:
    """A copy of ``obj`` (JSON-like: dicts, lists, strings) with every credential
    replaced by :data:`REDACTED`, and how many were replaced."""
    values = secret_env_values() if env_values is None else env_values
    total = 0

    def walk(node: Any) -> Any:
        nonlocal total
        if isinstance(node, str):
            text, n = _scrub_text(node, values)
            total += n
            return text
        if isinstance(node, Mapping):
            return {k: v if k in _BINARY_KEYS else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, tuple):
            return tuple(walk(v) for v in node)
        return node

    return walk(obj), total
