"""Mixtral's modules (declared in ``workers/families/mixtral.py``): Qwen3-MoE's mixture-of-experts blocks
(``workers/families/qwen3_moe_model.py``: the router, the grouped experts, expert parallelism, the
load-balancing loss) with the Llama family's attention, which has no q/k norms, and Mixtral's router.

Numerics follow ``transformers``' ``MixtralForCausalLM`` operation for operation. Where Mixtral differs
from Qwen3-MoE:

* the attention has no q/k norms (``LlamaAttention``: RoPE, grouped-query attention, no biases);
* the router always renormalises the top-k weights (softmax in fp32, top-k, divided by their sum) and keeps
  them in fp32, where Qwen3-MoE casts them to the logits' dtype: each pick's output is multiplied in fp32
  and cast back to the block input's dtype (the same in fp32, one rounding apart in bf16).
"""

from __future__ import annotations

from torch import nn

from etrain.workers.families.llama_model import LlamaAttention
from etrain.workers.families.qwen3_moe_model import Qwen3Moe, Qwen3MoeBlock
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["Mixtral", "MixtralBlock", "build"]


class MixtralBlock(Qwen3MoeBlock):
    attention_class = LlamaAttention
    router_options = {"renormalise": True, "fp32_weights": True}


class Mixtral(Qwen3Moe):
    """Qwen3-MoE's model (the Llama model, the load-balancing loss added to the training loss) with
    Mixtral's blocks."""

    block = MixtralBlock


def build(config: ModelConfig) -> nn.Module:
    return Mixtral(config)
