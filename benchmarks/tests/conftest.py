"""The benches' tests share the suite's helpers; importing them first sets TRITON_INTERPRET where
there is no GPU, before any kernel is imported."""
import tests.conftest  # noqa: F401
