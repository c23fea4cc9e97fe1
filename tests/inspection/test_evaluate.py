"""Few-shot linear evaluation: the closed form, the representation, and trained vs random features."""

import keras
import numpy as np
import pytest
from helpers import random_images

import keras_vit
from keras_vit.data import tfdata as data
from keras_vit.inspection import evaluate
from keras_vit.training import optimization

TINY = keras_vit.ViTConfig("vit_tiny_test", patch_size=2, hidden_size=32, depth=1, num_heads=2, mlp_dim=64)


@pytest.mark.parametrize("shape", [(30, 5), (5, 30)])  # primal (N >= D) and dual (D > N) solutions
def test_ridge_weights_match_lstsq(rng, shape):
    x = rng.normal(size=shape)
    y = rng.normal(size=(shape[0], 3))
    l2_reg = 0.7
    # Ridge regression = ordinary least squares on [X; sqrt(l2) I] W = [Y; 0].
    augmented_x = np.concatenate([x, np.sqrt(l2_reg) * np.eye(shape[1])])
    augmented_y = np.concatenate([y, np.zeros((shape[1], 3))])
    expected = np.linalg.lstsq(augmented_x, augmented_y, rcond=None)[0]
    np.testing.assert_allclose(evaluate.ridge_weights(x, y, l2_reg), expected, rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="l2_reg"):
        evaluate.ridge_weights(x, y, 0.0)


def test_least_squares_accuracy_on_a_hand_made_problem():
    # Three well-separated clusters in 2-D; the test points sit next to their centres.
    centres = np.array([[0.0, 5.0], [5.0, 0.0], [-5.0, -5.0]])
    train = np.repeat(centres, 2, axis=0) + np.array([[0.1, -0.1], [-0.1, 0.1]] * 3)
    labels = np.repeat(np.arange(3), 2)
    test = centres + 0.3
    assert evaluate.least_squares_accuracy(train, labels, test, np.arange(3), 3, l2_reg=1.0) == 1.0
    assert evaluate.least_squares_accuracy(train, labels, test, np.array([1, 2, 0]), 3, l2_reg=1.0) == 0.0


def test_feature_model_picks_the_pre_head_representation():
    with_pre_logits = keras_vit.build_vit(TINY, image_size=8, num_classes=4, representation_size=6)
    assert evaluate.feature_model(with_pre_logits).output_shape == (None, 6)
    plain = keras_vit.build_vit(TINY, image_size=8, num_classes=4)
    images = random_images(2, (8, 8))
    pooled = keras.Model(plain.input, plain.get_layer("pool").output)(images)
    np.testing.assert_allclose(evaluate.feature_model(plain)(images), pooled, rtol=1e-6)
    tokens = keras_vit.build_vit(TINY, image_size=8, include_top=False, pooling=None)
    np.testing.assert_allclose(evaluate.feature_model(tokens)(images), tokens(images)[:, 0], rtol=1e-6)


@pytest.fixture(scope="module")
def digits():
    return data.load_digits()


def _few_shot(model_or_fn, digits, **kwargs):
    train, test = digits
    return evaluate.few_shot(model_or_fn, train, test, shots=(5, 25), repeats=2, batch_size=2048, **kwargs)


@pytest.mark.slow
def test_few_shot_trained_model_beats_random_features(digits):
    keras.utils.set_random_seed(0)
    model = keras_vit.build_vit(TINY, image_size=8, num_classes=10, classifier_activation=None)  # logits
    untrained = _few_shot(model, digits)
    noise = _few_shot(lambda x: np.random.default_rng(0).normal(size=(len(x), 32)), digits, image_size=8)

    train, _ = digits
    images, labels = next(iter(data.eval_pipeline(train, image_size=8, batch_size=2048, crop_pct=None)))
    epochs, steps = 3, train.num_examples // 32
    model.compile(
        optimizer=optimization.pretraining_optimizer(
            epochs * steps, learning_rate=1e-2, warmup_steps=steps // 2
        ),
        loss=optimization.loss(),
    )
    model.fit(images, labels, batch_size=32, epochs=epochs, verbose=0)
    trained = _few_shot(model, digits)

    for shots in (5, 25):
        assert noise[shots] < 0.2  # chance is 0.1
        assert untrained[shots] > noise[shots] + 0.05  # even random ViT features carry signal
        assert trained[shots] > untrained[shots] + 0.15, (shots, trained, untrained)
    assert trained[25] > trained[5]


def test_few_shot_checks_its_inputs(digits):
    train, test = digits
    identity = lambda x: np.asarray(x).reshape(len(x), -1)  # noqa: E731
    with pytest.raises(ValueError, match="image_size is required"):
        evaluate.few_shot(identity, train, test)
    with pytest.raises(ValueError, match="fewer than 500 shots"):
        evaluate.few_shot(identity, train, test, image_size=8, shots=(500,))
    with pytest.raises(ValueError, match=r"\(batch, features\)"):
        evaluate.few_shot(lambda x: np.zeros(3), train, test, image_size=8)
