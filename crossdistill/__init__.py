"""crossdistill: off-policy knowledge distillation of language models across tokenizers."""

__version__ = "0.1.0"
