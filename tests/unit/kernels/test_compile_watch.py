"""`CompileWatch` over Triton's JIT cache hook: the hook is called as Triton calls it (its
keywords, the compile information of this Triton's shape), so the watch records, splits before and
after ready, names the argument class that changed, chains the hook it found and puts it back."""

from kernels import compile_watch
from kernels.compile_watch import CompileCounts, CompileWatch


class _Fn:
    module, name = "kernels.example", "_kernel"


def _miss(owner, attribute, n_class: str, ptr_aligned: bool, block: int):
    signature = {"X": "*bf16", "n": n_class.split(":")[0], "BLOCK": "constexpr"}
    attributes = {(0,): [["tt.divisibility", 16]]} if ptr_aligned else {}
    if ":" in n_class:
        attributes[(1,)] = [["tt.divisibility", 16]]
    info = {"key": "k", "signature": signature, "constants": {(2,): block}, "configs": [attributes]}
    return getattr(owner, attribute)(key="k", repr="_kernel[...]()", fn=_Fn(), compile=info,
                                     is_manual_warmup=False, already_compiled=False)


def test_the_watch_records_explains_chains_and_uninstalls():
    owner, attribute = compile_watch._hook_owner()
    previous_calls = []
    original = getattr(owner, attribute)
    setattr(owner, attribute, lambda **kwargs: previous_calls.append(kwargs) or None)
    try:
        watch = CompileWatch().install()
        _miss(owner, attribute, "i32:16", True, 64)
        watch.mark_ready()
        _miss(owner, attribute, "i32:16", False, 64)
        _miss(owner, attribute, "i32", True, 128)
        assert len(previous_calls) == 3  # the hook found first is still called
        assert [built.after_ready for built in watch.compilations] == [False, True, True]
        first, misaligned, other = watch.compilations
        assert first.arguments == ("X: *bf16 tt.divisibility=16", "n: i32 tt.divisibility=16",
                                   "BLOCK: constexpr=64")
        assert watch.explain(first) == "kernels.example._kernel: first of its kernel"
        assert watch.explain(misaligned) == ("kernels.example._kernel: X: *bf16 (was X: *bf16 "
                                             "tt.divisibility=16)")
        assert "n: i32 (was n: i32 tt.divisibility=16)" in watch.explain(other)
        assert "BLOCK: constexpr=128 (was BLOCK: constexpr=64)" in watch.explain(other)
        assert len(watch.after_ready) == 2
        assert watch.counts() == CompileCounts(1, (watch.explain(misaligned), watch.explain(other)))
        watch.mark_starting()
        _miss(owner, attribute, "i32", True, 256)
        assert len(watch.after_ready) == 2
        assert watch.counts().startup == 2 and len(watch.counts().serving) == 2
        watch.uninstall()
        assert len(previous_calls) == 4
        _miss(owner, attribute, "i32", True, 256)
        assert len(watch.compilations) == 4 and len(previous_calls) == 5
    finally:
        setattr(owner, attribute, original)


def test_without_an_earlier_hook_triton_goes_on_compiling():
    owner, attribute = compile_watch._hook_owner()
    original = getattr(owner, attribute)
    setattr(owner, attribute, None)
    try:
        watch = CompileWatch().install()
        assert _miss(owner, attribute, "i32", True, 16) is None  # None: Triton compiles (True would skip)
        watch.uninstall()
        assert getattr(owner, attribute) is None
    finally:
        setattr(owner, attribute, original)
