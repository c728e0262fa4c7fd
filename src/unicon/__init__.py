"""unicon: consistency training and evaluation for unified vision-language models."""

__version__ = "0.1.0"
