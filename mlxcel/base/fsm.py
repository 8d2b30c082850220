"""Transition tables for the role cores' state machines (h11's ``_state.py`` is the model).

Each role writes its legal transitions as one dict ``{(state, event): next_state}`` in its
module. :meth:`Table.next` looks the pair up; a pair that is not in the table raises
:class:`IllegalTransition` from the lookup itself, carrying the error code the role answers
with -- so a message that does not fit the current state cannot slip through an ``if``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Generic, TypeVar

from mlxcel.base.errors import IllegalTransition

S = TypeVar("S", bound=enum.Enum)
E = TypeVar("E", bound=enum.Enum)


class Table(Generic[S, E]):
    def __init__(
        self,
        name: str,
        rules: Mapping[tuple[S, E], S],
        codes: Mapping[tuple[S, E] | E, str],
        default_code: str,
    ) -> None:
        self.name = name
        self.rules = dict(rules)
        # The error code for a refused pair: the most specific entry wins.
        self._codes = dict(codes)
        self._default = default_code

    def next(self, state: S, event: E) -> S:
        try:
            return self.rules[(state, event)]
        except KeyError:
            code = self._codes.get((state, event), self._codes.get(event, self._default))
            raise IllegalTransition(self.name, state, event, code) from None

    def allows(self, state: S, event: E) -> bool:
        return (state, event) in self.rules
