"""What the mixture-of-experts families' unit tests share (tests/unit/test_qwen3_moe.py, test_mixtral.py):
a tiny random ``transformers`` model against etrain's, and the bytes autograd saves for one block.

Never a download: the ``transformers`` model is built from a config made in the test.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from etrain.service.planning.plan_activations import rope_table_bytes
from etrain.workers import families
from etrain.workers.checkpoints.hf_config import model_config_from_hf
from etrain.workers.engine.init import build_model
from etrain.workers.protocol.run_config import ModelConfig
from tests.autograd_utils import saved_bytes

TOL = 1e-5


def random_hf_model(model_class, config) -> tuple[torch.nn.Module, dict]:
    """A ``transformers`` model of ``config`` with N(0, 0.1) weights (no norm trivially one), fp32, eval, and
    its ``config.json`` as a dict."""
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    raw = json.loads(config.to_json_string())
    raw["architectures"] = [model_class.__name__]
    return model.float().eval(), raw


def etrain_state(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """transformers' in-memory state dict under etrain's names. In memory transformers 5 holds every MoE
    family's experts fused (``mlp.experts.gate_up_proj`` [E, 2f, d]: etrain's ``w1`` and ``w3`` its halves;
    ``down_proj`` [E, d, f]: ``w2``) and the router as ``mlp.gate`` (the files' own names, which the family
    maps, may differ: Mixtral's ``block_sparse_moe``)."""
    found = families.family(config.arch)
    f = config.expert_dim
    state = {}
    for name, tensor in hf_state.items():
        layer = name.removeprefix("model.layers.").split(".")[0]
        if name.endswith("mlp.experts.gate_up_proj"):
            state[f"layers.{layer}.feed_forward.experts.w1"] = tensor[:, :f]
            state[f"layers.{layer}.feed_forward.experts.w3"] = tensor[:, f:]
        elif name.endswith("mlp.experts.down_proj"):
            state[f"layers.{layer}.feed_forward.experts.w2"] = tensor
        elif name.endswith("mlp.gate.weight"):
            state[f"layers.{layer}.feed_forward.router.weight"] = tensor
        elif not (config.tie_embeddings and name == "lm_head.weight"):
            state[found.etrain_name(name)] = tensor
    return state


@dataclass
class Comparison:
    """etrain's model against the ``transformers`` one on the same weights and batch."""

    config: ModelConfig
    logits: float  # max |logit difference|
    aux_loss: float  # |load-balancing loss difference| (transformers' aux_loss)
    loss: float  # |training loss difference| (LM loss + router_aux_loss_coef · aux loss)
    grads: float  # max |gradient difference| over every parameter
    ours_aux: float  # etrain's load-balancing loss
    lm_loss: float  # the language-model loss alone (transformers' logits)
    ours_loss: float

    def __str__(self) -> str:
        return f"logits {self.logits:.3g}, aux loss {self.aux_loss:.3g}, loss {self.loss:.3g}, grads {self.grads:.3g}"

    def within(self, tol: float = TOL) -> bool:
        return max(self.logits, self.aux_loss, self.loss, self.grads) <= tol


def compare_with_transformers(reference: torch.nn.Module, raw: dict, *, seq_len: int = 32) -> Comparison:
    """Reads ``raw`` (``reference``'s config.json) into a ``ModelConfig``, copies ``reference``'s weights into
    etrain's model (their parameter counts equal, and the family's count) and compares logits, the
    load-balancing loss, the training loss (``output_router_logits=True``) and every gradient on one batch."""
    config = model_config_from_hf(raw, seq_len=seq_len)
    ours = build_model(config, seed=0).eval()
    ours.load_state_dict(etrain_state(reference.state_dict(), config), strict=not config.tie_embeddings)
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in reference.parameters()) == families.num_params(config)

    vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (2, seq_len + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    # transformers' loss on the same targets etrain trains on (shift_labels: no shift of its own)
    want = reference(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
    with torch.no_grad():
        logits = ours(inputs)
    aux = ours.last_load_balancing_loss
    loss = ours(inputs, targets=targets)
    loss.backward()
    want.loss.backward()
    theirs = etrain_state({n: p.grad for n, p in reference.named_parameters()}, config)
    lm_only = torch.nn.functional.cross_entropy(want.logits.flatten(0, 1), targets.flatten())
    return Comparison(
        config=config,
        logits=(logits - want.logits).abs().max().item(),
        aux_loss=abs(aux.item() - want.aux_loss.item()),
        loss=abs(loss.item() - want.loss.item()),
        grads=max((p.grad - theirs[n]).abs().max().item() for n, p in ours.named_parameters()),
        ours_aux=aux.item(),
        lm_loss=lm_only.item(),
        ours_loss=loss.item(),
    )


class SummedBlock(torch.nn.Module):
    """A mixture-of-experts block as a model runs it: its input not a leaf (autocast caches a leaf's cast once
    for all its readers), its output and routing statistics (``(hidden, statistics)``) reduced to one
    scalar, so the backward reaches both (nothing the reductions add is saved)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x * 1)
        if not isinstance(out, tuple):
            return out.float().sum()
        return out[0].float().sum() + out[1][1].sum()


#: The Qwen3-MoE block whose saved activations are measured against the planner's count (one layer, widths
#: with room for a tp=2 split): tests/unit/test_qwen3_moe.py at tp=1, tests/integration/test_expert_parallel.py
#: at tp=2.
MEASURED_BLOCK = dict(
    arch="qwen3_moe",
    n_layers=1,
    d_model=128,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=256,
    seq_len=64,
    d_ff=176,
    n_experts=8,
    experts_per_token=2,
    moe_d_ff=64,
    norm_topk_prob=True,
    router_aux_loss_coef=0.01,
)


def saved_activation_bytes(
    block: torch.nn.Module, model: ModelConfig, regime: str, micro_batch: int = 2, *, compiled: bool = False
) -> int:
    """What autograd saves for one forward and backward of a mixture-of-experts ``block`` (initialised, in
    ``regime``: ``fp32``, ``autocast`` or ``bf16_params``), less what the planner counts elsewhere: the cached
    fp32 RoPE tables (module state) and autocast's bf16 weight casts (weights, not activations). ``compiled``:
    the block under inductor's min-cut partitioner (``aot_eager_decomp_partition``, no code generation)."""
    from etrain.workers.engine.init import initialize_parameters

    dtype = torch.bfloat16 if regime == "bf16_params" else torch.float32
    initialize_parameters(block, seed=0, n_layers=1)
    block = block.to(dtype)
    run = block
    if compiled:
        torch._dynamo.reset()  # a case each: more than dynamo's recompile limit
        run = torch.compile(block, backend="aot_eager_decomp_partition", fullgraph=True)
    x = torch.randn(micro_batch, model.seq_len, model.d_model, requires_grad=True, dtype=dtype)
    if compiled:
        saved_bytes(SummedBlock(run), x, autocast=regime == "autocast")  # compiles
    saved = saved_bytes(SummedBlock(run), x, autocast=regime == "autocast")
    # the cached fp32 RoPE tables are saved where the rotation runs in fp32: in fp32, and under autocast
    # where q and k leave their norms in fp32 (Qwen3-MoE; Mixtral has none, its q and k are autocast's bf16);
    # a compiled graph keeps only the inverse frequencies, a constant
    fp32_rotation = regime == "fp32" or (regime == "autocast" and block.attention.q_norm is not None)
    if compiled:
        rope = model.head_dim // 2 * 4
    else:
        rope = rope_table_bytes(model) if fp32_rotation else 0
    weights = sum(p.numel() for p in block.parameters() if p.ndim >= 2)
    casts = 2 * weights if regime == "autocast" else 0
    return saved - rope - casts
