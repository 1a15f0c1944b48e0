"""Logging for Python API users, as vLLM does it: jaxpaged's start-up progress (loading, compiling,
the KV cache's size) shows on stderr at INFO unless the application configured logging itself.

- `JAXPAGED_CONFIGURE_LOGGING=0`: leave logging alone (the quiet switch; vLLM's is
  `VLLM_CONFIGURE_LOGGING=0`).
- `JAXPAGED_LOGGING_LEVEL=WARNING` (or DEBUG, INFO, ERROR): the level (default INFO).

An application that has put a handler on the root or the "jaxpaged" logger keeps its own setup.
The command line configures logging itself (`--log-level`).
"""

import logging
import os

CONFIGURE_ENV = "JAXPAGED_CONFIGURE_LOGGING"
LEVEL_ENV = "JAXPAGED_LOGGING_LEVEL"
LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def configure_default_logging() -> None:
    """Adds a stderr handler to the "jaxpaged" logger at `JAXPAGED_LOGGING_LEVEL` (default INFO),
    unless `JAXPAGED_CONFIGURE_LOGGING=0` or logging is already configured.

    Raises:
      ValueError: an unknown `JAXPAGED_LOGGING_LEVEL`, naming it.
    """
    if os.environ.get(CONFIGURE_ENV, "1") == "0":
        return
    logger = logging.getLogger("jaxpaged")
    if logger.handlers or logging.getLogger().handlers:
        return
    level = os.environ.get(LEVEL_ENV, "INFO").upper()
    if level not in LEVELS:
        raise ValueError(f"{LEVEL_ENV}={os.environ[LEVEL_ENV]!r}: use one of {', '.join(LEVELS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(level)
