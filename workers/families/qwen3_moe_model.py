"""Qwen3-MoE's modules (declared in ``workers/families/qwen3_moe.py``): the Llama family's attention with
per-head q/k norms, and a sparse mixture-of-experts MLP in every block.

Numerics follow ``transformers``' ``Qwen3MoeForCausalLM`` (its default ``grouped_mm`` experts path)
operation for operation:

* the router: ``logits = F.linear(x, W)``, ``softmax(logits, dtype=float32)``, ``topk``, the top-k weights
  divided by their sum when ``norm_topk_prob``, cast to the logits' dtype (Mixtral's router, which
  ``workers/families/mixtral_model.py`` builds from these modules, always divides and keeps them fp32);
* the experts: the (token, pick) pairs sorted by expert, each expert's SwiGLU ``w2(silu(w1 x) * w3 x)`` on
  its run of rows (a grouped matmul), each output multiplied by its routing weight and cast to the
  block input's dtype, put back in token order and summed over the k picks. Capacity is unbounded: no
  pair is dropped;
* the load-balancing loss (``load_balancing_loss_func``): per layer, a softmax of the logits in their
  own dtype, its top-k, a histogram of the picks and the sum of the probabilities per expert; over the
  layers, ``n_experts · Σₑ (picksₑ / rows) · (probsₑ / rows)``.

Grouped matmuls: ``torch._grouped_mm`` where torch has a kernel for it (CUDA, bf16, compute capability
8.0+); elsewhere (CPU, fp32) a loop of one matmul per expert, written as a custom op
(``etrain::grouped_mm``) so that ``torch.compile(fullgraph=True)`` sees one opaque operation instead of
a data-dependent loop, with its own backward (every expert gets a gradient, zero for an expert no token
picked, so DDP sees every parameter used). Under autocast both run in the autocast dtype, like every
other matmul (torch's grouped matmul is not autocast-aware, so the casts are explicit).

A block returns ``(hidden, routing statistics)`` (the statistics only when the loss has a weight for
them); ``etrain.workers.families.layers.run_trunk`` collects them and asks the model's
:meth:`Qwen3Moe.auxiliary_loss` for the term it adds to the language-model loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from etrain.workers.families.expert_parallel import (
    copy_to_tensor_parallel,
    exchange_experts,
    gather_sequence_for_experts,
    local_tensor,
    reduce_from_tensor_parallel,
)
from etrain.workers.families.layers import RMSNorm
from etrain.workers.families.llama_model import Llama, LlamaAttention
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "GroupedExperts",
    "MoE",
    "Qwen3Moe",
    "Qwen3MoeAttention",
    "Qwen3MoeBlock",
    "Router",
    "build",
    "grouped_linear",
    "load_balancing_loss",
    "routing_statistics",
]


# -- grouped matmuls -------------------------------------------------------------------------------


@torch.library.custom_op("etrain::grouped_mm", mutates_args=())
def _grouped_mm_loop(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x[rows of e] @ w[e]ᵀ`` for each expert ``e``, whose rows end at ``offsets[e]`` (cumulative)."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):  # one host read for the whole loop
        if end > start:
            torch.mm(x[start:end], w[expert].t(), out=out[start:end])
        start = end
    return out


@_grouped_mm_loop.register_fake
def _(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("etrain::grouped_mm_backward", mutates_args=())
def _grouped_mm_loop_backward(
    grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input's and the weights' gradients of :func:`_grouped_mm_loop` (zero for an expert without rows)."""
    grad_x = torch.zeros_like(x)
    grad_w = torch.zeros_like(w)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[expert], out=grad_x[start:end])
            torch.mm(grad[start:end].t(), x[start:end], out=grad_w[expert])
        start = end
    return grad_x, grad_w


@_grouped_mm_loop_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, grad):
    x, w, offsets = ctx.saved_tensors
    grad_x, grad_w = torch.ops.etrain.grouped_mm_backward(grad.contiguous(), x, w, offsets)
    return grad_x, grad_w, None


_grouped_mm_loop.register_autograd(_backward, setup_context=_setup_context)


