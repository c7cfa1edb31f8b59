"""The config layer: the schema of every group, config -> objects (build), configs read from
files (checked against the schema), a trained run loaded for inference, and a configured
run's step estimated on fake tensors."""
