"""The built-in GPT-2-style decoder: its declaration (pure; the modules are ``workers/families/gpt_model.py``).

Learned positions, LayerNorm, GELU, biases on every projection, d_model x d_model attention
projections, an untied output head. No Hugging Face format.
"""

from __future__ import annotations

from etrain.workers.families.base import ModelFamily, Sizes, TPPlan
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
        compiled: bool = False,  # no compiled count of its own: the eager one (an overestimate)
    ) -> float:
        """Korthikanti's count adapted to ``workers/families/gpt_model.py`` (and checked against the
        tensors autograd saves): no dropout, so no masks, and fused ``scaled_dot_product_attention``, so
        no s x s scores, only an fp32 log-sum-exp per head and position. Per token it saves, in elements:
        replicated 4d (both LayerNorm inputs and outputs) plus the LayerNorms' fp32 mean and rstd;
        TP-sharded 4d + 2f (q, k, v, the attention output that ``wo`` reads, the GELU input and
        output). At f = 4d and 2 bytes that is Korthikanti's 34 sbh less the 2 sbh of dropout masks:
        sbh (8 + 24/t). Element size is 2 bytes (bf16) or 4 (fp32), from ``precision``. Sequence
        parallelism shards the replicated part too (Megatron's layout). With activation checkpointing
        only the block input (s·b·d) is saved."""
        elem = 2 if precision == "bf16" else 4
        s, b, d, f = model.seq_len, micro_batch, model.d_model, model.ffn_dim
        sp_div = tp if sequence_parallel else 1
        if checkpointing:
            return s * b * d * elem / sp_div
        replicated = (4 * d * elem + 2 * 2 * 4) * s * b / sp_div  # + two LayerNorms' fp32 mean and rstd
        sharded = s * b * (4 * d + 2 * f) * elem / tp
        log_sum_exp = 4 * model.n_heads * s * b / tp
        return replicated + sharded + log_sum_exp

    def final_norm_bytes(self, model: Sizes, *, tokens: int, regime: str, sp_div: int) -> float:
        return 2 * tokens * model.d_model * (4 if regime == "fp32" else 2) / sp_div

    def ring_attention_bytes(self, model: Sizes, *, micro_batch: int, regime: str, tp: int = 1) -> tuple[float, float]:
        """Context parallelism (``workers/families/ring_attention.py``), ``model.seq_len`` being a cp rank's
        ``c = S / cp`` tokens: the ring keeps what the fused kernel kept (q, k, v, the output, the fp32
        log-sum-exp), but its output is head-major, so ``wo`` reads a copy: ``d`` more elements per token.
        Transient: one block's fp32 scores and probabilities and their gradients, ``4 × batch·n_heads·c²·4``."""
        elem = 4 if regime == "fp32" else 2
        tokens = model.seq_len * micro_batch
        copy = tokens * model.d_model * elem / tp
        return float(copy), float(4 * micro_batch * model.n_heads * model.seq_len**2 * 4 / tp)

    def hf_parameter_names(self, model: Sizes) -> list[str]:
        raise ConfigError(
            "the built-in GPT has no Hugging Face format.",
            field="model.hf",
            fix="use a Hugging Face family (model.hf or a llama preset)",
        )


FAMILY = GPT()