def _has_grouped_kernel(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` has a kernel for these operands: CUDA (compute capability 8.0+), bf16,
    and rows whose strides are multiples of 16 bytes."""
    return (
        x.device.type == "cuda"
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_properties(x.device).major >= 8  # constant-folded under torch.compile
        and x.shape[-1] % 8 == 0
        and w.shape[-2] % 8 == 0
    )


def compute_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """The dtype a grouped matmul runs in: autocast's where it is on (torch's grouped matmul is not
    autocast-aware, so the casts are explicit), else the narrower of the input's and the weights' (the
    weights' bf16 under FSDP2's mixed precision; under expert parallelism FSDP2 leaves the experts out,
    fp32, and the input's bf16 is what FSDP2 would have computed in)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype if x.dtype.itemsize < w.dtype.itemsize else w.dtype


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``[rows, in] × [experts, out, in] → [rows, out]``: each run of rows (sorted by expert, ending at the
    cumulative ``offsets``, int32) through its expert's weights, in :func:`compute_dtype`."""
    dtype = compute_dtype(x, w)
    x, w = x.to(dtype), w.to(dtype)
    if _has_grouped_kernel(x, w):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    return torch.ops.etrain.grouped_mm(x, w, offsets)


# -- the router, the experts, the load-balancing loss -----------------------------------------------


class Router(nn.Module):
    """``n_experts`` logits per token (no bias), softmax in fp32, top-k, optionally renormalised.

    ``renormalise``: divide the top-k weights by their sum (default: the config's ``norm_topk_prob``;
    Mixtral always does). ``fp32_weights``: keep the routing weights in fp32, as Mixtral's router does,
    instead of casting them to the logits' dtype (Qwen3-MoE's); the same in fp32, one rounding apart in bf16."""

    def __init__(self, config: ModelConfig, *, renormalise: bool | None = None, fp32_weights: bool = False):
        super().__init__()
        self.top_k = config.experts_per_token
        self.norm_topk_prob = config.norm_topk_prob if renormalise is None else renormalise
        self.fp32_weights = fp32_weights
        self.weight = nn.Parameter(torch.empty(config.n_experts, config.d_model))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x``: ``[tokens, d]``; returns the logits and their fp32 softmax ``[tokens, n_experts]``, the
        routing weights and the experts picked (``[tokens, k]`` each, the weights in the logits' dtype or
        fp32)."""
        logits = F.linear(x, local_tensor(self.weight))  # a replicated DTensor under tensor parallelism
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        weights, picks = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, probs, weights if self.fp32_weights else weights.to(logits.dtype), picks


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU MLPs stacked: ``w1`` (gate) and ``w3`` (up) ``[n_experts, moe_d_ff, d]``,
    ``w2`` (down) ``[n_experts, d, moe_d_ff]`` (each expert's slice is its ``nn.Linear`` weight)."""

    #: The dimension of each weight that tensor parallelism splits: the expert width ``moe_d_ff`` (Megatron's
    #: column split of gate and up, row split of down, per expert).
    tp_shard_dims = {"w1": 1, "w2": 2, "w3": 1}

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, d, f = config.n_experts, config.d_model, config.expert_dim
        self.w1 = nn.Parameter(torch.empty(e, f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))
        self.w3 = nn.Parameter(torch.empty(e, f, d))
        #: Set by the engine under tensor parallelism: the tp group over which each expert's width is split.
        self.tp_group = None
        #: Whether :class:`MoE` sums the tp ranks' partial outputs itself (an all-reduce); under sequence
        #: parallelism the engine reduce-scatters them along the sequence instead (``MoEParallel``).
        self.reduce_output = True

    def forward(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``x``: the picked rows sorted by expert; ``offsets``: where each expert's rows end. Under expert
        parallelism the weights are ``Shard(0)`` DTensors and this rank runs its local experts; under tensor
        parallelism each rank computes its slice of every expert's width, and the outputs are this rank's
        partial sums (:class:`MoE` sums them over tp once the picks are weighed and summed per token)."""
        w1, w2, w3 = local_tensor(self.w1), local_tensor(self.w2), local_tensor(self.w3)
        x = x.to(compute_dtype(x, w1))  # once for both projections that read it
        hidden = F.silu(grouped_linear(x, w1, offsets)) * grouped_linear(x, w3, offsets)
        return grouped_linear(hidden, w2, offsets)


def _histogram(picks: torch.Tensor, bins: int, top: int) -> torch.Tensor:
    """How many of ``picks`` fall on each expert, as fp32, by ``histc`` (no host sync, unlike ``bincount``):
    float input on the CPU, int on CUDA (the dtypes each supports deterministically), as transformers."""
    values = picks.reshape(-1)
    values = values.float() if values.device.type in ("cpu", "mps") else values.int()
    return torch.histc(values, bins=bins, min=0, max=top).float()


def routing_statistics(
    logits: torch.Tensor, n_experts: int, top_k: int, fp32_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """``[2, n_experts]`` of one layer for the load-balancing loss: the picks per expert and the summed
    router probability per expert, as ``load_balancing_loss_func`` computes them (the softmax in the
    logits' own dtype, its own top-k). ``fp32_probs``: the router's fp32 softmax, the same tensor when the
    logits are fp32 (then reused, not computed and saved twice)."""
    if fp32_probs is not None and logits.dtype == torch.float32:
        probs = fp32_probs
    else:
        probs = F.softmax(logits, dim=-1)
    _, picks = torch.topk(probs.detach(), top_k, dim=-1)  # counts only: no gradient flows through the picks
    return torch.stack([_histogram(picks, n_experts, n_experts), probs.float().sum(dim=0)])


@torch.compiler.disable  # a collective whose backward is another: run eagerly, as the token exchange
def _sum_over_group(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` summed over ``group``, differentiably (``torch.distributed.nn``'s all-reduce)."""
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(tensor, group=group)


def load_balancing_loss(
    statistics: list[torch.Tensor], n_experts: int, rows: int, *, layers: int | None = None
) -> torch.Tensor:
    """Switch Transformer's loss over every layer's :func:`routing_statistics` (``rows`` tokens each):
    ``n_experts · Σₑ (picksₑ / R) · (probsₑ / R)`` with ``R = rows · layers``, accumulated layer by layer in
    transformers' order. ``layers``: the layers ``statistics`` sums (default: one per entry; fewer entries
    when they are already sums over layers, as a pipeline's last stage receives them)."""
    picks = torch.zeros(n_experts, dtype=torch.float32, device=statistics[0].device)
    probs = torch.zeros_like(picks)
    for layer in statistics:
        picks = picks + layer[0]
        probs = probs + layer[1]
    total = float(rows * (len(statistics) if layers is None else layers))
    return torch.sum((picks / total) * (probs / total).unsqueeze(0)) * n_experts


class MoE(nn.Module):
    """The sparse MLP: route, run each token through its k experts, weigh and sum. No token is dropped.

    ``ep_group``: set by the engine's ``apply_ep`` under expert parallelism (the experts then hold this
    rank's ``n_experts / ep``): the rows are exchanged with the ranks that hold their experts
    (``etrain.workers.families.expert_parallel``); None runs every expert here. ``sequence_group``: set by
    the engine under tensor and sequence parallelism (``MoEParallel``): the input is then this rank's
    sequence shard, gathered whole here (the experts' share of its gradient reduce-scattered back).
    ``router_options``: the family's :class:`Router` settings."""

    def __init__(self, config: ModelConfig, **router_options: bool):
        super().__init__()
        self.ep_group = None
        self.sequence_group = None
        self.n_experts = config.n_experts
        self.top_k = config.experts_per_token
        self.with_statistics = config.router_aux_loss_coef > 0
        self.router = Router(config, **router_options)
        self.experts = GroupedExperts(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        tp_group = self.experts.tp_group
        if self.sequence_group is not None:  # a sequence shard: gathered whole, the experts' copy apart
            x, source = gather_sequence_for_experts(x, self.sequence_group)
        else:
            source = x
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        logits, probs, weights, picks = self.router(flat)
        expert_ids = picks.reshape(-1)  # [tokens·k]: token t's picks at t·k ... t·k + k - 1
        sorted_ids, order = torch.sort(expert_ids, stable=True)
        counts = _histogram(sorted_ids, self.n_experts, self.n_experts - 1)
        source = source.reshape(-1, d)
        if tp_group is not None:  # the experts' slices each see every row and give it a partial gradient
            weights = copy_to_tensor_parallel(weights, tp_group)
            if self.sequence_group is None:  # (under sequence parallelism the gather's backward sums it)
                source = copy_to_tensor_parallel(source, tp_group)
        rows = source[order // self.top_k]
        if self.ep_group is None:
            out = self.experts(rows, torch.cumsum(counts, dim=0, dtype=torch.int32))
        else:
            out = exchange_experts(rows, counts, self.experts, self.ep_group)
        # each pick weighted and cast to the input's dtype, then summed (transformers: index_add_ into it)
        out = (out * weights.reshape(-1)[order].unsqueeze(-1)).to(x.dtype)
        out = out[torch.argsort(order)]  # back to token order
        out = out.view(-1, self.top_k, d).sum(dim=1).view(batch, seq, d)
        if tp_group is not None and self.experts.reduce_output:
            # The tp ranks' partial outputs summed once per token, after the weighing and the sum over the k
            # picks (both linear): one all-reduce of [tokens, d] where summing the picked rows would reduce
            # k times as many (Megatron's ETP reduces the expert outputs; the order is free, the sum is the same).
            out = reduce_from_tensor_parallel(out, tp_group)
        if not self.with_statistics:
            return out
        return out, routing_statistics(logits, self.n_experts, self.top_k, probs)


# -- the model ---------------------------------------------------------------------------------------


class Qwen3MoeAttention(LlamaAttention):
    """Qwen3's attention: Llama's with per-head q/k RMSNorms, which Qwen3-MoE always has."""

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        if self.q_norm is None:
            self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.norm_eps)


class Qwen3MoeBlock(nn.Module):
    """Pre-norm attention, then the sparse MLP. A family with another attention or router (Mixtral's)
    subclasses it and sets :attr:`attention_class` and :attr:`router_options`."""

    attention_class: type[nn.Module] = Qwen3MoeAttention
    router_options: dict[str, bool] = {}

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = self.attention_class(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = MoE(config, **self.router_options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x))
        out = self.feed_forward(self.ffn_norm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out


class Qwen3Moe(Llama):
    """The Llama model with mixture-of-experts blocks; the training loss adds the load-balancing loss.

    ``last_load_balancing_loss``: the (unweighted, detached) load-balancing loss of the latest forward,
    transformers' ``aux_loss``; None when ``router_aux_loss_coef`` is 0 (nothing is computed for it)."""

    block = Qwen3MoeBlock

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.last_load_balancing_loss: torch.Tensor | None = None
        #: Set by the engine's ``apply_cp`` under context parallelism: the cp ranks that hold the other
        #: tokens of this forward's sequences.
        self.statistics_group = None

    def auxiliary_loss(self, statistics: list[torch.Tensor], rows: int, layers: int | None = None) -> torch.Tensor:
        """``router_aux_loss_coef`` × the load-balancing loss of this forward's layers (``rows`` tokens).

        Under context parallelism a rank routes ``S / cp`` tokens of each sequence, and the loss is a product
        of means over all of them (transformers' ``load_balancing_loss_func`` over the whole batch): the
        per-layer sums are added up over the cp ranks first. The sum is autograd's (its backward sums the
        cp ranks' identical gradients of the shared loss, which the gradient average over dp·cp turns back
        into exactly one process's gradient). ``layers``: how many layers ``statistics`` covers (a pipeline's
        last stage gets one entry, the sum over every layer: ``run_trunk``); by default one per entry."""
        if self.statistics_group is not None:
            group = self.statistics_group
            summed = _sum_over_group(torch.stack(statistics), group)
            statistics = list(summed.unbind(0))
            rows *= torch.distributed.get_world_size(group)
        loss = load_balancing_loss(statistics, self.config.n_experts, rows, layers=layers)
        self.last_load_balancing_loss = loss.detach()
        return self.config.router_aux_loss_coef * loss


def build(config: ModelConfig) -> nn.Module:
    return Qwen3Moe(config)
