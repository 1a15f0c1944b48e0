"""Which platform the programs being traced are for (the kernels compile for a GPU, interpret
elsewhere; the reference picks its loop by it)."""

import contextlib

import jax

_compile_target: str | None = None  # set by `compiling_for`


def target_platform() -> str:
    """The platform the programs being traced are for: JAX's default backend, or the platform
    `compiling_for` names while it is active."""
    return _compile_target or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str):
    """Traces inside this block are for `platform` ("gpu", "cpu"), whatever this machine's
    backend is: the kernels are compiled rather than interpreted for "gpu". For lowering, or
    compiling deviceless, for a GPU the machine lacks (process-wide: compile threads see it)."""
    global _compile_target
    previous, _compile_target = _compile_target, platform
    try:
        yield
    finally:
        _compile_target = previous
