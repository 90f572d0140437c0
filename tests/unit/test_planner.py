"""The planner, read as a specification: the seed notes' worked examples, each formula on its own,
monotonicity of memory and bubble, every rejection rule with its field, and auto-planning."""

from __future__ import annotations

import json
import math

import pytest

from service.errors import SpecRejected
from service.planner import (
    GiB,
    AutoPlan,
    bubble_fraction,
    bytes_per_param,
    check_plan,
    estimate,
    in_flight_microbatches,
    korthikanti_activation_bytes,
    layer_activation_bytes,
    layer_params,
    plan_report,
    precision_bytes,
    resolve_auto,
    stage_params,
)
from service.spec import JobSpec, ParallelismSpec
from workers.config import MODEL_PRESETS, ModelConfig

GB = 1e9


def make_spec(*, model="gpt-tiny", parallelism=None, training=None, resources=None, **model_sizes) -> JobSpec:
    body = {
        "name": "plan-test",
        "model": {"preset": model, **model_sizes},
        "training": {"steps": 10, "global_batch": 64, "micro_batch": 1, **(training or {})},
        "resources": resources or {},
    }
    if parallelism is not None:
        body["parallelism"] = parallelism
    return JobSpec.model_validate(body)


def gpu_spec(model="gpt-70b", parallelism=None, training=None, **resources) -> JobSpec:
    return make_spec(
        model=model,
        parallelism=parallelism,
        training={"global_batch": 512, "precision": "bf16", **(training or {})},
        resources={"device": "cuda", "gpus_per_worker": 1, **resources},
    )


def fields(problems) -> list[str]:
    return [p.field for p in problems]


# ---------------------------------------------------------------------------------------------
# The seed notes' worked examples
# ---------------------------------------------------------------------------------------------


