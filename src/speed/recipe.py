"""A recipe: one speed-up that replaces or reads torch internals, and what it declares about them.

Each recipe names its knob (`speed.NAME`), the torch symbols it replaces and those it reads, the
torch and Triton releases its parity test passed on, where its gain is recorded and which test
holds it to torch's own path bit for bit. `probe()` checks the symbols against the torch that is
installed (each exists; each function replaced still takes the parameters the replacement was
written for; each instance attribute read is still set by torch's class), and `allowed()` says
whether the recipe may run here: on a release outside its list it runs only when the user forces
it (`speed.force_unverified=true`).

Symbols are written `module:qualname`; a `Class.attr` that is not on the class is looked up in the
class's source as `self.attr` (FSDP2 sets most of what it reads in `__init__` or at lazy init).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from src.speed.versions import TORCH_TESTED, release, torch_version, triton_version

FSDP = "torch.distributed.fsdp._fully_shard"
FORCE = "speed.force_unverified=true"


@functools.cache
def _class_source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def resolve(symbol: str) -> object | None:
    """The object `module:qualname` names, or None where the module or an attribute is missing.
    An instance attribute (`Class.attr` set on `self`) resolves to the class when the class's source
    sets or reads it."""
    module_name, _, qualname = symbol.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except ImportError:
        return None
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        found = inspect.getattr_static(obj, part, None)
        if found is None:
            is_last = i == len(parts) - 1
            if is_last and isinstance(obj, type) and re.search(rf"\bself\.{re.escape(part)}\b", _class_source(obj)):
                return obj
            return None
        obj = found
    return obj


def _parameters(obj: object) -> tuple[str, ...] | None:
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    obj = inspect.unwrap(obj) if callable(obj) else obj
    try:
        return tuple(inspect.signature(obj).parameters)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class Recipe:
    name: str
    """the knob: speed.NAME"""
    does: str
    """what it does, in one line"""
    replaces: tuple[str, ...]
    """torch symbols it puts its own in place of, while installed"""
    reads: tuple[str, ...]
    """torch symbols and attributes its code reads or calls"""
    signatures: Mapping[str, tuple[str, ...]]
    """symbol -> the leading parameter names the code calling or replacing it was written for"""
    gain: str
    """the gain measured, and where it is recorded"""
    parity: str
    """the test that holds it to torch's own path, bit for bit"""
    restore: Callable[[], None]
    """torch's own functions back in place (what the recipe installed, where it is still its own)"""
    originals: Callable[[], Mapping[str, object]] = dict
    """symbol -> torch's own object while the recipe is installed (the probe reads those, not ours)"""
    torch: tuple[str, ...] = TORCH_TESTED
    """the torch releases (major.minor) its parity test passed on"""
    triton: tuple[str, ...] = ()
    """the Triton releases its kernels were verified on; empty: it launches none"""
    notes: tuple[str, ...] = field(default=())
    """anything else a reader of the recipe table should know (an upstream issue, a removal condition)"""
    switch: bool = False
    """the knob is true/false (off unless asked for) rather than auto/on/off"""
    native: Callable[[], str | None] = lambda: None
    """what this torch offers itself in the recipe's place (then no recipe runs: the knob takes torch's own); None: nothing"""
    fsdp: bool = True
    """a recipe on FSDP2's internals, whose verdict src/speed/apply.py's decide() gives; false: a lever on the model or
    the step that decides where it runs itself (install() calls it, with or without FSDP2)"""

    @property
    def knob(self) -> str:
        return f"speed.{self.name}"

    def probe(self) -> list[str]:
        """What of the recipe's torch symbols this torch lacks or has changed; empty: all as written for."""
        gaps = [s for s in (*self.replaces, *self.reads) if resolve(s) is None]
        originals = self.originals()
        for symbol, want in self.signatures.items():
            obj = originals.get(symbol) or resolve(symbol)
            if obj is None:
                continue  # missing: already listed
            have = _parameters(obj)
            if have is not None and have[: len(want)] != tuple(want):
                gaps.append(f"{symbol}({', '.join(have)}) (written for ({', '.join(want)}))")
        return gaps

    def why_not(self, force: bool = False) -> str | None:
        """Why the recipe may not run on this torch, in a few words; None where it may."""
        gaps = self.probe()
        if gaps:
            return f"torch {torch_version()} lacks {gaps[0]}" + (f" and {len(gaps) - 1} more" if len(gaps) > 1 else "")
        if force:
            return None
        if release(torch_version()) not in self.torch:
            return f"verified on torch {', '.join(self.torch)}, not on torch {torch_version()}"
        if self.triton:
            version = triton_version()
            if version is None:
                return "Triton is not installed"
            if release(version) not in self.triton:
                return f"its Triton kernels verified on Triton {', '.join(self.triton)}, not on Triton {version}"
        return None

    def refusal(self, force: bool) -> str | None:
        """The one line that refuses `speed.NAME=on` on a torch the recipe may not run on; None where it may."""
        why = self.why_not(force)
        if why is None:
            return None
        asked, off = (f"{self.knob}=true", f"drop {self.knob}") if self.switch else (f"{self.knob}=on", f"set {self.knob}=off (torch's own path)")
        if self.probe():
            return f"{asked} {self.does}, and {why}; {off}"
        instead = off if self.switch else f"set {self.knob}=auto (off where unverified)"
        return f"{asked} {self.does}, {why}; add {FORCE} to run it anyway, or {instead}"

    def off_line(self, why: str) -> str:
        """The one warning line of an `auto` recipe turned off on this torch."""
        forced = "" if self.probe() else f" ({FORCE} runs it anyway)"
        return f"{self.knob}: off, torch's own path instead: {why}{forced}"
