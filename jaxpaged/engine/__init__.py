"""The engine: `LLMEngine` (`llm_engine`) ties the host side (`jaxpaged.core`) to the device
worker (`jaxpaged.worker`); `setup` builds the model and sizes the KV pool at start-up.

`from jaxpaged.engine import LLMEngine` works; the import is lazy so that importing a sibling
module does not import JAX.
"""


def __getattr__(name: str):
    if name == "LLMEngine":
        from jaxpaged.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'jaxpaged.engine' has no attribute {name!r}")
