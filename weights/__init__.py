"""Data shipped with keras_vit: the checkpoint catalog and label sets (installed as `keras_vit.weights`)."""
