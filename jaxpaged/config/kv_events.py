"""KV cache event publishing options with vLLM's names (`kv_events_config`), checked; no JAX here.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}

With events on, the engine tells subscribers (vLLM's router with `--policy kv_aware`, or any
ZeroMQ SUB socket) which prefix-cache blocks each tier holds: `jaxpaged.core.kv_events` records
them, `jaxpaged.engine.kv_event_publisher` sends them in vLLM's wire format.
"""

import dataclasses
from typing import Any

from jaxpaged.config.checks import json_object

PUBLISHERS = ("null", "zmq")


class KVEventsConfigError(ValueError):
    """A bad `kv_events_config`: names the key, its value and the fix."""


@dataclasses.dataclass(frozen=True)
class KVEventsConfig:
    """Resolved KV event options (vLLM's `KVEventsConfig`, the same keys and defaults).

    Attributes:
      enable_kv_cache_events: record block stored / removed / all cleared events.
      publisher: "zmq" (a PUB socket) or "null" (nothing recorded or sent); default "zmq" when
        events are on.
      endpoint: the PUB socket's address: with `*` (or `::`, ipc://, inproc://) it binds, else
        it connects to a subscriber's bound socket.
      replay_endpoint: a ROUTER socket a subscriber asks for the batches since a sequence
        number, or None.
      buffer_steps: batches kept for replay.
      hwm: the PUB socket's high-water mark (messages queued per subscriber before ZeroMQ drops).
      max_queue_size: batches waiting for the publisher's thread before the engine's step waits.
      topic: the first frame of every message (subscribers filter on it).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether events are recorded and sent to a socket."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "dict[str, Any] | str | KVEventsConfig | None") -> "KVEventsConfig | None":
        """A config from a dict or its JSON text (None: events off).

        Raises:
          KVEventsConfigError: not a JSON object, unknown keys, values of the wrong type.
        """
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = json_object(value, KVEventsConfigError, '{"enable_kv_cache_events": true}')
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise KVEventsConfigError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        enabled = value.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise KVEventsConfigError(f"enable_kv_cache_events={enabled!r} must be true or false")
        publisher = value.get("publisher") or ("zmq" if enabled else "null")
        if publisher not in PUBLISHERS:
            raise KVEventsConfigError(f"publisher={publisher!r} is not supported; use one of {', '.join(PUBLISHERS)}")
        values = dict(value, enable_kv_cache_events=enabled, publisher=publisher)
        for name in ("endpoint", "topic"):
            if not isinstance(values.get(name, ""), str):
                raise KVEventsConfigError(f"{name}={values[name]!r} must be a string")
        for name in ("endpoint", "replay_endpoint"):
            address = values.get(name)
            if address is not None and not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise KVEventsConfigError(
                    f"{name}={address!r} must be a ZeroMQ address such as tcp://*:5557 (bind) or "
                    "tcp://HOST:5557 (connect)"
                )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            number = values.get(name, 1)
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise KVEventsConfigError(f"{name}={number!r} must be a positive integer")
        return cls(**values)
