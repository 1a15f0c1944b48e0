"""llguidance, imported when a constraint first needs it: an engine without it (the GPU image,
which cannot install packages) still serves every unconstrained request."""

import types


def llguidance() -> types.ModuleType:
    """The `llguidance` module (with its `hf` and `numpy` parts loaded).

    Raises:
      ValueError: it is not installed, saying which requests need it and how to get it.
    """
    try:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
    except ModuleNotFoundError:
        raise ValueError(
            "structured_outputs, allowed_token_ids and bad_words need llguidance, which is not installed: "
            "pip install llguidance (a core dependency of jaxpaged)"
        ) from None
    return llguidance
