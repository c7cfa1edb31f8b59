"""Training engine: trainer loop, evaluation, checkpoints, precision, optimizers."""
