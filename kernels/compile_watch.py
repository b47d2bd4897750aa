"""Every Triton kernel specialisation this process builds, recorded as it is built.

Triton compiles a kernel once per *specialisation*: its constexprs, its options and a class of every
other argument (an int's divisibility by 16, a pointer's 16-byte alignment, ...). A class not seen
before is compiled on the spot, inside whatever launched it; in a server that is inside the step
loop, and every stream waits seconds. `CompileWatch` hooks Triton's JIT cache (its hook runs on every
miss of a process's in-memory kernel cache: a compile, or a load from the on-disk cache) so a server
can count the misses after it said ready, and a test or a probe can name the kernel and the argument
class that caused each one.

Triton >= 3.4 keeps the hook in `triton.knobs.runtime.jit_cache_hook`, older releases in
`JITFunction.cache_hook`; both call it with the same keywords. A hook that was installed before is
called after ours. Under the interpreter (`TRITON_INTERPRET=1`) nothing is compiled and the hook
never runs.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import time

_ARGUMENTS = re.compile(r"\((.*)\)$")


@dataclasses.dataclass(frozen=True)
class Compilation:
    """One specialisation built: the kernel, its argument classes as Triton names them (`n: i32`,
    `n: i32:16`, `X: *bf16:16`, `BLOCK: constexpr`...), and when, relative to ready."""

    kernel: str
    arguments: tuple[str, ...]
    after_ready: bool
    at: float  # time.monotonic()

    def differences(self, other: Compilation) -> list[str]:
        """The arguments whose class differs from `other`'s (same kernel): what made this one new."""
        return [f"{mine} (was {theirs})" for mine, theirs in zip(self.arguments, other.arguments)
                if mine != theirs]


@dataclasses.dataclass(frozen=True)
class CompileCounts:
    """What one process built: how many specialisations at start-up, and each one built after ready
    named with its cause (`CompileWatch.explain`). Plain data, so a service in a process of its own
    reports its own count to whoever exports the metric."""

    startup: int = 0
    serving: tuple[str, ...] = ()


def _arguments(compile_info: dict, text: str) -> tuple[str, ...]:
    """`name: type[=constant][ attributes]` per argument, from the hook's compile information (its
    signature, constants by argument path and attributes such as tt.divisibility by path); the
    hook's own text where that information has another shape."""
    signature, constants = compile_info.get("signature"), compile_info.get("constants") or {}
    configs = compile_info.get("configs") or [{}]
    attributes = configs[0] if isinstance(configs[0], dict) else {}
    if not isinstance(signature, dict):
        found = _ARGUMENTS.search(text)
        return tuple(part.strip() for part in found.group(1).split(", ")) if found and found.group(1) else ()
    described = []
    for index, (name, kind) in enumerate(signature.items()):
        text = f"{getattr(name, 'name', name)}: {kind}"
        if (index,) in constants:
            text += f"={constants[(index,)]!r}"
        if (index,) in attributes:
            text += " " + ",".join(f"{attr[0]}={attr[1]}" if isinstance(attr, (list, tuple)) else str(attr)
                                   for attr in attributes[(index,)])
        described.append(text)
    return tuple(described)


def _hook_owner():
    """(object, attribute) holding Triton's JIT cache hook in this Triton."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        return knobs.runtime, "jit_cache_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "cache_hook"


class CompileWatch:
    """Install once per process (`install()`), call `mark_ready()` when the server is ready; then
    `after_ready` lists what was built on the serving path (the aim: nothing)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._compilations: list[Compilation] = []
        self._ready = False
        self._previous = None
        self._installed = False

    def install(self) -> CompileWatch:
        if self._installed:
            return self
        owner, name = _hook_owner()
        self._previous = getattr(owner, name)
        setattr(owner, name, self._on_miss)
        self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            owner, name = _hook_owner()
            setattr(owner, name, self._previous)
            self._installed = False

    def mark_ready(self) -> None:
        with self._lock:
            self._ready = True

    def mark_starting(self) -> None:
        """Another start-up in this process (a probe's next engine): what builds now is start-up."""
        with self._lock:
            self._ready = False

    @property
    def compilations(self) -> list[Compilation]:
        with self._lock:
            return list(self._compilations)

    @property
    def after_ready(self) -> list[Compilation]:
        return [built for built in self.compilations if built.after_ready]

    def counts(self) -> CompileCounts:
        built = self.compilations
        serving = tuple(self.explain(item) for item in built if item.after_ready)
        return CompileCounts(len(built) - len(serving), serving)

    def explain(self, built: Compilation) -> str:
        """`built`'s kernel and, against the same kernel's closest earlier specialisation, the
        arguments whose class changed (the cause, named), or "first of its kernel"."""
        earlier = [other for other in self.compilations
                   if other.kernel == built.kernel and other.at < built.at
                   and len(other.arguments) == len(built.arguments)]
        if not earlier:
            return f"{built.kernel}: first of its kernel"
        closest = min(earlier, key=lambda other: len(built.differences(other)))
        return f"{built.kernel}: " + ", ".join(built.differences(closest))

    def _on_miss(self, **hook_arguments):
        fn = hook_arguments.get("fn")
        name = getattr(fn, "name", None) or getattr(fn, "__name__", "?")
        module = getattr(fn, "module", "")
        arguments = _arguments(hook_arguments.get("compile") or {}, hook_arguments.get("repr", ""))
        built = Compilation(f"{module}.{name}" if module else name, arguments, self._ready, time.monotonic())
        with self._lock:
            self._compilations.append(built)
        if self._previous is not None:
            return self._previous(**hook_arguments)
        return None


WATCH = CompileWatch()  # the process's: the engine installs it at start-up and marks it ready
