"""Tensor parallelism's collectives over torch.distributed: NCCL on CUDA, gloo on CPU.

Below `model/` in the import order: the model's parallel layers call these, and know nothing of how the
ranks were started (see mili_openai.engine.tp_forward).
"""

from mili_openai.distributed.group import TensorParallelGroup, backend_for, init_tensor_parallel

__all__ = ["TensorParallelGroup", "backend_for", "init_tensor_parallel"]
