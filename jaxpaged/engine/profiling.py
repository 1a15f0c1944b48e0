"""The engine's profiler (vLLM's `start_profile` / `stop_profile`): a `jax.profiler` trace of
the process that runs the engine's steps (host threads and the device's kernels), written under
a directory the caller names, for TensorBoard's profile plugin, XProf or Perfetto
(`<dir>/plugins/profile/<run>/*.xplane.pb` and `*.trace.json.gz`).

On `LLMEngine` (mixed in) and so on `LLM`; the server calls them between two steps
(`--profiler-dir`, `POST /start_profile`, `POST /stop_profile`), in the engine-core process
when the engine runs there. Profile a few requests: traces grow with every step.
"""

import glob
import logging
import os

import jax

logger = logging.getLogger("jaxpaged")


class ProfilerControls:
    """`LLMEngine`'s profiler methods."""

    _profile_dir: str | None = None

    def start_profile(self, profile_dir: str) -> None:
        """Starts tracing this process into `profile_dir` (made if missing).

        Raises:
          RuntimeError: a trace is already running (stop it first).
          ValueError: `profile_dir` cannot be made or written.
        """
        if self._profile_dir is not None:
            raise RuntimeError(f"a profile is already being written to {self._profile_dir}; stop it first")
        try:
            os.makedirs(profile_dir, exist_ok=True)
        except OSError as err:
            raise ValueError(f"profile directory {profile_dir!r}: {err.strerror}") from None
        if not os.access(profile_dir, os.W_OK):
            raise ValueError(f"profile directory {profile_dir!r} is not writable")
        jax.profiler.start_trace(profile_dir)
        self._profile_dir = profile_dir
        logger.info("profiling into %s", profile_dir)

    def stop_profile(self) -> str:
        """Stops the trace and writes it; returns the directory of this run's files.

        Raises:
          RuntimeError: no trace is running.
        """
        if self._profile_dir is None:
            raise RuntimeError("no profile is running; start one first")
        profile_dir, self._profile_dir = self._profile_dir, None
        jax.profiler.stop_trace()
        runs = glob.glob(os.path.join(profile_dir, "plugins", "profile", "*"))
        run = max(runs, key=os.path.getmtime) if runs else profile_dir
        logger.info("profile written to %s", run)
        return run
