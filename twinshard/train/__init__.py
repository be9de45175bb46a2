"""Training: the train step and state, optimizers, checkpoints, the data pipeline and tokenizers."""
