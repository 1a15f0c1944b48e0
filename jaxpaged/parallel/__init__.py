"""Tensor parallelism: the sharding table (`sharding`, no JAX: which axis of every parameter and
of the KV pool is split over which mesh axis) and its application to JAX arrays (`mesh`)."""
