"""LoRA fine-tuning (Hu et al. 2021) of a ViT's attention and MLP projections with Keras's own LoRA.

`enable_lora(model, rank)` calls Keras's `enable_lora(rank)` on the chosen projections of every
`TransformerBlock` (by role: `"query"`, `"key"`, `"value"`, `"attention_output"`, `"fc1"`,
`"fc2"`; default query and value as in the paper) and freezes every other weight, biases and
LayerNorms included, except the `head`, which stays trainable unless `train_head=False`.

Keras adds to a kernel of shape `(..., n)` the factors `A` of shape `(..., rank)` (He-uniform)
and `B` of shape `(rank, n)` (zeros, so the model starts unchanged), and the layer computes with
`kernel + alpha / rank * A @ B`. For the 2-D kernels (`fc1` `(D, mlp_dim)`, `fc2` `(mlp_dim, D)`)
that is the paper's update, `rank * (inputs + outputs)` parameters. The attention kernels keep
the checkpoints' per-head layout: `query`/`key`/`value` `(D, heads, D/heads)` get `A` of shape
`(D, heads, rank)` and `B` `(rank, D/heads)` (a rank-`rank` update per head, `B` shared by the
heads: `rank * (D * heads + D/heads)` parameters), `attention_output` `(heads, D/heads, D)` gets
`A` `(heads, D/heads, rank)` and `B` `(rank, D)`, i.e. the paper's `rank * 2D`. `lora_parameter_count`
gives the exact count.

Works on quantized models too (int8 / int4 kernels, float32 factors: QLoRA-style). Saving
(`model.save`, `save_weights`) stores, as Keras does, the kernels with the LoRA product merged
in, so a `.keras` file loads as a plain model computing the same outputs; call `enable_lora`
again to go on training adapters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import keras

from keras_vit.models.layers import TransformerBlock
from keras_vit.utils import validation

__all__ = ["LORA_TARGETS", "enable_lora", "lora_layers", "lora_parameter_count", "max_lora_rank"]

LORA_TARGETS = ("query", "key", "value", "attention_output", "fc1", "fc2")
DEFAULT_TARGETS = ("query", "value")


def _blocks(model: keras.layers.Layer) -> list[TransformerBlock]:
    blocks = [layer for layer in model._flatten_layers() if isinstance(layer, TransformerBlock)]
    if not blocks:
        raise ValueError(f"{model.name} has no keras_vit TransformerBlock to adapt with LoRA.")
    if not all(block.built for block in blocks):
        raise ValueError(f"Build {model.name} (call it once) before enabling LoRA.")
    return blocks


def _check_targets(targets: str | Iterable[str]) -> tuple[str, ...]:
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    unknown = [target for target in targets if target not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"Unknown LoRA target(s) {unknown or targets!r}: use some of {LORA_TARGETS}.")
    return tuple(dict.fromkeys(targets))


def _by_role(block: TransformerBlock, role: str) -> keras.layers.Layer:
    attention = block.attention
    return {
        "query": attention.query_dense,
        "key": attention.key_dense,
        "value": attention.value_dense,
        "attention_output": attention.output_dense,
        "fc1": block.fc1,
        "fc2": block.fc2,
    }[role]


def lora_layers(
    model: keras.layers.Layer, targets: str | Sequence[str] = DEFAULT_TARGETS
) -> list[keras.layers.Layer]:
    """The `Dense` / `EinsumDense` layers of `model`'s blocks with the roles `targets`, block by block."""
    targets = _check_targets(targets)
    return [_by_role(block, role) for block in _blocks(model) for role in targets]


def _factor_sizes(layer: keras.layers.Layer) -> tuple[int, int]:
    """`(prod(leading), n)` of the kernel shape `(*leading, n)`: the rows of `A`, the columns of `B`."""
    shape = tuple(getattr(layer, "original_kernel_shape", None) or layer.kernel.shape)
    leading = 1
    for size in shape[:-1]:
        leading *= int(size)
    return leading, int(shape[-1])


def lora_parameter_count(model: keras.layers.Layer, rank: int, targets=DEFAULT_TARGETS) -> int:
    """The LoRA factors' parameter count `enable_lora(model, rank, targets)` adds (computed from the shapes).

    Per layer with kernel shape `(*leading, n)`: `prod(leading) * rank + rank * n`.
    """
    return sum(leading * rank + rank * n for leading, n in map(_factor_sizes, lora_layers(model, targets)))


def max_lora_rank(model: keras.layers.Layer, targets=DEFAULT_TARGETS) -> int:
    """The largest rank every adapted layer's update `A @ B` can reach: `min(prod(leading), n)` over them.

    A higher rank only adds parameters (and memory) that cannot change what the adapters compute.
    """
    return min(min(_factor_sizes(layer)) for layer in lora_layers(model, targets))


def enable_lora(
    model: keras.Model,
    rank: int,
    targets: str | Sequence[str] = DEFAULT_TARGETS,
    *,
    alpha: float | None = None,
    train_head: bool = True,
) -> keras.Model:
    """Add LoRA factors of `rank` to the `targets` projections of every block; freeze the rest.

    Args:
        model: a built keras_vit model (a `ViT`, or any model holding `TransformerBlock`s).
        rank: the factors' inner dimension (e.g. 4, 8, 16), at most `max_lora_rank(model, targets)`
            (a higher rank cannot change what the adapters compute; refused before allocating).
        targets: roles among `LORA_TARGETS`: `"query"`, `"key"`, `"value"`,
            `"attention_output"` (attention projections) and `"fc1"`, `"fc2"` (MLP).
            Default `("query", "value")`, the paper's choice.
        alpha: Keras's `lora_alpha`, a number > 0: the product is scaled by `alpha / rank`;
            default `rank` (scale 1).
        train_head: keep the `head` layer (a new task's classifier) trainable; `False`
            freezes it too.

    Returns `model`, changed in place: only the LoRA factors (and the head's trainable variables)
    are trainable, every other variable has `trainable=False`. Compile (or re-compile) it after
    this call.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive int, got {rank!r}.")
    if alpha is not None:  # alpha = 0 would scale the adapters' product to nothing: only the head would learn
        validation.positive_number("LoRA alpha", alpha)
    layers = lora_layers(model, targets)
    useful = max_lora_rank(model, targets)
    if rank > useful:  # checked before any factor is allocated
        megabytes = lora_parameter_count(model, rank, targets) * 4 / 2**20
        raise ValueError(
            f"LoRA rank {rank} is above {useful}, the largest rank the update of every adapted projection "
            f"({', '.join(_check_targets(targets))}) can have; its float32 factors would take "
            f"{megabytes:,.1f} MiB. Use a rank <= {useful} (LoRA ranks are usually 4 to 64)."
        )
    for layer in layers:
        layer.enable_lora(rank, lora_alpha=alpha)
    adapters = {id(layer.lora_kernel_a) for layer in layers} | {id(layer.lora_kernel_b) for layer in layers}
    head = next((layer for layer in model._flatten_layers() if layer.name == "head"), None)
    kept = {id(variable) for variable in head.weights} if train_head and head is not None else set()
    for variable in model.weights:
        if id(variable) in adapters:
            variable.trainable = True
        elif id(variable) not in kept:  # the head's keep their flag (a quantized kernel is not trainable)
            variable.trainable = False
    return model
