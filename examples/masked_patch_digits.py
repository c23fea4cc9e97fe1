"""Does masked patch prediction help? Pre-train on unlabeled digits, fine-tune on a few labels.

    python examples/masked_patch_digits.py          # the measured setting: ~12.6 CPU-minutes
    python examples/masked_patch_digits.py --seeds 0 1 2 3 4 --labels-per-class 20

scikit-learn's handwritten digits (offline), split as `keras_vit.data.tfdata.load_digits` (1438
train / 359 test). For every seed: `keras_vit.training.pretrain.pretrain` trains `vit_digits` by masked
patch prediction on the TRAIN images without their labels (the paper's task: 50% of patch
embeddings corrupted, 80/10/10, 3-bit mean colour targets); then the same classifier is
fine-tuned twice on `--labels-per-class` labelled train images per class (drawn with the
seed) -- once from the pre-trained backbone (`keras_vit.training.pretrain.to_classifier`), once from
scratch, with the same seed, steps, optimizer and data order -- and both are evaluated on the
359 held-out test images, which neither stage ever sees. Prints a table and writes JSON.

Measured with the defaults (vit_digits at 16 px: a 4x4 grid of 4-px patches, 16 tokens; 1500
pre-training steps of 64 images, Adam with peak LR 1e-3 -- the paper's 2e-4 is for 1M steps
of 4096 images and was not tried here; fine-tuning 200 steps of 32 images with the AdamW
recipe, LR 1e-3, mean-pooled tokens, 10 labels per class; seeds 0, 1, 2):

    from scratch               68.06% +- 3.78%
    masked-patch pre-trained   81.71% +- 1.79%    gain +13.65 +- 2.10 points, 3/3 seeds

Pre-training length matters: 800 steps (with SGD fine-tuning) or 1000 steps gave no reliable
gain (-0.3 and +3.0 points on average), and 1500 steps of 32 images fell short of 64 (seed 0).
Fine-tuning recipes were compared on train images outside the labelled subset (not the test
split): AdamW 1e-3 was best for both starts; SGD 0.03 (the paper's fine-tuning optimizer) gave
smaller but clear gains there (+10 to +12 points on 2 seeds, against +13 to +16 for AdamW).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_vit import VARIANTS, build_vit  # noqa: E402
from keras_vit.data import tfdata as data  # noqa: E402
from keras_vit.training import optimization, pretrain  # noqa: E402
from keras_vit.utils import defaults  # noqa: E402


def labelled_subset(source: data.Source, per_class: int, seed: int) -> data.Source:
    """`per_class` examples of each class of `source`, drawn with `seed`."""
    images, labels = map(np.stack, zip(*source.dataset.as_numpy_iterator(), strict=True))
    rng = np.random.default_rng(seed)
    picked = np.concatenate(
        [rng.choice(np.flatnonzero(labels == c), per_class, replace=False) for c in range(10)]
    )
    return data.from_arrays(images[picked], labels[picked], num_classes=10)


class Progress(keras.callbacks.Callback):
    """One line every `every` steps: what runs, the step, the loss and the time since the start."""

    def __init__(self, what: str, total: int, every: int, started: float):
        super().__init__()
        self.what, self.total, self.every, self.started = what, total, every, started

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step % self.every == 0 or step == self.total:
            loss = (logs or {}).get("loss")
            shown = f", loss {float(loss):.3f}" if loss is not None else ""
            elapsed = time.perf_counter() - self.started
            print(f"  {self.what}: step {step}/{self.total}{shown} ({elapsed:.0f} s)", flush=True)


def fine_tune(
    model: keras.Model,
    subset: data.Source,
    test: data.Source,
    args: argparse.Namespace,
    seed: int,
    progress: keras.callbacks.Callback,
) -> float:
    """Fine-tune `model` on `subset` (same recipe for every start) and return its test accuracy."""
    if args.optimizer == "sgd":
        optimizer = optimization.finetuning_optimizer(
            args.finetune_steps, learning_rate=args.finetune_lr, warmup_steps=args.finetune_steps // 10
        )
    else:
        optimizer = optimization.pretraining_optimizer(
            args.finetune_steps,
            learning_rate=args.finetune_lr,
            weight_decay=0.05,
            warmup_steps=args.finetune_steps // 10,
            decay="cosine",
        )
    model.compile(optimizer=optimizer, loss=optimization.loss(), metrics=["accuracy"])
    model.optimizer.build(model.trainable_variables)
    size = (args.image_size, args.image_size)
    stream = data.train_pipeline(
        subset, image_size=size, batch_size=args.batch_size, seed=seed, steps_per_epoch=args.finetune_steps,
        crop_scale=(0.7, 1.0), flip=False,
    )  # fmt: skip
    model.fit(
        stream, epochs=1, steps_per_epoch=args.finetune_steps, shuffle=False, verbose=0, callbacks=[progress]
    )
    # Plain resize as train_pipeline does it (one TF pass), the preprocessing the README's numbers used.
    spec = data.Preprocessing(size, crop_pct=None, interpolation="bilinear", resampler="tensorflow")
    held_out = data.eval_pipeline(test, spec, batch_size=256)
    return float(model.evaluate(held_out, verbose=0)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--labels-per-class", type=int, default=10)
    parser.add_argument("--image-size", type=int, default=16, help="digits are 8x8; patches of 4 px")
    parser.add_argument("--pretrain-steps", type=int, default=1500)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--pretrain-batch", type=int, default=64)
    parser.add_argument("--target", choices=defaults.MPP_TARGETS, default="mean_color")
    parser.add_argument("--finetune-steps", type=int, default=200)
    parser.add_argument("--finetune-lr", type=float, default=1e-3)
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    parser.add_argument("--pooling", choices=("token", "gap"), default="gap")
    parser.add_argument("--batch-size", type=int, default=32, help="fine-tuning batch")
    parser.add_argument("--output", default="masked_patch_digits.json")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    train, test = data.load_digits()
    config = VARIANTS["vit_digits"]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            print(f"seed {seed}: masked-patch pre-training, {args.pretrain_steps} steps", flush=True)
            every = max(1, args.pretrain_steps // 10)
            result = pretrain.pretrain(
                config, train, output_dir=os.path.join(scratch, f"mpp-{seed}"), image_size=args.image_size,
                batch_size=args.pretrain_batch, steps=args.pretrain_steps, steps_per_epoch=100,
                learning_rate=args.pretrain_lr, target=args.target, crop_scale=(0.7, 1.0), flip=False,
                strategy="default", seed=seed, verbose=0,
                callbacks=[Progress("pre-training", args.pretrain_steps, every, started)],
            )  # fmt: skip
            subset = labelled_subset(train, args.labels_per_class, seed)
            finetune_every = max(1, args.finetune_steps // 2)
            keras.utils.set_random_seed(seed)
            # Logits (classifier_activation=None): optimization.loss() is a cross-entropy from logits.
            pretrained = fine_tune(
                pretrain.to_classifier(result.model, 10, pooling=args.pooling, classifier_activation=None),
                subset, test, args, seed,
                Progress("fine-tuning the pre-trained model", args.finetune_steps, finetune_every, started),
            )  # fmt: skip
            keras.utils.set_random_seed(seed)
            scratch_model = build_vit(
                config,
                image_size=args.image_size,
                num_classes=10,
                pooling=args.pooling,
                classifier_activation=None,
            )
            from_scratch = fine_tune(
                scratch_model, subset, test, args, seed,
                Progress("fine-tuning from scratch", args.finetune_steps, finetune_every, started),
            )  # fmt: skip
            rows.append(
                {
                    "seed": seed,
                    "scratch": from_scratch,
                    "pretrained": pretrained,
                    "pretrain_loss": result.report["loss"],
                    "pretrain_patch_accuracy": result.report["patch_accuracy"],
                }
            )
            print(
                f"seed {seed}: scratch {from_scratch:.2%}  masked-patch pre-trained {pretrained:.2%}  "
                f"(pre-training loss {result.report['loss']:.3f}, patch accuracy "
                f"{result.report['patch_accuracy']:.2%}; {time.perf_counter() - started:.0f} s)",
                flush=True,
            )
    scratch_acc = np.array([row["scratch"] for row in rows])
    pretrained_acc = np.array([row["pretrained"] for row in rows])
    gains = pretrained_acc - scratch_acc
    summary = {
        "scratch_mean": float(scratch_acc.mean()),
        "scratch_std": float(scratch_acc.std(ddof=1)) if len(rows) > 1 else 0.0,
        "pretrained_mean": float(pretrained_acc.mean()),
        "pretrained_std": float(pretrained_acc.std(ddof=1)) if len(rows) > 1 else 0.0,
        "gain_mean": float(gains.mean()),
        "gain_std": float(gains.std(ddof=1)) if len(rows) > 1 else 0.0,
        "seeds_improved": int((gains > 0).sum()),
    }
    print(f"\n{'start':<34} test accuracy (mean ± std over {len(rows)} seeds)")
    print(f"{'from scratch':<34} {summary['scratch_mean']:.2%} ± {summary['scratch_std']:.2%}")
    print(
        f"{'masked-patch pre-trained':<34} {summary['pretrained_mean']:.2%} ± {summary['pretrained_std']:.2%}"
    )
    print(
        f"{'gain':<34} {summary['gain_mean']:+.2%} ± {summary['gain_std']:.2%} "
        f"({summary['seeds_improved']}/{len(rows)} seeds improved)"
    )
    report = {
        "summary": summary,
        "runs": rows,
        "settings": vars(args),
        "model": config.name,
        "test_examples": test.num_examples,
        "unlabeled_examples": train.num_examples,
        "seconds": round(time.perf_counter() - started, 1),
    }
    with open(args.output, "w", encoding="utf-8") as file:
        json.dump(report, file, indent=2)
    print(f"wrote {args.output} ({report['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
