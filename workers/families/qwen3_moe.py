"""Qwen3-MoE (``Qwen3MoeForCausalLM``): its declaration (pure; the modules are
``workers/families/qwen3_moe_model.py``).

Qwen3's attention (RoPE, grouped-query attention, per-head q/k RMSNorms, which this family always has)
with a sparse mixture-of-experts MLP in every block:

* **Router.** ``logits = x Wᵣᵀ`` (``n_experts`` outputs, no bias), a softmax in fp32, the top
  ``experts_per_token`` experts, their weights renormalised to sum to one when ``norm_topk_prob`` (the
  published models), then cast to the logits' dtype.
* **Experts.** ``n_experts`` SwiGLU MLPs of width ``moe_d_ff``, stored stacked (``[n_experts, ...]``, one
  parameter per projection: ``feed_forward.experts.w1/w3/w2``). Each token runs through its k experts
  and their outputs are weighted and summed. Capacity is unbounded: every (token, expert) pair the router
  picks is computed, none is dropped, whatever the balance.
* **Load-balancing loss.** Switch Transformer's, as ``transformers``' ``load_balancing_loss_func``
  computes it over the router logits of all layers of one forward: ``n_experts · Σₑ fₑ·Pₑ`` with ``fₑ`` the
  share of top-k picks and ``Pₑ`` the mean router probability of expert ``e``. The training loss is the
  language-model loss plus ``router_aux_loss_coef`` times it (``Qwen3MoeForCausalLM(...,
  output_router_logits=True)``'s loss). It is computed per micro-batch, like the LM loss, and averaged
  with it over gradient accumulation and data-parallel ranks (so one process and dp=2 train the same).

Tensor parallelism splits the attention as Llama's and every expert by its width (Megatron's expert tensor
parallelism: ``moe`` in :meth:`Qwen3Moe.tp_plan`, ``MoEParallel`` in ``workers/engine/parallelize.py``); expert
parallelism (``parallelism.ep``) splits the experts themselves: each of ep ranks borrowed from dp holds
``n_experts / ep`` of them and the tokens are exchanged by all-to-all (``workers/families/expert_parallel.py``).
Pipeline stages pass the running sum of their layers' routing statistics on with the activations (a
``[2, n_experts]`` tensor beside the hidden states: ``run_trunk``), so the last stage's load-balancing loss
sums every layer's, as one process's does, and its gradient flows back to each stage's router through the
pipeline's own backward. ``decoder_sparse_step`` other than 1 and ``mlp_only_layers`` (dense
blocks among the sparse ones; no published Qwen3-MoE uses them) are refused when reading ``model.hf``.

Numerics follow ``transformers``' ``Qwen3MoeForCausalLM`` (tests/unit/test_qwen3_moe.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

from etrain.workers.families.base import (
    Sizes,
    TPPlan,
    hf_decoder_config,
    hf_problem,
    hf_rope,
    hf_sizes,
    refuse_hidden_act,
)
from etrain.workers.families.llama import Llama, llama_widths, refuse_sliding_window

__all__ = ["FAMILY", "Qwen3Moe"]

_QWEN3_MOE_COMMON = dict(
    n_kv_heads=4,
    head_dim_override=128,
    vocab_size=151936,
    seq_len=4096,
    rope_theta=1000000.0,
    norm_eps=1e-6,
    qk_norm=True,
    n_experts=128,
    experts_per_token=8,
    norm_topk_prob=True,
    router_aux_loss_coef=0.001,
    max_position_embeddings=40960,
    hf_architecture="Qwen3MoeForCausalLM",
)


class Qwen3Moe(Llama):
    """Llama's attention counts and names (with q/k norms always), and the mixture-of-experts MLP."""

    name = "qwen3_moe"
    summary = (
        "Qwen3-MoE: Qwen3 attention (per-head q/k norms) and a sparse mixture-of-experts MLP (softmax top-k "
        "router, SwiGLU experts, load-balancing loss)"
    )
    model_module = "etrain.workers.families.qwen3_moe_model"
    mixture_of_experts = True
    context_parallel = True  # its attention is Llama's; the load-balancing loss sums its statistics over cp
    # Every parallel axis runs: under pipeline parallelism the routing statistics ride with the activations
    # to the last stage (workers/families/layers.py run_trunk), so the load-balancing loss is one process's.
    refused_axes: ClassVar[dict[str, str]] = {}
    # Qwen/Qwen3-30B-A3B's and Qwen/Qwen3-235B-A22B's published config.json, trained at 4096 tokens
    # (intermediate_size is the dense MLP width the configs state; every block of theirs is sparse).
    presets = {
        "qwen3-moe-tiny": dict(
            n_layers=2,
            d_model=64,
            n_heads=4,
            n_kv_heads=2,
            d_ff=96,
            vocab_size=256,
            seq_len=64,
            rope_theta=1000000.0,
            norm_eps=1e-6,
            qk_norm=True,
            n_experts=8,
            experts_per_token=2,
            moe_d_ff=32,
            norm_topk_prob=True,
            router_aux_loss_coef=0.001,
            hf_architecture="Qwen3MoeForCausalLM",
        ),
        "qwen3-30b-a3b": dict(_QWEN3_MOE_COMMON, n_layers=48, d_model=2048, n_heads=32, d_ff=6144, moe_d_ff=768),
        "qwen3-235b-a22b": dict(_QWEN3_MOE_COMMON, n_layers=94, d_model=4096, n_heads=64, d_ff=12288, moe_d_ff=1536),
    }
    hf_architectures = {"Qwen3MoeForCausalLM": {"model_type": "qwen3_moe"}}
    # Llama's attention and norm names; the dense MLP gives way to the router and the stacked experts.
    hf_layer_names = {
        **{name: hf for name, hf in Llama.hf_layer_names.items() if not name.startswith("feed_forward.")},
        "feed_forward.router.weight": "mlp.gate.weight",
    }
    hf_expert_names = {
        "feed_forward.experts.w1": "mlp.experts.{expert}.gate_proj.weight",
        "feed_forward.experts.w2": "mlp.experts.{expert}.down_proj.weight",
        "feed_forward.experts.w3": "mlp.experts.{expert}.up_proj.weight",
    }
    #: ``ModelConfig`` fields the modules fix whatever the config says (the counts read them through
    #: :meth:`_built`): Qwen3-MoE's attention always has its q/k norms.
    fixed_fields: ClassVar[dict[str, Any]] = {"qk_norm": True}
    #: Whether the router keeps its routing weights in fp32 (Mixtral's) instead of casting them to the
    #: logits' dtype (an activation count's difference in the bf16 regimes).
    fp32_routing_weights: ClassVar[bool] = False

    # -- parallelism -------------------------------------------------------------------------------

    def tp_dims(self, model: Sizes) -> tuple[tuple[str, int], ...]:
        """Whole query and key/value heads, each expert's width (``moe_d_ff``) and the vocabulary."""
        return (
            ("n_heads", model.n_heads),
            ("n_kv_heads", model.kv_heads),
            ("moe_d_ff", model.expert_dim),
            ("vocab_size", model.vocab_size),
        )

    def tp_plan(self, model: Sizes) -> TPPlan:
        """Llama's attention split, and the MLP as expert tensor parallelism (``moe``: the router replicated,
        every expert's gate/up column-split and down row-split by width, one all-reduce of the tokens' summed outputs)."""
        block = dict(Llama.tp_plan(self, self._built(model)).block)
        for name in ("feed_forward.w1", "feed_forward.w2", "feed_forward.w3"):
            del block[name]
        block["feed_forward"] = "moe"
        return TPPlan(root={"tok_embeddings": "vocab_embedding", "norm": "norm", "output": "vocab_head"}, block=block)

    # -- counts ------------------------------------------------------------------------------------

    def _built(self, model: Sizes) -> Sizes:
        """``model`` as the modules build it (:attr:`fixed_fields` in place of the config's)."""
        return _Fixed(model, self.fixed_fields)

    def _qk_norms(self, model: Sizes) -> int:
        """The per-head q/k RMSNorms' weights (``2 · head_dim``, replicated), where the attention has them."""
        return 2 * model.head_dim if self._built(model).qk_norm else 0

    def _attention_sharded(self, model: Sizes) -> int:
        """q, k, v and o (with their biases when ``attention_bias``): what a Megatron split would shard."""
        d = model.d_model
        q, kv = llama_widths(model)
        return d * q + 2 * d * kv + q * d + self._attention_bias(model)

    def _experts(self, model: Sizes) -> int:
        """Every expert's three SwiGLU matrices: ``3 · n_experts · d · moe_d_ff``."""
        return 3 * model.n_experts * model.d_model * model.expert_dim

    def expert_params_per_layer(self, model: Sizes) -> int:
        """``3 · n_experts · d · moe_d_ff``: what ``parallelism.ep`` splits (``n_experts / ep`` per rank)."""
        return self._experts(model)

    def num_params(self, model: Sizes) -> int:
        d, v, n = model.d_model, model.vocab_size, model.n_layers
        per_layer = (
            self._attention_sharded(model)
            + self._qk_norms(model)  # per-head q/k RMSNorm
            + 2 * d  # attention and MLP RMSNorms
            + model.n_experts * d  # router
            + self._experts(model)
        )
        head = d + (0 if model.tie_embeddings else v * d)
        return n * per_layer + v * d + head

    def layer_params(self, model: Sizes, tp: int = 1) -> float:
        """Every expert of the block (what one rank holds without expert parallelism, FSDP2 sharding them
        with the rest; under ``parallelism.ep`` the planner divides :meth:`expert_params_per_layer` by ep);
        the family refuses tp > 1, and a larger ``tp`` divides what a Megatron split
        would (attention, experts), the norms and the router replicated."""
        sharded = self._attention_sharded(model) + self._experts(model)
        if model.attention_bias == "all":
            sharded -= model.d_model  # wo's bias is replicated
        replicated = 2 * model.d_model + self._qk_norms(model) + model.n_experts * model.d_model
        replicated += model.d_model if model.attention_bias == "all" else 0
        return sharded / tp + replicated

    def largest_param(self, model: Sizes, *, first: bool = True, last: bool = True) -> int:
        """A stacked expert projection (``n_experts · d · moe_d_ff``) is one parameter, drawn whole."""
        d = model.d_model
        q, kv = llama_widths(model)
        candidates = [d * q, d * kv, model.n_experts * d, model.n_experts * d * model.expert_dim]
        if first or last:
            candidates.append(model.vocab_size * d)
        return max(candidates)

    def matmul_params_per_layer(self, model: Sizes, tp: int = 1) -> float:
        """Weights the block multiplies by, every expert's included (under autocast each stacked expert
        weight is cast to bf16 whole, whichever experts the tokens pick)."""
        d = model.d_model
        q, kv = llama_widths(model)
        return (2 * d * q + 2 * d * kv + self._experts(model)) / tp + model.n_experts * d

    def active_matmul_params_per_layer(self, model: Sizes) -> float:
        """What one token is multiplied by: attention, the router and its ``experts_per_token`` experts
        (MFU and the planner's step time count these, not the idle experts)."""
        d = model.d_model
        q, kv = llama_widths(model)
        experts = 3 * model.experts_per_token * d * model.expert_dim
        return 2 * d * q + 2 * d * kv + model.n_experts * d + experts

    def column_output_width(self, model: Sizes) -> int:
        """Per token, what selective checkpointing keeps of the matmul outputs besides ``wo``'s and one
        ``d_model``: wq, wk, wv; the router's logits; each picked expert's gate and up projections and
        its down projection (``k·d``, of which the generic count already has one ``d``)."""
        q, kv = llama_widths(model)
        k, f, d = model.experts_per_token, model.expert_dim, model.d_model
        return q + 2 * kv + model.n_experts + 2 * k * f + (k - 1) * d

    def layer_activation_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
        precision: str = "fp32",
        regime: str = "fp32",
        checkpointing: bool = False,
        compiled: bool = False,
    ) -> float:
        """What one Qwen3-MoE block (``workers/families/qwen3_moe_model.py``; Mixtral's too) saves for
        backward, per micro-batch, in bytes, checked against the tensors autograd saves
        (tests/unit/test_qwen3_moe.py, tests/unit/test_mixtral.py).

        Attention and its norms save what a Qwen3 block's (the Llama family's with q/k norms; Mixtral's
        without them) do; the MLP norm's output is read by the router alone (one bf16 cast under autocast,
        where Llama's SwiGLU keeps two). The MoE MLP, per token, with E = n_experts, k = experts_per_token, f = moe_d_ff and ``elem``
        the compute dtype's bytes:

        * the router's fp32 softmax (``4E``) and, for the load-balancing loss, the softmax in the logits'
          dtype (``elem·E`` in the bf16 regimes; in fp32 it is the same tensor, and nothing without the loss);
        * the routing: the top-k indices, the gather index, the weights' gather index and the inverse
          permutation (int64, ``4·8k``); the top-k weights and their sum when renormalised (``4k + 4``;
          Mixtral always renormalises);
        * per pick: the gathered input in the compute dtype (one copy for ``w1`` and ``w3``), the gate and
          up projections, silu's output and their product (``4f``), the down projection, all in the compute
          dtype, and its routing weight, in the compute dtype or in fp32 (``fp32_routing_weights``, Mixtral):
          ``k·elem·(2d + 4f + 1)``, or ``k·(elem·(2d + 4f) + 4)``;
        * per micro-batch, the experts' int32 row offsets (``4E``).

        Capacity is unbounded, so the per-pick tensors hold exactly ``k`` rows per token whatever the
        routing. Under tensor parallelism (expert width split, ``MoEParallel``) the attention's count is Llama's
        at that tp and each pick's ``4f`` is divided by tp; the rows, the summed outputs and the routing stay
        whole (checked at tp=2 against the saved tensors, tests/integration/test_expert_parallel.py). With
        activation checkpointing only the block input is saved. The autocast bf16 casts of
        the stacked expert weights are weights (``matmul_params_per_layer``), not activations.

        Compiled (``training.compile``; measured exactly at tp=1 under inductor's min-cut partitioner on
        CPU, where the experts run as one matmul each, in the three regimes, both families, with and without
        renormalisation and the load-balancing loss): attention and the norms as a compiled Qwen3 (or Llama)
        block keeps them, and per pick the gathered input, the gate and up projections and their product,
        and the down projection (``elem·(2d + 3f)``: silu's output is recomputed), the routing's int64
        indexes (``32``), the renormalised weight (``4``, where renormalised) and the routing weight
        (``elem``, or ``4`` in fp32); per token the router's fp32 softmax and the loss's copy, as eagerly.
        Under tensor parallelism (compiled with graph breaks at the experts' collectives) each pick's ``3f``
        is divided by tp, and autocast keeps a bf16 copy of the MLP's input at the break (measured at tp=2,
        with and without sequence parallelism).
        """
        s, b, d = model.seq_len, micro_batch, model.d_model
        tokens = s * b
        if checkpointing:
            return tokens * d * (2 if regime == "bf16_params" else 4) / (tp if sequence_parallel else 1)
        built = self._built(model)
        if compiled:
            return self._compiled_bytes(
                model, built, micro_batch=micro_batch, tp=tp, sp=sequence_parallel, regime=regime
            )
        attention_and_norms = Llama.layer_activation_bytes(
            self,
            built,
            micro_batch=micro_batch,
            tp=tp,
            sequence_parallel=sequence_parallel,
            regime=regime,
            checkpointing=False,
        )
        elem = 4 if regime == "fp32" else 2
        # the dense MLP Llama's count has (divided by tp), and w1/w3's second cast under autocast
        llama_mlp = 4 * model.ffn_dim * elem / tp + (2 * d if regime == "autocast" else 0)
        e, k, f = model.n_experts, model.experts_per_token, model.expert_dim
        router = 4 * e + (elem * e if regime != "fp32" and model.router_aux_loss_coef > 0 else 0)
        routing = 4 * 8 * k + (4 * k + 4 if built.norm_topk_prob else 0)
        # Under tensor parallelism a rank computes its f / tp of every expert's width; the rows and the
        # summed outputs are whole on every rank (MoEParallel), and so is the routing.
        experts = k * (elem * (2 * d + 4 * f / tp) + (4 if self.fp32_routing_weights else elem))
        return attention_and_norms + tokens * (router + routing + experts - llama_mlp) + 4 * e

    def _compiled_bytes(self, model: Sizes, built: Sizes, *, micro_batch: int, tp: int, sp: bool, regime: str) -> float:
        """:meth:`layer_activation_bytes` under ``training.compile`` (its docstring says what is kept)."""
        tokens, d = model.seq_len * micro_batch, model.d_model
        elem = 4 if regime == "fp32" else 2
        # the compiled Llama (or Qwen3) block less its dense MLP's compiled tensors (3·elem·f, sharded by tp)
        attention_and_norms = (
            Llama.layer_activation_bytes(
                self, built, micro_batch=micro_batch, tp=tp, sequence_parallel=sp, regime=regime, compiled=True
            )
            - tokens * 3 * elem * built.ffn_dim / tp
        )
        e, k, f = model.n_experts, model.experts_per_token, model.expert_dim
        router = 4 * e + (elem * e if regime != "fp32" and model.router_aux_loss_coef > 0 else 0)
        pick = elem * (2 * d + 3 * f / tp) + 32 + (4 if built.norm_topk_prob else 0)
        pick += 4 if self.fp32_routing_weights else elem
        # Under tp the experts' collectives run eagerly between the block's graphs (parallelize_stage), and
        # under autocast a bf16 copy of the MLP's input (d wide, on a sequence shard under sp) is kept at
        # that break (measured at tp=2: tests/integration/test_expert_parallel.py)
        at_break = 2 * d / (tp if sp else 1) if tp > 1 and regime == "autocast" else 0
        return attention_and_norms + tokens * (router + k * pick + at_break) + 4 * e

    # -- Hugging Face ------------------------------------------------------------------------------

    def config_from_hf(self, raw: dict[str, Any], architecture: str, *, seq_len: int | None) -> dict[str, Any]:
        sizes = hf_sizes(raw, seq_len=seq_len)
        refuse_hidden_act(raw)
        if int(raw.get("decoder_sparse_step", 1)) != 1:
            raise hf_problem(
                f"model.hf has decoder_sparse_step={raw['decoder_sparse_step']}: only every "
                f"{raw['decoder_sparse_step']}th block is sparse, and etrain's qwen3_moe makes every block sparse.",
                "use a Qwen3-MoE whose every block is a mixture of experts (decoder_sparse_step 1, as published)",
            )
        if raw.get("mlp_only_layers"):
            raise hf_problem(
                f"model.hf has mlp_only_layers={raw['mlp_only_layers']} (dense blocks among the sparse ones), "
                "which etrain's qwen3_moe does not build.",
                "use a Qwen3-MoE whose every block is a mixture of experts (mlp_only_layers [], as published)",
            )
        refuse_sliding_window(raw, sizes["seq_len"])
        try:
            experts = int(raw.get("num_experts", raw.get("num_local_experts")))
            moe = dict(
                n_experts=experts,
                experts_per_token=int(raw["num_experts_per_tok"]),
                moe_d_ff=int(raw["moe_intermediate_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise hf_problem(
                f"model.hf config.json lacks or mangles a mixture-of-experts size ({exc}).",
                "restore the config.json written by transformers (num_experts, num_experts_per_tok, "
                "moe_intermediate_size)",
            ) from exc
        return dict(
            sizes,
            **hf_rope(raw),
            **moe,
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            router_aux_loss_coef=float(raw.get("router_aux_loss_coef", 0.001)),
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            attention_bias="all" if raw.get("attention_bias") else "none",
            qk_norm=True,
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def hf_config(self, model: Sizes) -> dict[str, Any]:
        return hf_decoder_config(
            model,
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            moe_intermediate_size=model.expert_dim,
            num_experts=model.n_experts,
            num_experts_per_tok=model.experts_per_token,
            norm_topk_prob=model.norm_topk_prob,
            router_aux_loss_coef=model.router_aux_loss_coef,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            attention_bias=model.attention_bias == "all",
            use_sliding_window=False,
            sliding_window=None,
        )

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        biased = ("wq", "wk", "wv", "wo") if model.attention_bias == "all" else ()
        names = ["tok_embeddings.weight"]
        for i in range(model.n_layers):
            names.append(f"layers.{i}.attention_norm.weight")
            for proj in ("wq", "wk", "wv", "wo"):
                names.append(f"layers.{i}.attention.{proj}.weight")
                if proj in biased:
                    names.append(f"layers.{i}.attention.{proj}.bias")
            if self._built(model).qk_norm:
                names += [f"layers.{i}.attention.q_norm.weight", f"layers.{i}.attention.k_norm.weight"]
            names += [
                f"layers.{i}.ffn_norm.weight",
                f"layers.{i}.feed_forward.router.weight",
                f"layers.{i}.feed_forward.experts.w1",
                f"layers.{i}.feed_forward.experts.w2",
                f"layers.{i}.feed_forward.experts.w3",
            ]
        names.append("norm.weight")
        if not model.tie_embeddings:
            names.append("output.weight")
        return names


class _Fixed:
    """A view of a model's sizes with some fields fixed (a family's ``fixed_fields``)."""

    def __init__(self, model: Sizes, fixed: dict[str, Any]):
        self._model = model
        self._fixed = fixed

    def __getattr__(self, name: str) -> Any:
        return self._fixed[name] if name in self._fixed else getattr(self._model, name)


FAMILY = Qwen3Moe()
