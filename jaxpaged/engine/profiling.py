"""The engine's profiler (vLLM's `start_profile` / `stop_profile`), and where its device memory
went (`device_memory_stats`: in `get_stats()`, `/metrics` and the start-up log).

The trace: a `jax.profiler` trace of
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

from jaxpaged.parallel.mesh import bytes_per_device

logger = logging.getLogger("jaxpaged")


class ProfilerControls:
    """`LLMEngine`'s profiler methods."""

    _profile_dir: str | None = None
    _weights: tuple[int, int] = (0, 0)  # (id of the parameter state measured, its bytes)

    def device_memory_stats(self) -> dict[str, int]:
        """One device's memory by use, in bytes: the weights (the fullest device's, measured
        from the placed shards when the parameters change; 0 asleep), its KV pool and the
        share of it in use, and the largest compiled step's temporaries (XLA's memory analysis).
        """
        params = self.runner.params
        if self.is_sleeping():
            weights = 0
        elif self._weights[0] == id(params):
            weights = self._weights[1]
        else:
            weights = max(bytes_per_device(params).values(), default=0)
            self._weights = (id(params), weights)
        pool = self.plan.pool_bytes
        return {
            "device_weight_bytes": weights,
            "kv_cache_bytes": pool,
            "kv_cache_used_bytes": int(self.scheduler.kv_usage * pool),
            "step_temp_bytes": max(self.runner.temp_bytes.values(), default=0),
        }

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
