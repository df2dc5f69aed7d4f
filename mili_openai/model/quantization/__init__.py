"""Quantized weights: the schemes (`spec`; compressed-tensors' in `compressed_tensors`), their numbers
(`dynamic`; int8 activations of W8A8 checkpoints in `activations`), the `Linear` variants that hold them
(`modules`), pre-quantized checkpoint formats (`formats`) and putting them into a model (`apply`)."""
