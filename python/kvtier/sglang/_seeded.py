"""Seeded bugs of the SGLang backend (``ci/sglang.sh`` bites): a branch ``if seeded("NAME")`` is
taken only in a wheel built with ``KVTIER_PY_SEEDED_BUGS=1`` and run with
``KVTIER_PY_SEEDED_BUG=NAME``; in every published wheel ``seeded`` is always False."""

from .._kvtier import _seeded_bug

_PLANTED = _seeded_bug()


def seeded(name: str) -> bool:
    return _PLANTED == name