class TestSeedExamples:
    @pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64])
    def test_zero_table_bytes_per_param(self, n):
        assert bytes_per_param(0, n) == 12
        assert bytes_per_param(1, n) == pytest.approx(4 + 8 / n)
        assert bytes_per_param(2, n) == pytest.approx(2 + 10 / n)
        assert bytes_per_param(3, n) == pytest.approx(12 / n)

    def test_13b_fp16_adam(self):
        n_params = 13e9
        assert bytes_per_param(0, 1) * n_params / GB == pytest.approx(156)  # does not fit an 80 GB A100
        assert bytes_per_param(2, 8) * n_params / GB == pytest.approx(42.25)
        assert bytes_per_param(3, 8) * n_params / GB == pytest.approx(19.5)
        assert bytes_per_param(1, 8) == pytest.approx(5)  # "2.4x reduction"

    def test_bytes_per_param_rejects_nonsense(self):
        with pytest.raises(ValueError, match="zero"):
            bytes_per_param(4, 8)
        with pytest.raises(ValueError, match="n"):
            bytes_per_param(1, 0)

    def test_bubble_p8_k32(self):
        assert bubble_fraction(8, 32) == pytest.approx(7 / 39)
        assert bubble_fraction(8, 32, "gpipe") == pytest.approx(7 / 39)

    def test_ring_all_reduce_example(self):
        # 200 MB over 16 GPUs moves 2*15/16*200 MB per GPU: the dp volume of ZeRO-0 below uses it.
        spec = make_spec(model="gpt-small", parallelism={"dp": 16}, training={"global_batch": 64})
        est = estimate(spec)
        grads = est.params_per_rank * precision_bytes("fp32")[1]
        assert est.comm.dp == pytest.approx(2 * 15 / 16 * grads, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------


class TestParameterCounts:
    @pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
    def test_stages_add_up_to_the_model(self, preset):
        model = ModelConfig(**MODEL_PRESETS[preset])
        whole = stage_params(model, layers=model.n_layers, first=True, last=True)
        assert whole == model.num_params
        half = model.n_layers // 2
        split = stage_params(model, layers=half, first=True, last=False) + stage_params(
            model, layers=model.n_layers - half, first=False, last=True
        )
        assert split == model.num_params

    def test_tensor_parallel_shards_match_the_module(self):
        """Column-parallel weights+biases and row-parallel weights are split; norms and row biases are not."""
        pytest.importorskip("torch")
        from workers.model import TransformerBlock

        model = ModelConfig(**MODEL_PRESETS["gpt-mini"])
        block = TransformerBlock(model)
        replicated = {"attention_norm.weight", "attention_norm.bias", "ffn_norm.weight", "ffn_norm.bias",
                      "attention.wo.bias", "feed_forward.w2.bias"}
        for tp in (1, 2, 3, 6):
            expected = sum(p.numel() if name in replicated else p.numel() / tp for name, p in block.named_parameters())
            assert layer_params(model, tp) == pytest.approx(expected)

    def test_embeddings_and_head_are_vocab_parallel(self):
        model = ModelConfig(**MODEL_PRESETS["gpt-small"])
        d, v, s = model.d_model, model.vocab_size, model.seq_len
        first = stage_params(model, tp=4, layers=0, first=True, last=False)
        last = stage_params(model, tp=4, layers=0, first=False, last=True)
        assert first == v * d / 4 + s * d  # position embedding replicated
        assert last == v * d / 4 + 2 * d  # final norm replicated, output column-parallel


class TestActivations:
    S, B, D, A = 2048, 2, 4096, 32

    def test_korthikanti_formulas(self):
        s, b, h, a = self.S, self.B, self.D, self.A
        kw = dict(seq_len=s, micro_batch=b, d_model=h, n_heads=a)
        assert korthikanti_activation_bytes(**kw) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
        assert korthikanti_activation_bytes(**kw, tp=8) == pytest.approx(
            s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
        assert korthikanti_activation_bytes(**kw, tp=8, sequence_parallel=True) == pytest.approx(
            s * b * h / 8 * (34 + 5 * a * s / h))

    def test_our_model_is_32_sbh_without_scores(self):
        """No dropout and fused attention: Korthikanti's 34 sbh less 2 sbh of masks, plus small fp32 stats."""
        model = ModelConfig(n_layers=2, d_model=self.D, n_heads=self.A, vocab_size=256, seq_len=self.S)
        sbd, sb = self.S * self.B * self.D, self.S * self.B
        lse, ln_stats = 4 * self.A * sb, 16 * sb
        bf16 = layer_activation_bytes(model, micro_batch=self.B, precision="bf16")
        assert bf16 == pytest.approx(32 * sbd + lse + ln_stats)
        assert layer_activation_bytes(model, micro_batch=self.B, precision="fp32") == pytest.approx(
            64 * sbd + lse + ln_stats)
        assert layer_activation_bytes(model, micro_batch=self.B, tp=4) == pytest.approx(
            sbd * (8 + 24 / 4) + lse / 4 + ln_stats)
        assert layer_activation_bytes(model, micro_batch=self.B, tp=4, sequence_parallel=True) == pytest.approx(
            (32 * sbd + lse + ln_stats) / 4)
        ac = layer_activation_bytes(model, micro_batch=self.B, checkpointing=True)
        assert ac == pytest.approx(2 * sbd)  # only the block input
        assert layer_activation_bytes(model, micro_batch=self.B, tp=4, sequence_parallel=True,
                                      checkpointing=True) == pytest.approx(2 * sbd / 4)

    @pytest.mark.parametrize("d_ff", [None, 96])
    def test_count_matches_what_autograd_saves(self, d_ff):
        """Sum the distinct non-parameter storages autograd saves for one block's backward (fp32, CPU)."""
        torch = pytest.importorskip("torch")
        from workers.model import TransformerBlock

        model = ModelConfig(n_layers=1, d_model=128, n_heads=4, vocab_size=256, seq_len=64, d_ff=d_ff)
        block = TransformerBlock(model)
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        saved: dict[int, int] = {}

        def pack(tensor):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        x = torch.randn(2, model.seq_len, model.d_model, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            block(x).sum().backward()
        assert sum(saved.values()) == layer_activation_bytes(model, micro_batch=2, precision="fp32")

    def test_in_flight_micro_batches_per_schedule(self):
        assert in_flight_microbatches("1f1b", pp=1, microbatches=16) == 1  # plain accumulation
        assert in_flight_microbatches("gpipe", pp=4, microbatches=16) == 16
        assert in_flight_microbatches("1f1b", pp=4, microbatches=16) == 4
        assert in_flight_microbatches("1f1b", pp=4, microbatches=2) == 2
        assert in_flight_microbatches("1f1b", pp=4, microbatches=16, stage=3) == 1
        # Megatron: interleaving holds P(1 + (P-1)/(P v)) micro-batches on stage 0.
        p, v = 4, 2
        assert in_flight_microbatches("interleaved_1f1b", pp=p, microbatches=16, virtual_stages=v) == pytest.approx(
            p * (1 + (p - 1) / (p * v)))


class TestBubble:
    def test_no_pipeline_no_bubble(self):
        assert bubble_fraction(1, 1) == 0

    @pytest.mark.parametrize("p", [2, 4, 8])
    def test_falls_with_micro_batches(self, p):
        values = [bubble_fraction(p, m) for m in (p, 2 * p, 4 * p, 16 * p)]
        assert values == sorted(values, reverse=True) and len(set(values)) == len(values)

    def test_interleaved_is_megatrons_bubble_over_v(self):
        p, m, v = 4, 8, 2
        fraction = bubble_fraction(p, m, "interleaved_1f1b", v)
        assert fraction == pytest.approx((p - 1) / (v * m + p - 1))
        # Megatron states it relative to the ideal time: (1/v)(P-1)/M.
        assert fraction / (1 - fraction) == pytest.approx((p - 1) / (v * m))
        assert fraction < bubble_fraction(p, m, "1f1b")


# ---------------------------------------------------------------------------------------------
# estimate()
# ---------------------------------------------------------------------------------------------


class TestEstimate:
    @pytest.mark.parametrize("precision", ["bf16", "fp32"])
    @pytest.mark.parametrize("zero", [0, 1, 2, 3])
    def test_model_states_follow_the_zero_table(self, precision, zero):
        spec = gpu_spec("gpt-13b", {"dp": 8, "zero": zero}, {"precision": precision})
        est = estimate(spec)
        pb, gb, ob = precision_bytes(precision)
        per_param = bytes_per_param(zero, 8, param_bytes=pb, grad_bytes=gb, optimizer_bytes=ob)
        states = est.memory.parameters + est.memory.gradients + est.memory.optimizer_states
        assert states == pytest.approx(per_param * est.num_params, rel=1e-6)

    def test_bf16_keeps_an_fp32_master_copy(self):
        assert precision_bytes("bf16") == (2, 2, 12)
        assert precision_bytes("fp32") == (4, 4, 8)

    def test_memory_falls_with_zero_stage(self):
        one_micro_batch = {"global_batch": 8}  # dp=8 x micro_batch=1: no accumulation
        totals = [estimate(gpu_spec("gpt-13b", {"dp": 8, "zero": z}, one_micro_batch)).memory.total for z in range(4)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4

    def test_fsdp_buffers_as_the_workers_run_zero(self):
        """ZeRO-2 keeps FSDP's sharded copy beside the gathered parameters; ZeRO-3 gathers one block and
        prefetches the next; accumulating without gradient sync keeps the gradients unsharded."""
        model = ModelConfig(**MODEL_PRESETS["gpt-13b"])
        params = model.num_params
        block, root = layer_params(model), stage_params(model, layers=0, first=True, last=True)
        mem = {(z, gb): estimate(gpu_spec("gpt-13b", {"dp": 8, "zero": z}, {"global_batch": gb})).memory
               for z in range(4) for gb in (8, 64)}
        for gb in (8, 64):
            assert mem[0, gb].fsdp_buffers == mem[1, gb].fsdp_buffers == 0
        assert mem[2, 8].fsdp_buffers == pytest.approx(2 * params / 8 + 2 * max(block, root), rel=1e-6)
        assert mem[3, 8].fsdp_buffers == pytest.approx(2 * 2 * max(block, root) + 2 * max(block, root), rel=1e-6)
        assert mem[2, 64].fsdp_buffers == pytest.approx(2 * params / 8 + 2 * params, rel=1e-6)
        assert mem[3, 64].fsdp_buffers == pytest.approx(2 * 2 * max(block, root) + 2 * params, rel=1e-6)
        # So with accumulation, ZeRO-2 saves nothing over ZeRO-1 in this build.
        assert mem[2, 64].total > mem[1, 64].total
        # A pipeline keeps ZeRO-3's parameters gathered until the stage's last backward.
        piped = estimate(gpu_spec("gpt-13b", {"dp": 4, "pp": 2, "zero": 3}, {"global_batch": 64})).memory
        stage = stage_params(model, layers=20, first=True, last=False)
        assert piped.fsdp_buffers == pytest.approx(2 * stage + 2 * stage, rel=1e-6)

    def test_memory_falls_with_tensor_parallelism(self):
        totals = [estimate(gpu_spec("gpt-13b", {"tp": t, "dp": 1})).memory.total for t in (1, 2, 4, 8)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4

    def test_memory_falls_with_pipeline_parallelism(self):
        totals = [estimate(gpu_spec("gpt-13b", {"pp": p})).memory.total for p in (1, 2, 4, 8)]
        assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4

    def test_activation_checkpointing_and_sequence_parallel_cut_activations(self):
        plain = estimate(gpu_spec("gpt-7b", {"tp": 4})).memory.activations
        sp = estimate(gpu_spec("gpt-7b", {"tp": 4, "sequence_parallel": True})).memory.activations
        ac = estimate(gpu_spec("gpt-7b", {"tp": 4}, {"activation_checkpointing": True})).memory.activations
        assert sp < plain and ac < sp

    def test_worst_stage_of_1f1b_is_the_first(self):
        est = estimate(gpu_spec("gpt-7b", {"pp": 4}))
        model = ModelConfig(**MODEL_PRESETS["gpt-7b"])
        assert est.memory.stage == 0
        assert est.in_flight_microbatches == 4  # min(P, M) on stage 0
        assert est.layers_per_stage == 8
        assert est.params_per_rank == math.ceil(stage_params(model, layers=8, first=True, last=False))

    def test_gpipe_holds_every_micro_batch(self):
        one = estimate(gpu_spec("gpt-7b", {"pp": 4, "pp_schedule": "1f1b"}))
        gpipe = estimate(gpu_spec("gpt-7b", {"pp": 4, "pp_schedule": "gpipe"}))
        assert gpipe.in_flight_microbatches == gpipe.microbatches == 512
        assert gpipe.memory.activations > one.memory.activations
        assert gpipe.bubble_fraction == one.bubble_fraction == pytest.approx(3 / (512 + 3))

    def test_dp_communication_per_zero_stage(self):
        dp = 8
        vols = {(zero, gb): estimate(gpu_spec("gpt-1b", {"dp": dp, "zero": zero}, {"global_batch": gb})).comm.dp
                for zero in range(4) for gb in (8, 32)}
        n = estimate(gpu_spec("gpt-1b", {"dp": dp})).params_per_rank
        grads, params = 2 * n, 2 * n  # bf16
        ring = (dp - 1) / dp
        assert vols[0, 8] == pytest.approx(2 * ring * grads)  # ring all-reduce
        assert vols[1, 8] == pytest.approx(2 * ring * grads + ring * params)  # + ZeroRedundancyOptimizer broadcast
        assert vols[2, 8] == pytest.approx(ring * (grads + params))  # reduce-scatter + all-gather
        assert vols[3, 8] == pytest.approx(ring * (grads + 2 * params))  # + 1 all-gather
        # Gradients are reduced once per step; FSDP re-gathers parameters for every micro-batch (4 here).
        assert vols[0, 32] == vols[0, 8] and vols[1, 32] == vols[1, 8]
        assert vols[2, 32] == pytest.approx(ring * (grads + 4 * params))
        assert vols[3, 32] == pytest.approx(ring * (grads + 8 * params))
        assert estimate(gpu_spec("gpt-1b", {"dp": 1})).comm.dp == 0

    def test_tp_and_pp_communication(self):
        model = ModelConfig(**MODEL_PRESETS["gpt-1b"])
        est = estimate(gpu_spec("gpt-1b", {"tp": 4, "pp": 2}))
        m, hidden = est.microbatches, model.seq_len * 1 * model.d_model * 2
        layers = model.n_layers // 2
        # 4 all-reduces per layer per micro-batch + the vocab-parallel embedding (stage 0) or the head
        # plus its logits all-gather (last stage, the busier one).
        logits = model.seq_len * model.vocab_size * 2
        assert est.comm.tp == pytest.approx(m * ((4 * layers + 1) * 2 * 3 / 4 * hidden + 3 / 4 * logits), rel=1e-9)
        # Two stages: each sends one activation (or gradient) per micro-batch.
        assert est.comm.pp == pytest.approx(m * hidden)
        sp = estimate(gpu_spec("gpt-1b", {"tp": 4, "pp": 4, "sequence_parallel": True}))
        assert sp.comm.pp == pytest.approx(sp.microbatches * 2 * hidden / 4)  # middle stages send both ways

    def test_flops_per_step(self):
        spec = gpu_spec("gpt-7b", {"dp": 8})
        model = ModelConfig(**MODEL_PRESETS["gpt-7b"])
        tokens = 512 * model.seq_len
        matmul_params = model.num_params - (model.vocab_size + model.seq_len) * model.d_model
        expected = 6 * matmul_params * tokens + 12 * model.n_layers * model.d_model * model.seq_len * tokens
        est = estimate(spec)
        assert est.flops_per_step == pytest.approx(expected)
        assert est.flops_per_step_with_recompute == est.flops_per_step
        ac = estimate(gpu_spec("gpt-7b", {"dp": 8}, {"activation_checkpointing": True}))
        assert ac.flops_per_step_with_recompute == pytest.approx(expected * 8 / 6, rel=1e-3)

    def test_device_memory_defaults_and_headroom(self):
        assert estimate(make_spec()).device_memory_bytes == 8 * GiB
        assert estimate(gpu_spec("gpt-1b")).device_memory_bytes == 80 * GiB
        est = estimate(gpu_spec("gpt-1b", device_memory_gb=40))
        assert est.device_memory_bytes == 40 * GiB
        assert est.headroom_bytes == 40 * GiB - est.memory.total and est.fits

    def test_to_dict_is_json(self):
        data = json.loads(json.dumps(estimate(gpu_spec("gpt-7b", {"dp": 2, "tp": 2, "pp": 2})).to_dict()))
        assert data["layout"] == "pp2·dp2·tp2 zero=0 1f1b"
        assert set(data["memory"]["gib"]) >= {"parameters", "gradients", "optimizer_states", "activations", "total"}
        assert data["memory"]["bytes"]["total"] == sum(
            v for k, v in data["memory"]["bytes"].items() if k != "total")
        assert data["world_size"] == 8


# ---------------------------------------------------------------------------------------------
# check_plan(): every rule, with its field and numbers
# ---------------------------------------------------------------------------------------------


def with_layout(spec: JobSpec, **layout) -> JobSpec:
    """Bypass pydantic so rules that the field types already guard are still reachable."""
    return spec.with_layout(ParallelismSpec.model_construct(**{**ParallelismSpec().model_dump(), **layout}))


class TestRules:
    def test_a_valid_plan_has_no_problems(self):
        assert check_plan(make_spec(parallelism={"dp": 2, "tp": 2, "pp": 2})) == []

    @pytest.mark.parametrize("axis", ["dp", "tp", "pp", "virtual_stages"])
    def test_degrees_below_one(self, axis):
        problems = check_plan(with_layout(make_spec(), **{axis: 0}))
        assert fields(problems) == [f"parallelism.{axis}"]
        assert "must be an integer >= 1" in problems[0].message

    def test_tp_must_divide_heads(self):
        problems = check_plan(make_spec(parallelism={"tp": 3}))  # gpt-tiny: 4 heads, d=64, vocab 256
        assert "parallelism.tp" in fields(problems)
        text = " ".join(p.message for p in problems)
        assert "model.n_heads=4" in text and "model.d_model=64" in text and "world = dp·tp·pp = 1·3·1 = 3" in text
        assert "[1, 2, 4]" in problems[0].fix

    def test_tp_must_divide_the_vocabulary(self):
        problems = check_plan(make_spec(parallelism={"tp": 4}, vocab_size=258))
        assert fields(problems) == ["parallelism.tp"]
        assert "model.vocab_size=258" in problems[0].message and "column-parallel" in problems[0].message

    def test_tp_must_divide_the_mlp(self):
        problems = check_plan(make_spec(parallelism={"tp": 4}, d_ff=130))
        assert fields(problems) == ["parallelism.tp"]
        assert "model.ffn_dim=130" in problems[0].message

    def test_sequence_parallel_needs_tp(self):
        problems = check_plan(make_spec(parallelism={"sequence_parallel": True}))
        assert fields(problems) == ["parallelism.sequence_parallel"]
        assert "tp=1" in problems[0].message

    def test_sequence_parallel_needs_seq_len_divisible(self):
        problems = check_plan(make_spec(parallelism={"tp": 4, "sequence_parallel": True}, seq_len=66))
        assert fields(problems) == ["parallelism.sequence_parallel"]
        assert "seq_len=66" in problems[0].message

    def test_layers_divide_into_stages(self):
        problems = check_plan(make_spec(parallelism={"pp": 3}))  # 4 layers
        assert fields(problems) == ["parallelism.pp"]
        assert "n_layers=4" in problems[0].message and "3" in problems[0].message
        assert "[1, 2, 4]" in problems[0].fix

    def test_layers_divide_into_virtual_stages(self):
        spec = make_spec(parallelism={"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 4})
        problems = check_plan(spec)
        assert fields(problems) == ["parallelism.virtual_stages"]
        assert "pp·virtual_stages = 2·4 = 8" in problems[0].message

    @pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
    def test_too_few_micro_batches_to_fill_the_pipe(self, schedule):
        spec = make_spec(parallelism={"pp": 4, "pp_schedule": schedule}, n_layers=8,
                         training={"global_batch": 2})
        problems = check_plan(spec)
        assert fields(problems) == ["parallelism.microbatches"]
        assert "at least 4 micro-batches" in problems[0].message and "= 2" in problems[0].message

    def test_interleaved_needs_micro_batches_divisible_by_pp(self):
        spec = make_spec(parallelism={"pp": 2, "pp_schedule": "interleaved_1f1b", "virtual_stages": 2},
                         training={"global_batch": 6, "micro_batch": 2})
        problems = check_plan(spec)
        assert fields(problems) == ["parallelism.microbatches"]
        assert "divisible by pp=2" in problems[0].message and "= 3" in problems[0].message

    def test_interleaved_needs_virtual_stages(self):
        problems = check_plan(make_spec(parallelism={"pp": 2, "pp_schedule": "interleaved_1f1b"}))
        assert fields(problems) == ["parallelism.virtual_stages"]

    def test_interleaved_needs_a_pipeline(self):
        problems = check_plan(make_spec(parallelism={"pp_schedule": "interleaved_1f1b", "virtual_stages": 2}))
        assert fields(problems) == ["parallelism.pp_schedule"]

    def test_plain_schedules_have_one_stage_per_rank(self):
        problems = check_plan(make_spec(parallelism={"pp": 2, "virtual_stages": 2}))
        assert fields(problems) == ["parallelism.virtual_stages"]

    def test_zero_needs_data_parallel_ranks(self):
        problems = check_plan(make_spec(parallelism={"zero": 2}))
        assert fields(problems) == ["parallelism.zero"]
        assert "dp=1" in problems[0].message
        # ...unless the job may grow elastically.
        assert check_plan(make_spec(parallelism={"zero": 2}, resources={"max_dp": 4})) == []

    def test_memory_names_the_biggest_component_and_the_fixes(self):
        spec = gpu_spec("gpt-13b", {"dp": 8})
        problems = check_plan(spec)
        assert fields(problems) == ["parallelism"]
        message, fix = problems[0].message, problems[0].fix
        assert "exceeds the device memory 80.0 GiB" in message
        assert "the biggest component is optimizer states" in message
        assert "parallelism.zero=1" in fix and "(fits)" in fix

    def test_activation_memory_suggests_checkpointing(self):
        spec = gpu_spec("gpt-7b", {"dp": 8, "zero": 3}, {"micro_batch": 4})
        problems = check_plan(spec)
        assert fields(problems) == ["parallelism"]
        assert "the biggest component is activations" in problems[0].message
        assert "training.activation_checkpointing=true" in problems[0].fix
        assert "training.micro_batch=1" in problems[0].fix

    def test_elastic_shrink_must_still_fit(self):
        spec = gpu_spec("gpt-13b", {"dp": 8, "zero": 3}, min_dp=1, max_dp=8)
        problems = check_plan(spec)
        assert fields(problems) == ["resources.min_dp"]
        assert "resources.min_dp=1" in problems[0].message

    def test_70b_on_eight_80gb_gpus_is_rejected_for_memory(self):
        for layout in ({"dp": 8, "zero": 3}, {"tp": 8}, {"pp": 8}, {"dp": 2, "tp": 4, "zero": 3}):
            problems = check_plan(gpu_spec("gpt-70b", layout, {"activation_checkpointing": True}))
            assert fields(problems) == ["parallelism"], layout
            assert "estimated memory per rank" in problems[0].message
            assert "exceeds the device memory 80.0 GiB" in problems[0].message


# ---------------------------------------------------------------------------------------------
# resolve_auto()
# ---------------------------------------------------------------------------------------------


class TestAuto:
    def test_small_model_uses_pure_data_parallelism(self):
        plan = resolve_auto(make_spec(parallelism={"auto": True, "max_workers": 8}))
        assert isinstance(plan, AutoPlan)
        assert (plan.layout.dp, plan.layout.tp, plan.layout.pp, plan.layout.zero) == (8, 1, 1, 0)
        assert plan.estimate.fits and plan.candidates_considered > 1
        assert "tp=1: the model fits without tensor parallelism" in plan.reasons
        assert "pp=1: the model fits without pipeline parallelism" in plan.reasons
        assert any(r.startswith("dp=8") for r in plan.reasons)
        assert check_plan(make_spec(parallelism=plan.layout.model_dump())) == []

    def test_dp_respects_the_global_batch(self):
        plan = resolve_auto(make_spec(parallelism={"auto": True, "max_workers": 8}, training={"global_batch": 12}))
        assert 12 % plan.layout.dp == 0 and plan.layout.dp * plan.layout.tp * plan.layout.pp <= 8

    def test_elastic_floor_must_fit_too(self):
        spec = gpu_spec("gpt-13b", {"auto": True, "max_workers": 8}, min_dp=2, max_dp=8)
        plan = resolve_auto(spec)
        assert plan.layout.dp >= 2
        assert check_plan(spec.with_layout(plan.layout)) == []

    def test_literal_auto_budget_comes_from_resources(self):
        assert resolve_auto(make_spec(parallelism="auto")).estimate.world_size == 1
        assert resolve_auto(make_spec(parallelism="auto", resources={"max_dp": 4})).estimate.world_size == 4

    def test_explicit_layouts_are_not_resolved(self):
        with pytest.raises(ValueError, match="auto"):
            resolve_auto(make_spec(parallelism={"dp": 2}))

    def test_zero_when_optimizer_states_do_not_fit(self):
        plan = resolve_auto(gpu_spec("gpt-7b", {"auto": True, "max_workers": 8}))
        assert plan.layout.zero > 0 and plan.estimate.fits
        zero_reason = next(r for r in plan.reasons if r.startswith(f"zero={plan.layout.zero}"))
        assert "optimizer states" in zero_reason and "exceeds 80.0 GiB" in zero_reason

    def test_70b_fits_on_64_gpus(self):
        spec = gpu_spec("gpt-70b", {"auto": True, "max_workers": 64})
        plan = resolve_auto(spec)
        assert plan.estimate.fits and plan.estimate.world_size <= 64
        assert plan.layout.tp > 1 or plan.layout.pp > 1
        chosen = spec.with_layout(plan.layout)
        assert check_plan(chosen) == [] and check_plan(spec) == []
        assert any(r.startswith(f"tp={plan.layout.tp}: no layout with tp=1 fits") for r in plan.reasons)
        assert plan.reasons[-1].startswith(f"chosen {plan.estimate.layout}")

    def test_70b_same_job_rejected_on_8_accepted_on_64(self):
        training = {"global_batch": 512, "micro_batch": 1}
        eight = check_plan(gpu_spec("gpt-70b", {"dp": 8, "zero": 3}, training))
        assert fields(eight) == ["parallelism"] and "estimated memory per rank" in eight[0].message
        auto = gpu_spec("gpt-70b", {"auto": True, "max_workers": 64}, training)
        assert check_plan(auto) == [] and plan_report(auto)["feasible"] is True

    def test_70b_does_not_fit_on_8_gpus(self):
        spec = gpu_spec("gpt-70b", {"auto": True, "max_workers": 8}, {"activation_checkpointing": True})
        with pytest.raises(SpecRejected) as caught:
            resolve_auto(spec)
        problem = caught.value.problems[0]
        assert problem.field == "parallelism.max_workers"
        assert "no layout of at most 8 workers fits in 80.0 GiB/rank" in problem.message
        assert fields(check_plan(spec)) == ["parallelism.max_workers"]

    def test_pipeline_only_when_needed(self):
        # dp pinned to 1: 70B needs more than one node's tensor parallelism, so the planner adds stages.
        spec = gpu_spec("gpt-70b", {"auto": True, "max_workers": 16}, {"activation_checkpointing": True}, max_dp=1)
        plan = resolve_auto(spec)
        assert (plan.layout.dp, plan.layout.tp, plan.layout.pp) == (1, 8, 2)
        assert any(r.startswith("pp=2: no layout with pp=1 fits") for r in plan.reasons)
        assert any(r.startswith(f"pp_schedule={plan.layout.pp_schedule}") for r in plan.reasons)
        # Something that fits on one node's tensor parallelism gets no pipeline.
        assert resolve_auto(gpu_spec("gpt-13b", {"auto": True, "max_workers": 16}, max_dp=1)).layout.pp == 1

    def test_choice_is_the_fastest_of_the_simplest_axes(self):
        spec = gpu_spec("gpt-13b", {"auto": True, "max_workers": 16})
        plan = resolve_auto(spec)
        for dp, tp, zero in ((16, 1, 0), (2, 8, 0)):
            alt = estimate(spec.with_layout(ParallelismSpec(dp=dp, tp=tp, zero=zero)))
            assert not alt.fits or alt.step_time.total_s >= plan.estimate.step_time.total_s * 0.95


# ---------------------------------------------------------------------------------------------
# plan_report(): the POST /v1/plan body
# ---------------------------------------------------------------------------------------------


class TestReport:
    def test_feasible_explicit_plan(self):
        report = json.loads(json.dumps(plan_report(make_spec(parallelism={"dp": 2}))))
        assert report["feasible"] is True and report["problems"] == []
        assert report["layout"] == "pp1·dp2·tp1 zero=0" and report["auto"] is None
        assert report["estimate"]["memory"]["fits"] is True

    def test_infeasible_plan_lists_spec_and_planner_problems(self):
        spec = gpu_spec("gpt-70b", {"dp": 8, "zero": 3}, {"global_batch": 500})
        report = plan_report(spec)
        assert report["feasible"] is False
        assert {"training.global_batch", "parallelism"} <= {p["field"] for p in report["problems"]}
        assert report["estimate"]["memory"]["fits"] is False

    def test_auto_report(self):
        report = json.loads(json.dumps(plan_report(gpu_spec("gpt-70b", {"auto": True, "max_workers": 64}))))
        assert report["feasible"] is True
        assert report["auto"]["layout"]["dp"] * report["auto"]["layout"]["tp"] * report["auto"]["layout"]["pp"] <= 64
        assert report["layout"] == report["auto"]["layout_text"] == report["estimate"]["layout"]
        assert report["auto"]["reasons"]

    def test_auto_report_when_nothing_fits(self):
        report = plan_report(gpu_spec("gpt-70b", {"auto": True, "max_workers": 8}))
        assert report["feasible"] is False and report["estimate"] is None and report["auto"] is None
        assert [p["field"] for p in report["problems"]] == ["parallelism.max_workers"]

    def test_degenerate_layout_reports_without_estimate(self):
        report = plan_report(with_layout(make_spec(), tp=0))
        assert report["feasible"] is False and report["estimate"] is None
