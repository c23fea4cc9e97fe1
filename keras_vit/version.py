"""The package version, in a module of its own so that modules below `keras_vit/__init__.py` can read it."""

__version__ = "0.2.0"
