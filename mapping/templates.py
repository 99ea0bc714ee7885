"""Name templates: ``decoder.layers.{layer}.mlp`` matches a full name (captures ``layer``) and formats back.

Why a template syntax over raw regexes: presets stay readable and the same template serves both directions
(match one side, format the other). Raw regexes are still allowed (``re:...``) for names that need them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping as MappingABC
from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import BadInput

_TEMPLATE_FIELD = re.compile(r"\{(\w+)(?::([^{}]+))?\}")
_DIGIT_CAPTURES = {"layer", "expert", "i", "n", "mtp"}


@dataclass
class Pattern:
    """One name template (or raw regex) that matches a full name and can be formatted back."""

    text: str
    regex: re.Pattern[str]
    fields: tuple[str, ...]

    @classmethod
    def compile(cls, text: str) -> Pattern:
        if text.startswith("re:"):
            rx = re.compile(text[3:])
            return cls(text, rx, tuple(rx.groupindex))
        parts, pos, fields = [], 0, []
        for m in _TEMPLATE_FIELD.finditer(text):
            parts.append(re.escape(text[pos:m.start()]))
            name, sub = m.group(1), m.group(2)
            if name in fields:
                parts.append(f"(?P={name})")
            else:
                fields.append(name)
                sub = sub or (r"\d+" if name in _DIGIT_CAPTURES else r"[^.]+")
                parts.append(f"(?P<{name}>{sub})")
            pos = m.end()
        parts.append(re.escape(text[pos:]))
        return cls(text, re.compile("".join(parts)), tuple(fields))

    def match(self, name: str) -> dict[str, str] | None:
        m = self.regex.fullmatch(name)
        return m.groupdict() if m else None

    def format(self, captures: MappingABC[str, str]) -> str:
        if self.text.startswith("re:"):
            raise BadInput(f"raw regex pattern {self.text!r} cannot be formatted; write it as a template")
        try:
            return _TEMPLATE_FIELD.sub(lambda m: str(captures[m.group(1)]), self.text)
        except KeyError as exc:
            raise BadInput(f"pattern {self.text!r} needs capture {exc.args[0]!r}") from None



def compile_pattern(text: str, source: str, where: str) -> Pattern:
    """``Pattern.compile`` with the file and place named in the error of a bad template or regex."""
    try:
        return Pattern.compile(text)
    except (re.error, RecursionError, OverflowError) as exc:
        raise BadInput(f"{source}: {where}: pattern {text[:60]!r} is not a valid template or regex "
                       f"({exc.__class__.__name__})") from None


def has_field(patterns: Sequence[Pattern], name: str) -> bool:
    return any(name in p.fields for p in patterns)
