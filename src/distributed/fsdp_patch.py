"""Replacing functions of FSDP2's `_fsdp_collectives` that it looks up at each call, and putting them back.

FSDP2 has no hooks inside its all-gather and reduce-scatter paths; the copies and casts there are
module-level functions of `torch.distributed.fsdp._fully_shard._fsdp_collectives`, found by name at
each call. src/distributed/grad_cast.py, copy_in.py and reduce_copy_in.py each replace one or two of
them for the whole process. The rules they share live here: install once and keep the first
install's originals; never take one's own replacement, or a replacement of someone else's installed
after ours, for the original; restore only what is still ours; change nothing (and say so) where
this torch lacks a function.
"""
from __future__ import annotations

from collections.abc import Callable


def collectives():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


class CollectivesPatch:
    """`CollectivesPatch({name: replacement})`: `install()` puts each replacement in place of the
    function of that name, `restore()` puts FSDP2's back, `original[name]` is FSDP2's own."""

    def __init__(self, replacements: dict[str, Callable]):
        self.replacements = replacements
        self.original: dict[str, Callable] | None = None

    def _current(self) -> dict[str, Callable] | None:
        try:
            module = collectives()
        except ImportError:
            return None
        current = {name: getattr(module, name, None) for name in self.replacements}
        return None if any(f is None for f in current.values()) else current

    def installed(self) -> bool:
        current = self._current()
        return current is not None and all(current[n] is f for n, f in self.replacements.items())

    def install(self) -> bool:
        """True where the replacements are in place (now or from before); False, and nothing
        changed, where a function is missing, or something else replaced ours since an earlier
        install (theirs is left), or only some of ours are in place."""
        current = self._current()
        if current is None:
            return False
        if all(current[n] is f for n, f in self.replacements.items()):
            return True
        if self.original is not None or any(current[n] is f for n, f in self.replacements.items()):
            return False
        self.original = current
        module = collectives()
        for name, f in self.replacements.items():
            setattr(module, name, f)
        return True

    def restore(self) -> None:
        """FSDP2's functions again, unless something else has replaced ours since the install:
        theirs stay, and so does this install's record of the originals."""
        if self.original is None or not self.installed():
            return
        module = collectives()
        for name, f in self.original.items():
            setattr(module, name, f)
        self.original = None
