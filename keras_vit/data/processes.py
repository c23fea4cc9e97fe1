"""Which rows of each global batch this process reads: all of them, but in a multi-process JAX run
the block that Keras's distribution places on this process's devices. The input pipelines
(`keras_vit.data.pyinput`) read these rows; the run driver's distribution (`keras_vit.training.runs
.keras_distribution`) sets the layout they follow."""

from __future__ import annotations

import keras

__all__ = ["process_count", "process_rows"]


def process_count() -> int:
    """How many processes run together (1 but on JAX after `join_processes`)."""
    if keras.backend.backend() != "jax":
        return 1
    import jax

    return jax.process_count()


def process_rows(batch_size: int) -> slice:
    """The rows of each global batch of `batch_size` this process feeds to `fit` or `predict`.

    All of them in a one-process run. In a multi-process JAX run Keras builds the global batch
    from every process's local rows (`jax.make_array_from_process_local_data`): the rows the
    active distribution places on this process's devices, one block (JAX lists the devices
    process by process; with the batch axis split between processes, block `process_index`).
    """
    distribution = keras.distribution.distribution()
    if process_count() == 1 or distribution is None:
        return slice(0, batch_size)
    sharding = distribution.get_data_layout((batch_size,)).backend_layout
    local = sharding.addressable_devices_indices_map((batch_size,)).values()
    blocks = sorted({index[0].indices(batch_size)[:2] for index in local})  # (start, stop) per device
    if any(stop != start for (_, stop), (start, _) in zip(blocks, blocks[1:], strict=False)):
        raise ValueError(f"This process's devices hold the rows {blocks} of each batch, not one block.")
    return slice(blocks[0][0], blocks[-1][1])
