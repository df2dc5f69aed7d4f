"""Quantized weights: the schemes (`spec`; compressed-tensors' in `compressed_tensors`), their numbers
(`dynamic`), the `Linear` variants that hold them (`modules`), pre-quantized checkpoint formats (`formats`) and
putting them into a model (`apply`)."""
