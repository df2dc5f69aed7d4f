"""Quantized weights: the schemes (`spec`), their numbers (`dynamic`), the `Linear` variants that hold them
(`modules`), pre-quantized checkpoint formats (`formats`) and putting them into a model (`apply`)."""
