"""Every Hugging Face family against ``transformers``: same weights in, same logits out (fp32, unsharded).

Each case builds a tiny random model with ``transformers`` itself (no download), perturbs its
weights so no norm is trivially one, reads its config through ``etrain.workers.checkpoints.hf_config`` and copies its
state dict in through its family's name map. The Llama family: RoPE scaling (Llama 3.1), q/k/v/o biases
(Llama ``attention_bias``), q/k/v biases and tied embeddings (Qwen2), per-head q/k norms with a
``head_dim`` unlike ``hidden / heads`` (Qwen3), and GQA. OLMo 2: norms after attention and MLP, q/k
norms over the whole projection width, with and without biases and tied embeddings.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.hf_config import etrain_name, model_config_from_hf  # noqa: E402
from etrain.workers.engine.init import build_model, materialize  # noqa: E402
from etrain.workers.families.model import build_model_skeleton, cross_entropy_loss  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def _hf_model(arch: str):
    if arch == "llama":
        config = transformers.LlamaConfig(
            **COMMON,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        model = transformers.LlamaForCausalLM(config)
    elif arch == "mistral":
        config = transformers.MistralConfig(**COMMON, sliding_window=64)
        model = transformers.MistralForCausalLM(config)
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif arch == "olmo2":
        config = transformers.Olmo2Config(**COMMON, rope_theta=500000.0, rms_norm_eps=1e-6)
        model = transformers.Olmo2ForCausalLM(config)
    elif arch == "olmo2-bias-tied":
        config = transformers.Olmo2Config(
            **COMMON, attention_bias=True, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
        )
        model = transformers.Olmo2ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**COMMON, head_dim=32)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    raw = json.loads(config.to_json_string())
    raw["architectures"] = [type(model).__name__]
    return model.float().eval(), raw


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "olmo2-bias-tied"])
def test_logits_equal_transformers(arch: str) -> None:
    reference, raw = _hf_model(arch)
    config = model_config_from_hf(raw, seq_len=32)
    ours = build_model(config, seed=0).eval()
    state = {
        etrain_name(k, config.arch): v
        for k, v in reference.state_dict().items()
        if not (config.tie_embeddings and k == "lm_head.weight")
    }
    result = ours.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert result.missing_keys == (["output.weight"] if config.tie_embeddings else [])
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())
    assert sum(p.numel() for p in ours.parameters()) == families.num_params(config)

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    got = ours(tokens)
    want = reference(tokens, labels=tokens)  # transformers shifts the labels itself
    diff = (got - want.logits).abs().max().item()
    # the loss and every gradient too: the backward of each family's modules is transformers' as well
    loss = cross_entropy_loss(got[:, :-1], tokens[:, 1:])
    loss.backward()
    want.loss.backward()
    theirs = {etrain_name(k, config.arch): p.grad for k, p in reference.named_parameters()}
    pad = raw.get("pad_token_id")
    if pad is not None:  # transformers freezes the pad token's embedding row (padding_idx); etrain trains it
        ours.tok_embeddings.weight.grad[pad] = theirs["tok_embeddings.weight"][pad]
    grad_diff = max((p.grad - theirs[name]).abs().max().item() for name, p in ours.named_parameters())
    print(
        f"{arch}: max|logit diff| = {diff:.3g}, |loss diff| = {abs(loss.item() - want.loss.item()):.3g}, "
        f"max|grad diff| = {grad_diff:.3g}"
    )
    assert diff <= 1e-5 and abs(loss.item() - want.loss.item()) <= 1e-5 and grad_diff <= 1e-5


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "olmo2", "olmo2-bias-tied"])
def test_meta_device_build_materialises_the_same_weights(arch: str) -> None:
    _, raw = _hf_model(arch)
    config = model_config_from_hf(raw, seq_len=16)
    with torch.device("meta"):
        skeleton = build_model_skeleton(config)
    assert all(p.is_meta for p in skeleton.parameters())
    materialize(skeleton, device=torch.device("cpu"), seed=3, n_layers=config.n_layers)
    whole = build_model(config, seed=3)
    for (name, a), b in zip(skeleton.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), name
    if config.tie_embeddings:
        assert skeleton.output.weight is skeleton.tok_embeddings.weight
