"""The built-in GPT-2-style decoder: its declaration (pure; the modules are ``workers/families/gpt_model.py``).

Learned positions, LayerNorm, GELU, biases on every projection, d_model x d_model attention
projections, an untied output head. No Hugging Face format.
"""

from __future__ import annotations

from etrain.workers.families.base import ModelFamily, Sizes, TPPlan, ring_block_kernel, ring_block_transient
from etrain.workers.protocol.errors import ConfigError

__all__ = ["FAMILY", "GPT"]


class GPT(ModelFamily):
    name = "gpt"
    #: parallelism.cp: its attention runs as a ring, positions embedded at each token's true position
    context_parallel = True
    summary = "the built-in GPT-2-style decoder: learned positions, LayerNorm, GELU, biases"
    model_module = "etrain.workers.families.gpt_model"
    presets = {
        "gpt-tiny": dict(n_layers=4, d_model=64, n_heads=4, vocab_size=256, seq_len=64),
        "gpt-mini": dict(n_layers=6, d_model=192, n_heads=6, vocab_size=256, seq_len=128),
        "gpt-small": dict(n_layers=12, d_model=768, n_heads=12, vocab_size=50304, seq_len=1024),
        "gpt-medium": dict(n_layers=24, d_model=1024, n_heads=16, vocab_size=50304, seq_len=1024),
        "gpt-1b": dict(n_layers=24, d_model=2048, n_heads=16, vocab_size=50304, seq_len=2048),
    }

    def shape_errors(self, model: Sizes) -> list[ConfigError]:
        if model.n_heads >= 1 and model.d_model % model.n_heads:
            return [
                ConfigError(
                    f"model.d_model={model.d_model} is not divisible by model.n_heads={model.n_heads}.",
                    field="model.d_model",
                    fix="pick d_model as a multiple of n_heads (head_dim = d_model / n_heads)",
                )
            ]
        return super().shape_errors(model)

    def tp_dims(self, model: Sizes) -> tuple[tuple[str, int], ...]:
        """Heads, the MLP width and the vocabulary, and d_model too (its q/k/v/out are d x d)."""
        return (
            ("n_heads", model.n_heads),
            ("d_model", model.d_model),
            ("ffn_dim", model.ffn_dim),
            ("vocab_size", model.vocab_size),
        )

    def tp_plan(self, model: Sizes) -> TPPlan:
        return TPPlan(
            root={
                "tok_embeddings": "vocab_embedding",
                "pos_embeddings": "position_embedding",
                "norm": "norm",
                "output": "vocab_head",
            },
            block={
                "attention_norm": "norm",
                "attention.wq": "colwise",
                "attention.wk": "colwise",
                "attention.wv": "colwise",
                "attention.wo": "rowwise",
                "ffn_norm": "norm",
                "feed_forward.w1": "colwise",
                "feed_forward.w2": "rowwise",
                "attention": "gather_sequence",
                "feed_forward": "gather_sequence",
            },
        )

    def num_params(self, model: Sizes) -> int:
        d, f, v, n = model.d_model, model.ffn_dim, model.vocab_size, model.n_layers
        per_layer = (
            2 * d  # attn norm (weight + bias)
            + 4 * d * d
            + 4 * d  # q, k, v, out projections with bias
            + 2 * d  # mlp norm
            + d * f
            + f
            + f * d
            + d  # mlp up, down with bias
        )
        embeddings = v * d + model.seq_len * d
        head = 2 * d + v * d  # final norm + output projection (no bias)
        return n * per_layer + embeddings + head

    def layer_params(self, model: Sizes, tp: int = 1) -> float:
        """Sharded by tp are q/k/v/out and MLP weights, q/k/v and up-projection biases; replicated are
        both LayerNorms (2 x 2d) and the biases of the row-parallel ``wo`` and ``w2`` (d each)."""
        d, f = model.d_model, model.ffn_dim
        sharded = 4 * d * d + 3 * d + 2 * d * f + f
        replicated = 2 * d + 2 * d + d + d
        return sharded / tp + replicated

    def embedding_params(self, model: Sizes, tp: int) -> float:
        """The vocab-parallel token embedding and the replicated position embedding."""
        return model.vocab_size * model.d_model / tp + model.seq_len * model.d_model

    def head_params(self, model: Sizes, tp: int, *, with_embedding: bool = False) -> float:
        """The final LayerNorm (weight and bias, replicated) and the vocab-parallel head."""
        return 2 * model.d_model + model.vocab_size * model.d_model / tp

    def largest_param(self, model: Sizes, *, first: bool = True, last: bool = True) -> int:
        d, f = model.d_model, model.ffn_dim
        candidates = [d * d, d * f, model.seq_len * d if first else 0]
        if first or last:
            candidates.append(model.vocab_size * d)
        return max(candidates)

    def matmul_params_per_layer(self, model: Sizes, tp: int = 1) -> float:
        d, f = model.d_model, model.ffn_dim
        return (4 * d * d + 2 * d * f) / tp

    def column_output_width(self, model: Sizes) -> int:
        return 3 * model.d_model + model.ffn_dim  # wq, wk, wv; w1

    def lookup_params(self, model: Sizes) -> int:
        return (model.vocab_size + model.seq_len) * model.d_model

    def position_params(self, model: Sizes) -> int:
        return model.seq_len * model.d_model

    def attention_width(self, model: Sizes) -> int:
        return model.d_model

    def layer_activation_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        tp: int = 1,
        sequence_parallel: bool = False,
        precision: str = "bf16",
        regime: str = "autocast",
        checkpointing: bool = False,
        compiled: bool = False,
    ) -> float:
        """Korthikanti's count adapted to ``workers/families/gpt_model.py``, checked against the tensors
        autograd saves in every regime, eager and compiled (tests/unit/test_planner.py): no dropout, so no
        masks, and fused ``scaled_dot_product_attention``, so no s x s scores, only an fp32 log-sum-exp per
        head and position. Per token, with ``r`` the residual stream's bytes (4, or 2 under
        ``bf16_params``) and ``e`` the compute dtype's (4 in fp32, else 2):

        * Each LayerNorm saves its input (``r·d``) and its mean and rstd (fp32; bf16 under ``bf16_params``).
          Its output is saved by the projections that read it: once in fp32 and ``bf16_params``, but under
          autocast (LayerNorm runs in fp32 there) as one bf16 cast per consumer: wq, wk, wv and w1, ``4·2d``.
          That per-consumer cast is 8d of autocast's 24d + 4f + 4H; the count once read the element size
          from ``precision`` alone and left it out (25% under for GPT-2 small's widths).
        * Tensor-parallel (sharded by ``tp``): q, k, v, the attention output ``wo`` reads, the GELU input
          and output, ``(4d + 2f)·e``, and the log-sum-exp, ``4H``.
        * Compiled (``training.compile``: inductor's partitioner, measured with its min-cut partitioning on
          CPU): each LayerNorm output once in the compute dtype, and ``wo``'s output (``e·d``) instead of the
          mid-block residual (recomputed from it); the same count as eager in fp32 and ``bf16_params``, 6d
          less under autocast.

        At f = 4d in ``bf16_params`` that is Korthikanti's 34 sbh less the 2 sbh of dropout masks: sbh
        (8 + 24/t). Sequence parallelism shards the norms' inputs and statistics; the projections save the
        gathered output (as for Llama). With activation checkpointing only the block input (s·b·d) is saved,
        in the residual stream's dtype (fp32 under autocast: the count once took bf16 from ``precision``)."""
        s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
        sp_div = tp if sequence_parallel else 1
        if regime not in ("fp32", "autocast", "bf16_params"):
            raise ValueError(f"regime must be fp32, autocast or bf16_params, got {regime!r}")
        residual = 2 if regime == "bf16_params" else 4
        if checkpointing:
            return s * b * d * residual / sp_div
        elem = 4 if regime == "fp32" else 2
        stats = 2 * 2 * (2 if regime == "bf16_params" else 4)  # two LayerNorms' mean and rstd
        if compiled:
            norm_inputs = residual * d + elem * d  # the block input and wo's output
            norm_outputs = 2 * elem * d
        else:
            norm_inputs = 2 * residual * d
            norm_outputs = 4 * 2 * d if regime == "autocast" else 2 * elem * d
        sharded = (4 * d + 2 * f) * elem + 4 * model.n_heads
        return s * b * ((norm_inputs + stats) / sp_div + norm_outputs + sharded / tp)

    def final_norm_bytes(self, model: Sizes, *, tokens: int, regime: str, sp_div: int) -> float:
        return 2 * tokens * model.d_model * (4 if regime == "fp32" else 2) / sp_div

    def ring_attention_bytes(
        self,
        model: Sizes,
        *,
        micro_batch: int,
        regime: str,
        tp: int = 1,
        device: str = "cuda",
        selective: bool = False,
        compiled: bool = False,
    ) -> tuple[float, float]:
        """Context parallelism (``workers/families/ring_attention.py``), ``model.seq_len`` being a cp rank's
        ``c = S / cp`` tokens: the ring keeps what the fused kernel kept (q, k, v, the output, the fp32
        log-sum-exp), so nothing more (under selective checkpointing too: an output in the compute dtype and
        its log-sum-exp, as the kernel's): its output is laid out token-major on every path, as the kernel's, and
        ``wo`` reads a view of it. Where its blocks run on the math path (:func:`ring_block_kernel`) the
        transient is larger: :func:`ring_block_transient`. Compiled (``compiled``) nothing more either: the
        positions are embedded before the blocks. Measured against autograd's saved tensors on CPU, eager and
        under the compiled partitioner (tests/integration/test_context_parallel.py)."""
        kernel = ring_block_kernel(device, fp32=regime == "fp32", head_dim=model.d_model // model.n_heads)
        transient = ring_block_transient(
            kernel, micro_batch=micro_batch, n_heads=model.n_heads, tokens=model.seq_len, q_width=model.d_model, tp=tp
        )
        return 0.0, float(transient)

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        raise ConfigError(
            "the built-in GPT has no Hugging Face format.",
            field="model.hf",
            fix="use a Hugging Face family (model.hf or a llama preset)",
        )


FAMILY = GPT()
