"""Replacing functions of FSDP2 that it looks up at each call, and putting them back.

FSDP2 has no hooks inside its all-gather and reduce-scatter paths; the copies and casts there are
module-level functions of `torch.distributed.fsdp._fully_shard._fsdp_collectives`, found by name at
each call, and methods of its classes. The recipes of this package replace some of them while a run
lasts. The rules they share live here: install once and keep the first install's originals; never
take one's own replacement, or a replacement of someone else's installed after ours, for the
original; restore only what is still ours; change nothing (and say so) where this torch lacks a
function.
"""
from __future__ import annotations

from collections.abc import Callable


def collectives():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    return _fsdp_collectives


class Patch:
    """`Patch({name: replacement})`: `install()` puts each replacement in place of the
    function of that name, `restore()` puts FSDP2's back. `fsdp2[name]` is FSDP2's own, kept from
    the first install for the life of the process: a replacement that other code captured while it
    was installed still reaches FSDP2's function after a restore."""

    def __init__(self, replacements: dict[str, Callable], owner: Callable[[], object] = collectives):
        self.replacements = replacements
        self.owner = owner
        """what holds the functions: `_fsdp_collectives` (the default), or one of FSDP2's classes"""
        self.fsdp2: dict[str, Callable] | None = None

    def _current(self) -> dict[str, Callable] | None:
        try:
            module = self.owner()
        except (ImportError, AttributeError):
            return None
        current = {name: getattr(module, name, None) for name in self.replacements}
        return None if any(f is None for f in current.values()) else current

    def installed(self) -> bool:
        current = self._current()
        return current is not None and all(current[n] is f for n, f in self.replacements.items())

    def install(self) -> bool:
        """True where the replacements are in place (now or from before); False, and nothing
        changed, where a function is missing, only some of ours are in place, or a function is
        neither ours nor the FSDP2 one taken at the first install (other code replaced it: theirs
        is left)."""
        current = self._current()
        if current is None:
            return False
        if all(current[n] is f for n, f in self.replacements.items()):
            return True
        if any(current[n] is f for n, f in self.replacements.items()):
            return False
        if self.fsdp2 is not None and current != self.fsdp2:
            return False
        self.fsdp2 = current
        module = self.owner()
        for name, f in self.replacements.items():
            setattr(module, name, f)
        return True

    def restore(self) -> None:
        """FSDP2's functions again where all of ours are in place; where other code has replaced
        one since the install, theirs stay (and so do ours that they may call)."""
        if self.fsdp2 is None or not self.installed():
            return
        module = self.owner()
        for name, f in self.fsdp2.items():
            setattr(module, name, f)

    def originals(self, prefix: str) -> dict[str, Callable]:
        """`prefix + name` -> FSDP2's own function, while the replacements are in place (a recipe's
        probe reads FSDP2's signatures, not ours); empty otherwise."""
        if self.fsdp2 is None or not self.installed():
            return {}
        return {prefix + name: f for name, f in self.fsdp2.items()}
