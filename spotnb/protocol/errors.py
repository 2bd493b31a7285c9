"""The error for bad job settings, beneath everything that checks them.

:class:`SpecError` is raised by the spec (``spotnb.protocol.spec``, where it is also imported
from), the notebook side's validation and the providers' own settings (the local
cloud's signal model), so it stands apart: none of them needs another to raise it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["SpecError"]


class SpecError(ValueError):
    """A job's settings are invalid; the message says how to fix them.

    ``field`` is the :func:`spotnb.submit` argument at fault (or None). Its message is
    written with ``{option}`` where that argument is named, so that the magics and the
    CLI can name the option the user typed instead (``--budget``, not ``budget_usd``):
    ``str(err)`` names the argument, :meth:`message` whatever the caller says.
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        self.template = message
        self.field = field
        super().__init__(self.message())

    def message(self, names: Mapping[str, str] | None = None) -> str:
        """The message, naming ``field`` as ``names[field]`` when given."""
        if self.field is None:
            return self.template
        return self.template.replace("{option}", (names or {}).get(self.field, self.field))
