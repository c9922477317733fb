"""lmforge: pretrain, continue pretraining and fine-tune your own language model."""

__version__ = "0.1.0"
