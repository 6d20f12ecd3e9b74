"""Training utilities: tokenizers, datasets and the data-parallel batch sampler."""
